"""Train a DFlash 2 drafter on self-distillation shards (the target's own greedy answers).

Usage::

    python -m dflash_mlx.train.drafter --data .work/distill --out .work/demo_drafter \
        --minutes 120 [--resume]

Recipe (DFlash, plus the DFlash 2 conv and selector): every answer's stored target features
are the context; random anchors inside the answer start blocks ``[x_a, mask, ...]`` that see
the context rows < a; all blocks of a batch run in one pass (stacked on the batch axis with
per-block RoPE offsets and an explicit attention mask). Row k is trained with cross-entropy
against the target's greedy token for position a+k, weighted by exp(-(k-1)/gamma); the
selector with a cross-entropy over the K lattice candidates of row k (gold inserted when it is
missing from the top-K), the gold previous token as predecessor. The conv starts as the
identity and the codebooks near zero, so the untrained drafter is plain DFlash.

Published files are written by :func:`dflash_mlx.model.checkpoint.save_drafter` (bf16, the
released format); ``train_state/`` keeps float32 weights and AdamW state for ``--resume``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from dflash_mlx.model.checkpoint import drafter_config, save_drafter
from dflash_mlx.model.target import TargetAdapter
from dflash_mlx.train.common import (
    Every,
    init_drafter,
    load_checkpoint,
    lr_at,
    save_checkpoint,
    warm_start,
)
from dflash_mlx.train.data import ShardSet, build_batch, eval_anchors, feature_scale
from dflash_mlx.train.evaluate import evaluate, to_device
from dflash_mlx.train.objective import make_step

DEMO_SHAPE = {
    "num_hidden_layers": 2,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "block_size": 8,
    "selector_rank": 32,
    "selector_top_k": 16,
    "conv_group_size": 16,
    "sliding_window": 2048,
}


def shortlist(data: ShardSet, vocab: int, cap: int, floor: int = 256) -> np.ndarray:
    """Token ids the training head scores: every answer label (at least ``floor`` tokens,
    the most frequent first), or the ``cap`` most frequent. Softmax over all 49k entries
    costs most of a CPU step (MLX's CPU exp is scalar); held-out evaluation always uses the
    full vocabulary."""
    counts = data.label_counts(vocab)
    order = np.argsort(-counts, kind="stable")
    n = min(cap, vocab, max(int((counts > 0).sum()), floor))
    return np.sort(order[:n]).astype(np.int32)


def data_roots(data_dir) -> tuple:
    """(train split folders, held-out split folder) of a distill folder (``train/``,
    ``heldout/``) or of an explicit ``(train folders, held-out folder)`` pair."""
    if isinstance(data_dir, tuple):
        return [Path(r) for r in data_dir[0]], Path(data_dir[1])
    return [Path(data_dir) / "train"], Path(data_dir) / "heldout"


def setup(target, data_dir, out: Path, shape: dict, lr: float, resume: bool, seed: int):
    """Adapter, drafter config, drafter, optimizer and counters (restored with ``resume``)."""
    meta = json.loads((data_roots(data_dir)[0][0] / "meta.json").read_text())
    adapter = TargetAdapter(target, meta["layer_ids"])
    args = target.args
    config = drafter_config(
        hidden_size=args.hidden_size,
        vocab_size=args.vocab_size,
        num_target_layers=args.num_hidden_layers,
        target_layer_ids=meta["layer_ids"],
        mask_token_id=shape.pop("mask_token_id"),
        rope_theta=shape.pop("rope_theta", 1e4),
        rms_norm_eps=args.rms_norm_eps,
        **shape,
    )
    drafter = init_drafter(config, seed)
    optimizer = optim.AdamW(learning_rate=lr, betas=[0.9, 0.95], weight_decay=0.01)
    optimizer.init(drafter.trainable_parameters())
    st = {"step": 0, "elapsed_s": 0.0, "history": []}
    if resume and (out / "train_state" / "state.json").exists():
        st = load_checkpoint(out / "train_state", drafter, optimizer)
    return adapter, config, drafter, optimizer, st


def standardize(data: ShardSet, drafter, opt, state_dir: Path, resume: bool) -> np.ndarray:
    """The feature scale of this run (see ``data.feature_scale``): kept in ``state_dir``; a
    run resumed from before scaling gets ``fc`` rescaled to the same function and fresh
    Adam moments for it."""
    path = state_dir / "feature_scale.npy"
    if resume and path.exists():
        return np.load(path)
    scale = feature_scale(data)
    if resume and (state_dir / "state.json").exists():
        drafter.fc.weight = drafter.fc.weight * mx.array(scale)[None, :]
        m = opt.state["fc"]["weight"]
        opt.state["fc"]["weight"] = {k: mx.zeros_like(v) for k, v in m.items()}
        mx.eval(drafter.fc.weight, opt.state)
    return scale


class Batches:
    """Reproducible training batches (seeded by step), labels mapped onto the shortlist."""

    def __init__(self, data: ShardSet, drafter, seqs, n_blocks, gamma, vocab_ids, seed, soft_k=0):
        self.data, self.args, self.seqs, self.n_blocks, self.seed = (
            data,
            drafter.args,
            seqs,
            n_blocks,
            seed,
        )
        self.soft_k = soft_k if data.has_soft else 0
        B = self.args.block_size
        self.pos_w = np.exp(-np.arange(B - 1) / gamma).astype(np.float32)
        self.index = np.full(self.args.vocab_size, -1, np.int64)
        self.index[vocab_ids] = np.arange(len(vocab_ids))

    def __call__(self, step: int):
        a, rng = self.args, np.random.default_rng([self.seed, step])
        picks = rng.integers(0, len(self.data.seqs), self.seqs)
        blk = build_batch(
            self.data,
            picks,
            self.n_blocks,
            a.block_size,
            a.mask_token_id,
            rng,
            a.sliding_window,
            soft_k=self.soft_k,
        )
        idx = self.index[blk["labels"]]
        blk["labels"] = np.maximum(idx, 0).astype(np.int32)
        blk["weights"] = (blk["valid"] * (idx >= 0) * self.pos_w).astype(np.float32)
        if "soft_ids" in blk:  # teacher top-k over the shortlist, renormalised
            sidx = self.index[blk.pop("soft_ids")]
            p = np.where(sidx >= 0, np.exp(blk.pop("soft_logp")), 0.0)
            blk["soft_idx"] = np.maximum(sidx, 0).astype(np.int32)
            blk["soft_p"] = (p / np.maximum(p.sum(-1, keepdims=True), 1e-9)).astype(np.float32)
        else:
            shape = blk["labels"].shape + (1,)
            blk["soft_idx"] = np.zeros(shape, np.int32)
            blk["soft_p"] = np.zeros(shape, np.float32)
        return blk


@dataclass
class TrainConfig:
    """A run's hyper-parameters.

    Attributes:
        minutes: wall-clock budget, resumes included. steps: optional step budget.
        seqs: answers per batch. n_blocks: anchors per answer. lr, warmup: peak learning
        rate and warm-up steps (then a cosine to a tenth). gamma: position-weight decay.
        sel_weight: factor of the selector loss. vocab_cap: most tokens the training head
        scores (see :func:`shortlist`). eval_every_s, ckpt_every_s: seconds between held-out
        evaluations / checkpoints. eval_seqs: held-out answers per evaluation. seed: data seed.
        soft_k, kd_weight: the target's top-k log-probabilities each row is distilled
        against (when the shards have them) and the factor of that loss (0: hard labels).
    """

    minutes: float = 120.0
    steps: int | None = None
    seqs: int = 8
    n_blocks: int = 32
    lr: float = 2e-3
    warmup: int = 100
    gamma: float = 4.0
    sel_weight: float = 1.0
    vocab_cap: int = 16384
    eval_every_s: float = 600.0
    ckpt_every_s: float = 300.0
    eval_seqs: int = 96
    seed: int = 0
    soft_k: int = 32
    kd_weight: float = 1.0


class Trainer:
    """One training run: data, drafter, optimizer, evaluation and checkpoints.

    Args: as for :func:`train`.
    """

    def __init__(
        self, target, data_dir, out, cfg: TrainConfig, shape, resume, log, init=None, vocab=None
    ):
        self.out, self.cfg, self.log = Path(out), cfg, log
        target.freeze()
        self.adapter, self.config, self.drafter, self.opt, self.st = setup(
            target,
            data_dir,
            self.out,
            dict(DEMO_SHAPE, **(shape or {})),
            cfg.lr,
            resume,
            cfg.seed,
        )
        train_roots, held_root = data_roots(data_dir)
        data = ShardSet(train_roots)
        self.scale = standardize(data, self.drafter, self.opt, self.out / "train_state", resume)
        data.scale = self.scale
        if init is not None and not resume:  # warm start: a released drafter's weights
            warm_start(self.drafter, init, self.scale)
        self.held = ShardSet(held_root, scale=self.scale)
        vocab_ids = shortlist(data, self.drafter.args.vocab_size, cfg.vocab_cap)
        vocab_ids = vocab_ids if vocab is None else np.asarray(vocab, np.int32)
        self.vocab_ids = vocab_ids
        H = self.drafter.args.hidden_size
        head_w = self.adapter.lm_head(mx.eye(H)).T[mx.array(vocab_ids)]  # [V', H]
        mx.eval(head_w)
        self.batches = Batches(
            data, self.drafter, cfg.seqs, cfg.n_blocks, cfg.gamma, vocab_ids, cfg.seed, cfg.soft_k
        )
        self.picks, self.anchors = eval_anchors(self.held, cfg.eval_seqs, 4)
        self.step_fn, self.state = make_step(
            self.drafter,
            self.opt,
            lambda h: h @ head_w.T,
            mx.array(vocab_ids),
            cfg.n_blocks,
            cfg.sel_weight,
            cfg.kd_weight if self.batches.soft_k else 0.0,
        )
        self.t0 = time.time() - self.st["elapsed_s"]
        log(
            f"data: {len(data.seqs)} answers, {data.tokens} answer tokens, shortlist "
            f"{len(vocab_ids)} tokens; held-out {len(self.held.seqs)} answers"
        )

    def step(self, frac: float) -> list:
        """One optimizer step; returns [loss, block CE, selector CE]."""
        self.opt.learning_rate = lr_at(self.st["step"], frac, self.cfg.lr, self.cfg.warmup)
        blk = self.batches(self.st["step"])
        res = self.step_fn(
            *to_device(blk, self.adapter, self.drafter),
            mx.array(blk["weights"]),
            mx.array(blk["soft_idx"]),
            mx.array(blk["soft_p"]),
        )
        mx.eval(res, self.state)
        self.st["step"] += 1
        return [r.item() for r in res]

    def progress(self) -> float:
        """How far the run is, in [0, 1]: wall time or steps, whichever is further."""
        c = self.cfg
        frac = (time.time() - self.t0) / (c.minutes * 60)
        return max(frac, self.st["step"] / c.steps if c.steps else 0.0)

    def evaluate(self) -> dict:
        """Held-out teacher-forced tau, logged and kept in the run's history; the best
        drafter so far (selector tau) is also written to ``out/best``."""
        ev = evaluate(
            self.drafter, self.adapter, self.held, self.picks, self.anchors, self.vocab_ids
        )
        self.st["history"].append({"step": self.st["step"], **ev})
        self.log(f"eval step {self.st['step']}: " + json.dumps(ev))
        if ev["tau_selector"] > self.st.get("best", {}).get("tau_selector", -1.0):
            self.st["best"] = {"step": self.st["step"], **ev}
            self.publish(self.out / "best", state=False)
        return ev

    def publish(self, dest: Path | None = None, state: bool = True) -> None:
        """Save the resumable state and the drafter in the released format (with the
        feature scale folded into ``fc``, so it reads raw target features)."""
        self.st["elapsed_s"] = time.time() - self.t0
        if state:
            save_checkpoint(self.out / "train_state", self.drafter, self.opt, self.st)
            np.save(self.out / "train_state" / "feature_scale.npy", self.scale)
        w = self.drafter.fc.weight
        self.drafter.fc.weight = w / mx.array(self.scale)[None, :]  # [H, D] / [1, D]
        try:
            save_drafter(dest or self.out, self.drafter, self.config, draft_vocab=self.vocab_ids)
        finally:
            self.drafter.fc.weight = w


def train(
    target,
    data_dir: Path,
    out: Path,
    cfg: TrainConfig | None = None,
    shape: dict | None = None,
    resume: bool = False,
    log=print,
    init=None,
    vocab=None,
) -> dict:
    """Train (or resume) a drafter for ``target`` on the shards under ``data_dir``.

    Args:
        target: the mlx-lm target (frozen). data_dir: distill folder (train/, heldout/) or
            a (train split folders, held-out split folder) pair.
        out: output folder: the drafter plus ``train_state/``. cfg: hyper-parameters.
        shape: drafter_config overrides; must hold ``mask_token_id``.
        resume: continue from out. log: line printer.
        init: a released drafter to start from (a fresh run only). vocab: the draft
            vocabulary to train and ship (default: the data's shortlist).

    Returns:
        {"step", "final" (the last evaluation), "best" (the best one, its drafter in
        ``out/best``), "first" (the one at step 0, before any update, when this run
        started there), "wall_s", "params", "vocab"}.
    """
    run = Trainer(target, data_dir, out, cfg or TrainConfig(), shape, resume, log, init, vocab)
    st, losses, t_start, s_start = run.st, [], time.time(), run.st["step"]
    if st["step"] == 0:
        run.evaluate()  # the starting point (a warm start's baseline)
    ckpt_due, eval_due = Every(run.cfg.ckpt_every_s), Every(run.cfg.eval_every_s)
    while (frac := run.progress()) < 1.0:
        losses.append(run.step(frac))
        if st["step"] % 20 == 0:
            m, rate = (
                np.mean(losses[-20:], axis=0),
                (st["step"] - s_start) / (time.time() - t_start),
            )
            log(
                f"step {st['step']} loss {m[0]:.3f} ce {m[1]:.3f} sel {m[2]:.3f} kd {m[3]:.3f} "
                f"{rate * 60:.1f} steps/min, {(time.time() - run.t0) / 60:.1f} min"
            )
        if eval_due():
            run.evaluate()
        if ckpt_due():
            run.publish()
    final = run.evaluate()
    run.publish()
    params = sum(v.size for _, v in tree_flatten(run.drafter.parameters()))
    first = next((h for h in st["history"] if h["step"] == 0), None)
    summary = {"step": st["step"], "final": final, "first": first, "wall_s": st["elapsed_s"]}
    summary["best"] = st["best"]
    summary.update(
        params=params, vocab=len(run.vocab_ids), blocks_per_s=blocks_per_s(run, s_start, t_start)
    )
    (run.out / "train_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def blocks_per_s(run: Trainer, s_start: int, t_start: float) -> float:
    """Training throughput of this invocation: blocks (anchors) per second."""
    steps = run.st["step"] - s_start
    return round(steps * run.cfg.seqs * run.cfg.n_blocks / max(time.time() - t_start, 1e-9), 2)


def main(argv=None) -> None:
    """Command-line entry point (see the module docstring)."""
    from dflash_mlx.loading.loader import load_target
    from dflash_mlx.train.common import add_target_option, default_target

    d = TrainConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_target_option(p)
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--minutes", type=float, default=d.minutes)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seqs", type=int, default=d.seqs)
    p.add_argument("--blocks", type=int, default=d.n_blocks, help="anchors per answer")
    p.add_argument("--layers", type=int, default=DEMO_SHAPE["num_hidden_layers"])
    p.add_argument("--rank", type=int, default=DEMO_SHAPE["selector_rank"])
    p.add_argument("--vocab-cap", type=int, default=d.vocab_cap)
    p.add_argument("--eval-every", type=float, default=d.eval_every_s, help="seconds")
    p.add_argument("--mask-token", default="<empty_output>", help="token used as the mask")
    a = p.parse_args(argv)
    target, tok = load_target(a.target or default_target())
    shape = {
        "num_hidden_layers": a.layers,
        "selector_rank": a.rank,
        "mask_token_id": tok.convert_tokens_to_ids(a.mask_token),
        "rope_theta": target.args.rope_theta,
    }
    cfg = TrainConfig(a.minutes, a.steps, a.seqs, a.blocks, a.lr)
    cfg.vocab_cap, cfg.eval_every_s = a.vocab_cap, a.eval_every
    train(target, a.data, a.out, cfg, shape, a.resume)


if __name__ == "__main__":
    main()
