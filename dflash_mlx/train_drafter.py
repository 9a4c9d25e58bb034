"""Train a DFlash 2 drafter against a frozen mlx-lm target (the demo pair's second half).

Usage::

    python -m dflash_mlx.train_drafter --target .work/demo_target --out .work/demo_drafter \
        --minutes 25 [--resume]

Recipe (DFlash, plus the DFlash 2 conv and selector): a training window of T tokens runs
through the target once; its layer outputs at ``target_layer_ids`` are the context features.
Random anchor positions a are drawn per window; each block is ``[x_a, mask, ..., mask]`` at
positions a..a+B-1 and sees the context rows < a (exactly what decoding feeds the drafter).
All blocks of a window run in one pass: they are stacked on the batch axis with per-block
RoPE offsets and an explicit attention mask over the shared context keys. Row k is trained
with cross-entropy against the target's greedy token for position a+k given the true prefix
(``--teacher corpus`` uses the corpus token), weighted by exp(-(k-1)/gamma). The selector
loss is a cross-entropy over the K lattice candidates of row k (gold inserted when missing
from the top-K) with the teacher's previous token as predecessor. The conv starts as the
identity and the codebooks near zero, so the untrained drafter is plain DFlash (S = U).

Published drafter files are written only by :func:`dflash_mlx.checkpoint.save_drafter`
(SPEC 2.2, bf16); ``train_state/`` keeps float32 weights and AdamW state for ``--resume``.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten

from dflash_mlx import corpus
from dflash_mlx.checkpoint import drafter_config, save_drafter
from dflash_mlx.config import DrafterArgs
from dflash_mlx.drafter import DFlashDrafter
from dflash_mlx.selector import top_candidates
from dflash_mlx.train_common import (
    CheckpointTimer,
    evaluate_drafter,
    held_windows,
    lr_at,
    make_blocks,
    make_progress,
    target_pass,
)
from dflash_mlx.train_target import load_checkpoint, save_checkpoint

DEMO_DRAFTER = {
    "num_hidden_layers": 2,
    "intermediate_size": 768,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "block_size": 8,
    "selector_rank": 64,
    "selector_top_k": 16,
    "conv_group_size": 16,
    "sliding_window": 2048,
}


def init_drafter(config: dict, seed: int = 0) -> DFlashDrafter:
    """A fresh drafter: identity conv (the module default), codebooks ~N(0, 0.02^2).

    Args:
        config: drafter config.json dict.
        seed: RNG seed.
    """
    mx.random.seed(seed)
    model = DFlashDrafter(DrafterArgs.from_dict(config))
    sel = model.candidate_selector
    sel.predecessor_codebook = 0.02 * mx.random.normal(sel.predecessor_codebook.shape)
    sel.successor_codebook = 0.02 * mx.random.normal(sel.successor_codebook.shape)
    mx.eval(model.parameters())
    return model


def drafter_losses(
    drafter,
    feats,
    embeds,
    anchor_ids,
    offsets,
    mask,
    labels,
    W,
    n_blocks,
    weights,
    sel_weight: float = 1.0,
):
    """Weighted block CE plus the selector CE for one batch (see the module docstring).

    Args:
        drafter: the DFlashDrafter being trained.
        feats: context features [S, T, nT*H]. embeds: block embeddings [N, B, H].
        anchor_ids: [N] anchor tokens (predecessor of row 1). offsets: [N] anchor positions.
        mask: [N, 1, B, T+B] bool. labels: [N, B-1] teacher tokens of rows 1..B-1.
        W: target embedding / LM-head matrix [V, H] (frozen). n_blocks: blocks per window.
        weights: position weights [B-1]. sel_weight: factor of the selector loss.

    Returns:
        (total loss, block CE, selector CE).
    """
    B = embeds.shape[1]
    kv = drafter.context_kv(drafter.project_context(feats), 0)
    kv = [(mx.repeat(k, n_blocks, axis=0), mx.repeat(v, n_blocks, axis=0)) for k, v in kv]
    h = drafter(embeds, kv, offsets, B, mask)[:, 1:]
    logits = drafter.logits(h, lambda t: t @ W.T).astype(mx.float32)
    wsum = weights.sum() * labels.shape[0]
    ce = (nn.losses.cross_entropy(logits, labels) * weights).sum() / wsum
    if not drafter.has_selector:
        return ce, ce, mx.array(0.0)
    scores, target = selector_scores(drafter, mx.stop_gradient(logits), h, anchor_ids, labels)
    sel_ce = (nn.losses.cross_entropy(scores, target) * weights).sum() / wsum
    return ce + sel_weight * sel_ce, ce, sel_ce


def selector_scores(drafter, logits, h, anchor_ids, labels):
    """Lattice scores of the gold path's predecessors over the top-K (gold forced in).

    Args:
        drafter: a DFlash 2 drafter. logits: [N, L, V] (gradient stopped by the caller).
        h: final normed hidden [N, L, H]. anchor_ids: [N]. labels: gold tokens [N, L].

    Returns:
        (scores [N, L, K] = U + (A[pred] * g) . B[cand], index of the gold token [N, L]).
    """
    sel, K = drafter.candidate_selector, drafter.args.selector_top_k
    U, cand = top_candidates(logits, K)
    cand = cand.astype(mx.int32)
    inside = (cand == labels[..., None]).any(-1, keepdims=True)
    swap = ~inside & (mx.arange(K) == K - 1)
    cand = mx.where(swap, labels[..., None], cand)
    U = mx.where(swap, mx.take_along_axis(logits, labels[..., None], axis=-1), U)
    target = mx.argmax(cand == labels[..., None], axis=-1)
    pred = mx.concatenate([anchor_ids[:, None], labels[:, :-1]], axis=1)
    a = sel.predecessor_codebook[pred] * sel.hidden_projection(h)  # [N, L, R]
    pair = (sel.successor_codebook[cand] @ a[..., None])[..., 0]  # [N, L, K]
    return U + pair, target


def default_layer_ids(n_layers: int, n_taps: int = 5) -> list:
    """Target layers to tap: all of a small target, else n_taps spread over 1..L-3."""
    if n_layers <= n_taps:
        return list(range(n_layers))
    return [round(v) for v in np.linspace(1, n_layers - 3, n_taps)]


def train(
    target_dir: Path,
    out: Path,
    minutes: float = 25.0,
    steps: int | None = None,
    resume: bool = False,
    drafter_kw: dict | None = None,
    batch: int = 16,
    seq: int = 256,
    n_blocks: int = 16,
    lr: float = 1e-3,
    warmup: int = 100,
    gamma: float = 4.0,
    teacher: str = "argmax",
    sel_weight: float = 1.0,
    eval_every_s: float = 300.0,
    ckpt_every_s: float = 180.0,
    eval_windows: int = 32,
    train_tokens: np.ndarray | None = None,
    heldout_tokens: np.ndarray | None = None,
    layer_ids=None,
    seed: int = 0,
    log_every: int = 10,
    quiet: bool = False,
) -> dict:
    """Train (or resume) a DFlash 2 drafter for the target in ``target_dir``.

    Args:
        target_dir: mlx-lm target folder (its tokenizer must have ``<|mask|>``).
        out: output folder: the drafter (SPEC 2.2) plus ``train_state/``.
        minutes: wall-clock budget, resumes included. steps: optional step budget.
        resume: continue from ``out/train_state``.
        drafter_kw: ``drafter_config`` overrides (``DEMO_DRAFTER`` by default).
        batch: windows per step. seq: window length T. n_blocks: anchors per window.
        lr: peak learning rate. warmup: warm-up steps. gamma: position-weight decay.
        teacher: ``"argmax"`` (target greedy given the true prefix) or ``"corpus"``.
        sel_weight: factor of the selector loss.
        eval_every_s, ckpt_every_s: seconds between evaluations / checkpoints.
        eval_windows: held-out windows per evaluation.
        train_tokens, heldout_tokens: token streams (default: the stdlib corpus; main
            held-out stream, i.e. without ``encodings/*``).
        layer_ids: target layers to tap (default: :func:`default_layer_ids`).
        seed: data seed. log_every: steps between log lines. quiet: no bar, no logs.

    Returns:
        Summary dict: step, losses, final evaluation, tokens/s, wall time.
    """
    import mlx_lm

    out = Path(out)
    target, tok = mlx_lm.load(str(target_dir))
    target.freeze()
    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    n_layers = tcfg["num_hidden_layers"]
    layer_ids = list(layer_ids or default_layer_ids(n_layers))
    mask_id = tok.convert_tokens_to_ids(corpus.MASK_TOKEN)
    if train_tokens is None or heldout_tokens is None:
        cache = corpus.build_corpus(None, tcfg["vocab_size"])
        train_tokens = (
            corpus.load_split(cache, "train").all() if train_tokens is None else train_tokens
        )
        heldout_tokens = (
            corpus.load_split(cache, "heldout").main if heldout_tokens is None else heldout_tokens
        )
    kw = dict(DEMO_DRAFTER, **(drafter_kw or {}))
    config = drafter_config(
        hidden_size=tcfg["hidden_size"],
        vocab_size=tcfg["vocab_size"],
        num_target_layers=n_layers,
        target_layer_ids=layer_ids,
        mask_token_id=mask_id,
        rope_theta=tcfg.get("rope_theta", 1e4),
        **kw,
    )
    drafter = init_drafter(config, seed)
    B = drafter.args.block_size
    optimizer = optim.AdamW(learning_rate=lr, betas=[0.9, 0.95], weight_decay=0.01)
    optimizer.init(drafter.trainable_parameters())
    ckpt = out / "train_state"
    st = {"step": 0, "elapsed_s": 0.0, "history": []}
    if resume and (ckpt / "state.json").exists():
        st = load_checkpoint(ckpt, drafter, optimizer)
    weights = mx.exp(-mx.arange(B - 1, dtype=mx.float32) / gamma)
    W = target.model.embed_tokens.weight
    held = held_windows(heldout_tokens, seq, eval_windows)
    state = [drafter.state, optimizer.state]
    loss_and_grad = nn.value_and_grad(drafter, drafter_losses)

    @partial(mx.compile, inputs=state, outputs=state)
    def step_fn(feats, embeds, anchor_ids, offsets, mask, labels, W):
        (loss, ce, sce), grads = loss_and_grad(
            drafter,
            feats,
            embeds,
            anchor_ids,
            offsets,
            mask,
            labels,
            W,
            n_blocks,
            weights,
            sel_weight,
        )
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(drafter, grads)
        return loss, ce, sce

    progress = make_progress(quiet)

    def log(msg):
        if not quiet:
            progress.console.log(msg)

    def do_eval(n=None):
        ev = evaluate_drafter(drafter, target, held[:n], layer_ids, n_blocks, mask_id)
        st["history"].append({"step": st["step"], **ev})
        log(f"eval step {st['step']}: " + json.dumps(ev))
        return ev

    def publish():
        st["elapsed_s"] = time.time() - t0
        save_checkpoint(ckpt, drafter, optimizer, st)
        save_drafter(out, drafter, config)

    t0 = time.time() - st["elapsed_s"]
    start_step, start_t = st["step"], time.time()
    timer = CheckpointTimer(ckpt_every_s, eval_every_s)
    losses = []
    with progress:
        task = progress.add_task("drafter", total=steps or None, loss=float("nan"), tps=0.0)
        while True:
            elapsed = time.time() - t0
            frac = max(elapsed / (minutes * 60.0), st["step"] / steps if steps else 0.0)
            if frac >= 1.0:
                break
            optimizer.learning_rate = lr_at(st["step"], frac, lr, warmup)
            rng = np.random.default_rng([seed, st["step"]])
            starts = rng.integers(0, len(train_tokens) - seq - 1, size=batch)
            xy = train_tokens[starts[:, None] + np.arange(seq + 1)].astype(np.int32)
            x = mx.array(xy[:, :-1])
            feats, greedy = target_pass(target, x, layer_ids)
            mx.eval(feats, greedy)
            lab = np.array(greedy) if teacher == "argmax" else xy[:, 1:]
            blk = make_blocks(
                xy[:, :-1], lab, n_blocks, B, mask_id, rng, drafter.args.sliding_window
            )
            ids = mx.array(blk["ids"])
            res = step_fn(
                feats,
                target.model.embed_tokens(ids),
                ids[:, 0],
                mx.array(blk["offsets"]),
                mx.array(blk["mask"]),
                mx.array(blk["labels"]),
                W,
            )
            mx.eval(res, state)
            losses.append([r.item() for r in res])
            st["step"] += 1
            tps = (st["step"] - start_step) * batch * seq / max(time.time() - start_t, 1e-9)
            progress.update(task, advance=1, loss=losses[-1][0], tps=tps)
            if st["step"] % log_every == 0:
                m = np.mean(losses[-log_every:], axis=0)
                log(
                    f"step {st['step']} loss {m[0]:.4f} ce {m[1]:.4f} sel {m[2]:.4f} "
                    f"tok/s {tps:.0f} elapsed {elapsed / 60:.1f} min"
                )
            due_ckpt, due_eval = timer.due()
            if due_eval:
                do_eval(max(4, len(held) // 4))
            if due_ckpt:
                publish()
    final = do_eval()
    publish()
    summary = {
        "step": st["step"],
        "losses": losses,
        "final": final,
        "wall_s": st["elapsed_s"],
        "tokens_per_s": (st["step"] - start_step) * batch * seq / max(time.time() - start_t, 1e-9),
        "params": sum(v.size for _, v in tree_flatten(drafter.parameters())),
    }
    (out / "train_summary.json").write_text(
        json.dumps({k: v for k, v in summary.items() if k != "losses"}, indent=1) + "\n"
    )
    log("done: " + json.dumps({k: v for k, v in summary.items() if k != "losses"}))
    return summary


def main(argv=None) -> None:
    """Command-line entry point (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--minutes", type=float, default=25.0)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--blocks", type=int, default=16, help="anchors per window")
    p.add_argument("--block-size", type=int, default=DEMO_DRAFTER["block_size"])
    p.add_argument("--layers", type=int, default=DEMO_DRAFTER["num_hidden_layers"])
    p.add_argument("--gamma", type=float, default=4.0)
    p.add_argument("--teacher", choices=["argmax", "corpus"], default="argmax")
    p.add_argument("--eval-every", type=float, default=300.0, help="seconds")
    p.add_argument("--ckpt-every", type=float, default=180.0, help="seconds")
    a = p.parse_args(argv)
    train(
        a.target,
        a.out,
        a.minutes,
        a.steps,
        a.resume,
        {"block_size": a.block_size, "num_hidden_layers": a.layers},
        a.batch,
        a.seq,
        a.blocks,
        a.lr,
        gamma=a.gamma,
        teacher=a.teacher,
        eval_every_s=a.eval_every,
        ckpt_every_s=a.ckpt_every,
    )


if __name__ == "__main__":
    main()
