"""What ``dflash roofline`` knows offline: Apple chips' memory bandwidth and the shapes of
the registry's pairs. Numbers from Apple's published specifications and the model cards;
all of them estimates for a cost model, never a measurement (no Mac ran here).
"""

from __future__ import annotations

import itertools

# Memory bandwidth in GB/s (Apple's published figures). Where a chip came in two
# bandwidths, the full chip's is listed and the note names the other.
CHIPS: dict[str, tuple[float, str]] = {
    "M1": (68.25, ""),
    "M1 Pro": (200.0, ""),
    "M1 Max": (400.0, ""),
    "M1 Ultra": (800.0, ""),
    "M2": (100.0, ""),
    "M2 Pro": (200.0, ""),
    "M2 Max": (400.0, ""),
    "M2 Ultra": (800.0, ""),
    "M3": (100.0, ""),
    "M3 Pro": (150.0, ""),
    "M3 Max": (400.0, "the 30-core-GPU M3 Max has 300 GB/s"),
    "M3 Ultra": (819.0, ""),
    "M4": (120.0, ""),
    "M4 Pro": (273.0, ""),
    "M4 Max": (546.0, "the 32-core-GPU M4 Max has 410 GB/s"),
    "M5": (153.0, ""),
    "M5 Pro": (300.0, "reports disagree: 273 or 300 GB/s"),
    "M5 Max": (614.0, "the smaller-GPU M5 Max has 460 GB/s"),
}

# MLX's 4-bit quantized matmul at M rows over its cost at one row (qmv), by chip: the
# figures gathered in the mac-facts notes. Points are (rows, ratio), read between them
# linearly and past the last one along its last segment. Estimates: none measured here.
QMM_MEASURED: dict[str, tuple[tuple[tuple[int, float], ...], str]] = {
    "M3 Ultra": (((1, 1.0), (8, 6.1)), "mlx #4265: 6.1x at 8 rows, before MLX 0.32's qmv_wide"),
    "M4 Pro": (((1, 1.0), (8, 2.7)), "mlx #3839: ~2.7x at 8 rows with MLX 0.32's qmv_wide"),
    "M5 Pro": (
        ((1, 1.0), (4, 6.3 / 5.7), (5, 7.4 / 5.7)),
        "a user report: 5.7 / 6.3 / 7.4 ms at 1 / 4 / 5 rows, a cliff after 4",
    ),
}
# A chip without its own figure borrows its generation's nearest measured chip (M1-M3 share
# the M3 Ultra's, from before qmv_wide: MLX 0.32 roughly halves it on M4, #3764).
QMM_BORROW = {"M1": "M3 Ultra", "M2": "M3 Ultra", "M3": "M3 Ultra", "M4": "M4 Pro", "M5": "M5 Pro"}
# A kernel that reads each weight once for all rows pays only a per-row compute term; assumed
# equal to MLX's slope below the M5 Pro's cliff (4 rows: 6.3 / 5.7 ms, ~3.5% a row).
FEW_ROW_SLOPE = (6.3 / 5.7 - 1.0) / 3
FEW_ROW_MAX = 16  # rows the few-row kernel takes (model/qmm.py); wider goes to MLX's qmm


# Bytes per weight as mlx-community stores a target: affine 4 / 8 bits with a 16-bit scale
# and bias per 64 weights; mxfp8: 8 bits and one 8-bit scale per 32.
QUANT_BYTES = {"4bit": 0.5 + 4 / 64, "8bit": 1.0 + 4 / 64, "bf16": 2.0, "mxfp8": 1.0 + 1 / 32}

_QWEN3_DFLASH = {  # the DFlash drafters' shared backbone settings
    "model_type": "qwen3",
    "architectures": ["DFlash2DraftModel"],
    "layer_types": ["sliding_attention"] * 5,
    "sliding_window": 2048,
    "num_hidden_layers": 5,
}

# Target and drafter configs (the fields the byte counts read) of the registry's aliases.
# Qwen3.8-27B: a Qwen3.5-family hybrid (48 Gated DeltaNet + 16 gated-attention layers).
ARCHS: dict[str, dict[str, dict]] = {
    "Qwen3.8-27B": {
        "target": {
            "model_type": "qwen3_5",
            "hidden_size": 5120,
            "num_hidden_layers": 64,
            "intermediate_size": 17408,
            "num_attention_heads": 24,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "attn_output_gate": True,
            "full_attention_interval": 4,
            "linear_num_value_heads": 48,
            "linear_num_key_heads": 16,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "vocab_size": 248320,
            "tie_word_embeddings": False,
        },
        "drafter": {
            **_QWEN3_DFLASH,
            "hidden_size": 5120,
            "intermediate_size": 17408,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 248320,
            "dflash_config": {
                "block_size": 8,
                "target_layer_ids": [5, 19, 33, 47, 61],
                "conv_group_size": 16,
                "conv_kernel_size": 2,
                "selector_rank": 256,
            },
        },
    },
    "Qwen3-8B": {
        "target": {
            "model_type": "qwen3",
            "hidden_size": 4096,
            "num_hidden_layers": 36,
            "intermediate_size": 12288,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "tie_word_embeddings": False,
        },
        "drafter": {
            **_QWEN3_DFLASH,
            "architectures": ["DFlashDraftModel"],
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "dflash_config": {"block_size": 16, "target_layer_ids": [1, 9, 17, 25, 33]},
        },
    },
    "Qwen3-4B": {
        "target": {
            "model_type": "qwen3",
            "hidden_size": 2560,
            "num_hidden_layers": 36,
            "intermediate_size": 9728,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "tie_word_embeddings": True,
        },
        "drafter": {
            **_QWEN3_DFLASH,
            "architectures": ["DFlashDraftModel"],
            "hidden_size": 2560,
            "intermediate_size": 9728,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "dflash_config": {"block_size": 16, "target_layer_ids": [1, 9, 17, 25, 33]},
        },
    },
}


