"""Tiny random targets (mlx-lm architectures) and drafters written in the released format
(docs/format.md §2).

Shared by the test suite, the CLI/server tests and the benchmarks' smoke runs.
"""

from __future__ import annotations

import json
from pathlib import Path

# The package before MLX (conftest imports this module first, once the cache folder is
# set): MLX then binds the system OpenBLAS and the few-row kernel, as in a user's decode.
import dflash_mlx  # noqa: F401

# isort: split
import mlx.core as mx
from mlx.utils import tree_flatten

from dflash_mlx.model.checkpoint import drafter_config, random_drafter, save_drafter

SPECIALS = ["<|endoftext|>", "<|mask|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A Qwen3-style thinking template: the generation prompt opens "<think>\n" (closed at once when
# enable_thinking is false), an earlier assistant turn's reasoning_content is written back.
THINK = ["<think>", "</think>"]
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and m.get('reasoning_content') %}"
    "<think>\n{{ m['reasoning_content'] }}\n</think>\n\n{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
CORPUS = (
    "def parse_args(argv):\n    parser = argparse.ArgumentParser()\n    return parser\n"
    "import os\nimport sys\nfor i in range(10):\n    print(i, os.path.join('a', 'b'))\n"
    "class Foo:\n    def __init__(self, x):\n        self.x = x\n"
    "The quick brown fox jumps over the lazy dog. Hello world!\n"
) * 4


