"""What ``dflash roofline`` knows offline: Apple chips' memory bandwidth and the shapes of
the registry's pairs. Numbers from Apple's published specifications and the model cards;
all of them estimates for a cost model, never a measurement (no Mac ran here).
"""

from __future__ import annotations

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
}


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