# The mixture-of-experts aliases. Targets: the fields of the models' config.json
# (Qwen3.5/3.6-35B-A3B share one text config; Qwen3-Coder-30B-A3B is Qwen3-30B-A3B's
# shape). Drafters: z-lab's DFlash (1) checkpoints' config.json: the 35B-A3B ones have 8
# layers, hidden 2048, 32 / 4 heads, intermediate 6144, block 16, layers [1, 10, 19, 28,
# 37]. Qwen3-Coder-30B-A3B-DFlash's is not read here: its block 16 (model card) and the
# target's hidden size and vocabulary are known; its layers and widths are assumed the
# same as the 35B-A3B drafters' and its taps follow z-lab's spacing rule for 48 layers.
_QWEN35_MOE = {
    "model_type": "qwen3_5_moe",
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "attn_output_gate": True,
    "full_attention_interval": 4,
    "linear_num_value_heads": 32,
    "linear_num_key_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "vocab_size": 248320,
    "max_position_embeddings": 262144,
    "tie_word_embeddings": False,
}


def _dflash1(vocab: int, layer_ids: list[int]) -> dict:
    """A z-lab DFlash (1) drafter of the MoE targets (8 layers, hidden 2048, block 16)."""
    return {
        "model_type": "qwen3",
        "architectures": ["DFlashDraftModel"],
        "num_hidden_layers": 8,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": vocab,
        "dflash_config": {"block_size": 16, "target_layer_ids": layer_ids},
    }


ARCHS["Qwen3.6-35B-A3B"] = {
    "target": _QWEN35_MOE,
    "drafter": _dflash1(248320, [1, 10, 19, 28, 37]),
}
ARCHS["Qwen3.5-35B-A3B"] = ARCHS["Qwen3.6-35B-A3B"]
ARCHS["Qwen3-Coder-30B-A3B"] = {
    "target": {
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "intermediate_size": 6144,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": False,
    },
    "drafter": _dflash1(151936, [1, 12, 23, 34, 45]),
}


# gpt-oss-20b: openai/gpt-oss-20b's config.json (sliding and full attention alternate,
# window 128). Its drafter: z-lab/gpt-oss-20b-DFlash's 8 layers, hidden 2880, block 8 and
# taps; its heads are assumed the target's and its MLP width chosen to give the model
# card's 0.8B parameters (not read here).
ARCHS["gpt-oss-20b"] = {
    "target": {
        "model_type": "gpt_oss",
        "hidden_size": 2880,
        "num_hidden_layers": 24,
        "intermediate_size": 2880,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "vocab_size": 201088,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
    },
    "drafter": {
        "model_type": "qwen3",
        "architectures": ["DFlashDraftModel"],
        "num_hidden_layers": 8,
        "hidden_size": 2880,
        "intermediate_size": 7680,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 201088,
        "dflash_config": {"block_size": 8, "target_layer_ids": [1, 6, 11, 16, 21]},
    },
}


def chip(name: str) -> tuple[str, float, str]:
    """(the table's name, bandwidth in GB/s, note) of a chip named case-insensitively.

    Raises:
        KeyError: an unknown chip (the caller names the choices).
    """
    key = " ".join(name.split()).lower().replace("apple ", "")
    for k, (bw, note) in CHIPS.items():
        if k.lower() == key:
            return k, bw, note
    raise KeyError(name)


def qmm_rows(chip_name: str) -> tuple[tuple[tuple[int, float], ...], str]:
    """(points, source) of MLX's quantized-matmul row penalty on ``chip_name`` (a ``CHIPS``
    key); a chip without its own figure names the chip whose figure it borrows."""
    if chip_name in QMM_MEASURED:
        return QMM_MEASURED[chip_name]
    donor = QMM_BORROW[chip_name.split()[0]]
    points, _ = QMM_MEASURED[donor]
    return points, f"no figure for the {chip_name}: the {donor}'s ({QMM_MEASURED[donor][1]})"


def mlx_qmm_ratio(chip_name: str, rows: int) -> float:
    """MLX's quantized matmul at ``rows`` rows over one row on that chip (estimated)."""
    points, _ = qmm_rows(chip_name)
    for (m0, r0), (m1, r1) in itertools.pairwise(points):
        if rows <= m1 or (m1, r1) == points[-1]:
            return max(1.0, r0 + (r1 - r0) * (rows - m0) / (m1 - m0))
    return 1.0


def few_row_ratio(chip_name: str, rows: int) -> float:
    """The few-row kernel at ``rows`` rows over one row: one pass over the weights plus a
    per-row compute term; never above MLX's (the faster one is kept per shape). Estimated."""
    mlx = mlx_qmm_ratio(chip_name, rows)
    if rows > FEW_ROW_MAX:
        return mlx
    return min(mlx, 1.0 + FEW_ROW_SLOPE * (rows - 1))