def train_tokenizer(texts, vocab_size: int, special_tokens):
    """A byte-level BPE trained with ``tokenizers`` on texts; special tokens get ids 0.."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def build_tokenizer(
    path: Path, vocab_size: int = 320, chat_template: bool = True, thinking: bool = False
) -> int:
    """Train a tiny byte-level BPE into path (without a chat template when chat_template is
    False: the default chat format then applies); return its vocabulary size. thinking: a
    thinking model's tokenizer (``THINK`` as added, non-special tokens, as Qwen3 has them,
    and ``THINKING_TEMPLATE``)."""
    tok = train_tokenizer([CORPUS], vocab_size, SPECIALS)
    if thinking:
        from tokenizers import AddedToken

        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": THINKING_TEMPLATE if thinking else CHAT_TEMPLATE,
        "model_max_length": 4096,
    }
    if not chat_template:
        del cfg["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tok.get_vocab_size()


def target_config(kind: str, vocab_size: int, hidden: int = 64, layers: int = 4, **moe) -> dict:
    """Config of a tiny 'qwen3' or 'qwen2' (dense), 'qwen3_5' or 'qwen3_next' (Gated
    DeltaNet + attention) target, or of a ``MOE_KINDS`` one (``moe`` as for ``moe_config``)."""
    base = {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": 2 * hidden,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden // 4,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }
    if kind == "qwen3":
        return {"model_type": "qwen3", "rope_theta": 10000.0, **base}
    if kind == "qwen2":  # dense, like qwen3, and with mlx-lm's pipeline parallelism
        return {"model_type": "qwen2", "rope_theta": 10000.0, **base}
    if kind == "qwen3_5":
        return {
            "model_type": "qwen3_5",
            "full_attention_interval": 2,
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
            "rope_parameters": {
                "type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
            **base,
        }
    if kind == "qwen3_next":  # the same mixer as qwen3_5 behind fused projections; no MoE
        linear = target_config("qwen3_5", vocab_size, hidden, layers)
        linear = {k: v for k, v in linear.items() if k.startswith("linear_")}
        return {
            "model_type": "qwen3_next",
            "full_attention_interval": 2,
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "num_experts": 0,
            "num_experts_per_tok": 0,
            "decoder_sparse_step": 1,
            "shared_expert_intermediate_size": 0,
            "mlp_only_layers": [],
            "moe_intermediate_size": 0,
            **linear,
            **base,
        }
    if kind in MOE_KINDS:
        return moe_config(kind, vocab_size, hidden, layers, **moe)
    if kind == "muse_glimmer":  # soft-capped logits, sliding + full attention
        return {
            "model_type": "muse_glimmer",
            "sliding_window": 8,
            "rope_theta": 10000.0,
            "qk_scale_factor": 1.0,
            **base,
        }
    raise ValueError(kind)


# Mixture-of-experts families: few experts so a verify's rows share some (the grouped verify
# then multiplies several rows by one expert), an expert width unlike the hidden one.
MOE_KINDS = ("qwen3_moe", "qwen3_5_moe", "gpt_oss")
EXPERTS, TOP_K = 8, 2


def moe_config(
    kind: str, vocab_size: int, hidden: int = 64, layers: int = 4, experts: int = EXPERTS,
    top_k: int = TOP_K, expert_dim: int = 48,
) -> dict:  # fmt: skip
    """Config of a tiny mixture-of-experts target: 'qwen3_moe' (every layer routed),
    'qwen3_5_moe' (Gated DeltaNet + attention, routed and shared experts: Qwen3.6-35B-A3B's
    shape) or 'gpt_oss' (sliding + full attention with sinks, biased experts); ``experts``
    of width ``expert_dim``, ``top_k`` per token."""
    moe = {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": expert_dim,
    }
    if kind == "qwen3_moe":
        base = target_config("qwen3", vocab_size, hidden, layers)
        extra = {"decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
        return {**base, **moe, **extra, "model_type": "qwen3_moe"}
    if kind == "qwen3_5_moe":
        base = target_config("qwen3_5", vocab_size, hidden, layers)
        return {**base, **moe, "shared_expert_intermediate_size": 32, "model_type": kind}
    if kind == "gpt_oss":
        base = target_config("qwen3", vocab_size, hidden, layers)
        types = ["sliding_attention", "full_attention"] * (layers // 2)
        return {
            **{k: base[k] for k in ("hidden_size", "num_hidden_layers", "head_dim")},
            **{k: base[k] for k in ("num_attention_heads", "num_key_value_heads")},
            **{k: base[k] for k in ("vocab_size", "rms_norm_eps", "tie_word_embeddings")},
            "model_type": "gpt_oss",
            "num_local_experts": experts,
            "num_experts_per_tok": top_k,
            "intermediate_size": expert_dim,
            "sliding_window": 8,
            "rope_theta": 10000,
            "layer_types": types,
        }
    raise ValueError(kind)


def build_target(
    path: Path,
    kind: str = "qwen3",
    seed: int = 0,
    vocab_size: int | None = None,
    tokenizer: bool = True,
    chat_template: bool = True,
    context: int | None = None,
    thinking: bool = False,
    **kw,
) -> Path:
    """Write a tiny random float32 target (config, weights, tokenizer) to path; context
    sets max_position_embeddings (4096 by default); thinking: a thinking tokenizer
    (``build_tokenizer``)."""
    from mlx_lm.utils import _get_classes

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    V = (
        build_tokenizer(path, chat_template=chat_template, thinking=thinking)
        if tokenizer
        else vocab_size
    )
    V = vocab_size or V
    cfg = target_config(kind, V, **kw)
    if context is not None:
        cfg["max_position_embeddings"] = context
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(cfg))
    params = [(k, v) for k, v in tree_flatten(model.parameters())]
    model.load_weights(params)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    cfg["eos_token_id"] = 3
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def build_drafter(
    path: Path, target_dir: Path, dflash2: bool = True, seed: int = 1, block_size: int = 16, **kw
) -> Path:
    """Write a tiny random drafter fitting the target in target_dir."""
    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    n = tcfg["num_hidden_layers"]
    cfg = drafter_config(
        hidden_size=tcfg["hidden_size"],
        vocab_size=tcfg["vocab_size"],
        num_target_layers=n,
        target_layer_ids=kw.pop("target_layer_ids", [0, n - 2]),
        mask_token_id=1,
        block_size=block_size,
        num_hidden_layers=kw.pop("num_hidden_layers", 2),
        dflash2=dflash2,
        selector_rank=kw.pop("selector_rank", 32),
        **kw,
    )
    return save_drafter(path, random_drafter(cfg, seed), cfg)


def thinking_pair(root: Path, seed: int = 0) -> tuple[Path, Path]:
    """(target dir, drafter dir) of a tiny qwen3 thinking model: ``<think>`` / ``</think>``
    are tokens and its Qwen3-style template honours ``enable_thinking``."""
    target = build_target(root / "think_t", "qwen3", seed=seed, thinking=True)
    return target, build_drafter(root / "think_d", target)


def eight_token_pair(root: Path, kind: str = "qwen3"):
    """A tiny target (qwen3, or ``kind``: qwen3_5 is a hybrid) with an 8-token vocabulary
    and its DFlash 2 drafter (block 4), loaded as a DFlashModel: small enough to enumerate
    the exact sampling law."""
    from mlx_lm.utils import load_model

    from dflash_mlx.decoding.state import DFlashModel
    from dflash_mlx.model.checkpoint import load_drafter
    from dflash_mlx.model.target import TargetAdapter

    layers = 2 if kind != "qwen3" else 4  # a hybrid's: one Gated DeltaNet, one attention
    build_target(root / "t", kind, tokenizer=False, vocab_size=8, seed=5, layers=layers)
    build_drafter(root / "d", root / "t", dflash2=True, block_size=4, seed=7)
    target = load_model(root / "t")[0]
    drafter = load_drafter(root / "d", mx.float32)
    return DFlashModel(target, drafter, TargetAdapter(target, drafter.args.target_layer_ids))
