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
released format); ``train_state/`` keeps float32 weights and AdamW state for ``--resume``,
saved every ``ckpt_every_s`` and on Ctrl-C / SIGTERM (exit 130 / 143, one line saying where).
Options, folders and the mask token are checked before any work (``checks``).
"""

from __future__ import annotations

import contextlib
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
from dflash_mlx.train.checks import (
    YEAR_MINUTES,
    Parser,
    Stop,
    check_features,
    check_resume,
    entry,
    mask_token_id,
    need_shards,
    number,
    out_dir,
    shielded,
    stop_code,
    whole,
)
from dflash_mlx.train.common import (
    Every,
    add_target_option,
    init_drafter,
    load_checkpoint,
    lr_at,
    save_checkpoint,
    warm_start,
)
from dflash_mlx.train.data import (
    Batches,
    ShardSet,
    data_roots,
    eval_anchors,
    feature_scale,
    shortlist,
)
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


def setup(target, data_dir, out: Path, shape: dict, lr: float, resume: bool, seed: int):
    """Adapter, drafter config, drafter, optimizer and counters (restored with ``resume``)."""
    layer_ids = check_features(*data_roots(data_dir), target)
    adapter = TargetAdapter(target, layer_ids)
    args = target.args
    config = drafter_config(
        hidden_size=args.hidden_size,
        vocab_size=args.vocab_size,
        num_target_layers=args.num_hidden_layers,
        target_layer_ids=layer_ids,
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
        with shielded():  # a Ctrl-C meanwhile waits until the files are whole
            if state:
                save_checkpoint(self.out / "train_state", self.drafter, self.opt, self.st)
                np.save(self.out / "train_state" / "feature_scale.npy", self.scale)
            w = self.drafter.fc.weight
            self.drafter.fc.weight = w / mx.array(self.scale)[None, :]  # [H, D] / [1, D]
            try:
                save_drafter(dest or self.out, self.drafter, self.config, self.vocab_ids)
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

    Raises:
        Stop: on Ctrl-C / SIGTERM, once every step taken is saved in ``out/train_state``.
    """
    run = Trainer(target, data_dir, out, cfg or TrainConfig(), shape, resume, log, init, vocab)
    st, t_start, s_start = run.st, time.time(), run.st["step"]
    try:
        final = _loop(run)
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: keep every step taken
        with contextlib.suppress(KeyboardInterrupt):  # a second one waits for the save
            run.publish()
        raise Stop(stop_code(e), f"saved step {st['step']} in {run.out / 'train_state'}") from None
    params = sum(v.size for _, v in tree_flatten(run.drafter.parameters()))
    first = next((h for h in st["history"] if h["step"] == 0), None)
    summary = {"step": st["step"], "final": final, "first": first, "wall_s": st["elapsed_s"]}
    summary["best"] = st["best"]
    summary.update(
        params=params, vocab=len(run.vocab_ids), blocks_per_s=blocks_per_s(run, s_start, t_start)
    )
    (run.out / "train_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _loop(run: Trainer) -> dict:
    """Step until the budget is spent, logging, evaluating and checkpointing; then the final
    evaluation and save. Returns the final evaluation."""
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
            run.log(
                f"step {st['step']} loss {m[0]:.3f} ce {m[1]:.3f} sel {m[2]:.3f} kd {m[3]:.3f} "
                f"{rate * 60:.1f} steps/min, {(time.time() - run.t0) / 60:.1f} min"
            )
        if eval_due():
            run.evaluate()
        if ckpt_due():
            run.publish()
    final = run.evaluate()
    run.publish()
    return final


def blocks_per_s(run: Trainer, s_start: int, t_start: float) -> float:
    """Training throughput of this invocation: blocks (anchors) per second."""
    steps = run.st["step"] - s_start
    return round(steps * run.cfg.seqs * run.cfg.n_blocks / max(time.time() - t_start, 1e-9), 2)


@entry(hint="rerun with --resume to continue", smaller="--seqs or --blocks")
def main(argv=None) -> None:
    """Command-line entry point (see the module docstring).

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).
    """
    from dflash_mlx.loading.loader import load_target
    from dflash_mlx.train.common import default_target

    a = _parser().parse_args(argv)
    distill = f"python -m dflash_mlx.train.distill --out {a.data}"
    need_shards(a.data / "train", f"distil answers first: {distill} --split train")
    need_shards(a.data / "heldout", f"distil held-out answers first: {distill} --split heldout")
    check_resume(a.out, a.resume)
    out_dir(a.out, "--out")
    target, tok = load_target(a.target or default_target())
    shape = {
        "num_hidden_layers": a.layers,
        "selector_rank": a.rank,
        "mask_token_id": mask_token_id(tok, a.mask_token, target.args.vocab_size),
        "rope_theta": target.args.rope_theta,
    }
    cfg = TrainConfig(a.minutes, a.steps, a.seqs, a.blocks, a.lr)
    cfg.vocab_cap, cfg.eval_every_s = a.vocab_cap, a.eval_every
    train(target, a.data, a.out, cfg, shape, a.resume)


def _parser() -> Parser:
    """The command line's options, each checked as it is parsed."""
    d, top_k = TrainConfig(), DEMO_SHAPE["selector_top_k"]
    p = Parser(prog="python -m dflash_mlx.train.drafter", description=__doc__.split("\n")[0])
    add_target_option(p)
    p.add_argument("--data", type=Path, required=True, help="a distill --out folder")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--minutes", type=number(0, YEAR_MINUTES), default=d.minutes, help="budget")
    p.add_argument("--steps", type=whole(1), default=d.steps, help="step budget")
    p.add_argument("--resume", action="store_true", help="continue the run saved in --out")
    p.add_argument("--lr", type=number(0), default=d.lr)
    p.add_argument("--seqs", type=whole(1), default=d.seqs, help="answers per batch")
    p.add_argument("--blocks", type=whole(1), default=d.n_blocks, help="anchors per answer")
    p.add_argument("--layers", type=whole(1), default=DEMO_SHAPE["num_hidden_layers"])
    p.add_argument("--rank", type=whole(1), default=DEMO_SHAPE["selector_rank"])
    p.add_argument("--vocab-cap", type=whole(top_k), default=d.vocab_cap, help="head tokens")
    p.add_argument(
        "--eval-every", type=number(0, open_low=False), default=d.eval_every_s, help="seconds"
    )
    p.add_argument("--mask-token", default="<empty_output>", help="token used as the mask")
    return p


if __name__ == "__main__":
    main()
