"""A tiny random pair for self-checks (``dflash doctor``): an mlx-lm ``qwen3`` target and a
matching DFlash 2 drafter, written in the released formats to a folder and read back the
way the loader reads a pair, with the backend's ops installed (Linux: the CPU twins).
"""

from __future__ import annotations

import json
from pathlib import Path

HIDDEN, LAYERS, VOCAB, BLOCK = 64, 4, 256, 8


def target_config(vocab_size: int = VOCAB) -> dict:
    """config.json of the tiny float32 ``qwen3`` target.

    Args:
        vocab_size: V.
    """
    return {
        "model_type": "qwen3",
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "intermediate_size": 2 * HIDDEN,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": HIDDEN // 4,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
    }


def write_pair(root: Path, seed: int = 0) -> tuple[Path, Path]:
    """Write a random target to ``root/target`` and its drafter to ``root/drafter``.

    Args:
        root: a writable folder. seed: RNG seed of both.

    Returns:
        (target folder, drafter folder).
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from .model.checkpoint import drafter_config, random_drafter, save_drafter

    tdir, ddir = Path(root) / "target", Path(root) / "drafter"
    tdir.mkdir(parents=True, exist_ok=True)
    cfg = target_config()
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(cfg))
    mx.save_safetensors(str(tdir / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (tdir / "config.json").write_text(json.dumps(cfg))
    dcfg = drafter_config(
        hidden_size=HIDDEN,
        vocab_size=VOCAB,
        num_target_layers=LAYERS,
        target_layer_ids=[0, LAYERS - 2],
        mask_token_id=1,
        block_size=BLOCK,
        num_hidden_layers=2,
        selector_rank=32,
    )
    save_drafter(ddir, random_drafter(dcfg, seed + 1), dcfg)
    return tdir, ddir


def load_pair(tdir: Path, ddir: Path):
    """Read a pair written by ``write_pair`` as the loader does (backend ops first).

    Args:
        tdir, ddir: the target and drafter folders.

    Returns:
        a ``DFlashModel``.
    """
    from mlx_lm.utils import load_model

    from .decoding.state import DFlashModel
    from .loading import backend
    from .model.checkpoint import load_drafter
    from .model.target import TargetAdapter

    backend.install()  # the backend's ops before any layer is wrapped (a no-op but on Linux)
    target = load_model(Path(tdir))[0]
    drafter = load_drafter(ddir)
    adapter = TargetAdapter(target, drafter.args.target_layer_ids)
    pair = DFlashModel(target, drafter, adapter, str(tdir), str(ddir), "tiny")
    backend.install(pair)
    return pair


def greedy_parity(pair, prompt: list[int], n: int = 16) -> tuple[list[int], list[int]]:
    """Greedy tokens of plain mlx-lm decoding and of DFlash (selector on) from one prompt.

    Args:
        pair: a ``DFlashModel``. prompt: token ids. n: tokens to generate.

    Returns:
        (plain tokens, DFlash tokens), n each.
    """
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from .decoding.acceptance import SamplingParams
    from .decoding.loop import DecodeOptions, decode

    plain = [int(t) for t, _ in generate_step(mx.array(prompt), pair.target, max_tokens=n)]
    opts = DecodeOptions(max_tokens=n, block_size=BLOCK, use_selector=True)
    out: list[int] = []
    for c in decode(pair, prompt, pair.make_cache(), SamplingParams(), opts):
        out += c.tokens
    return plain, out[:n]


def tie_gap(pair, prompt: list[int], plain: list[int], ours: list[int], at: int) -> float:
    """How far apart the target's logits of the two tokens chosen at ``at`` are, relative to
    the largest logit there: near 0 is a floating-point near-tie (docs/algorithm.md §4.2.1).

    Args:
        pair: a ``DFlashModel``. prompt: token ids. plain, ours: the two outputs, equal
            before ``at`` and both longer than it.
    """
    import mlx.core as mx

    logits = pair.target(mx.array(prompt + plain[:at])[None])[0, -1].astype(mx.float32)
    gap = mx.abs(logits[plain[at]] - logits[ours[at]]) / mx.maximum(mx.abs(logits).max(), 1.0)
    return float(gap)
