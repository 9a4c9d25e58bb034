"""Train the demo *target*: a small mlx-lm ``qwen3`` model on the stdlib corpus, from scratch.

Usage::

    python -m dflash_mlx.train_target --out .work/demo_target --minutes 40 [--resume]

The output folder is an mlx-lm model (``config.json`` with ``model_type`` qwen3,
``model.safetensors``, tokenizer files) that ``mlx_lm.load`` reads; it is rewritten at every
checkpoint, next to ``checkpoint/`` (weights, AdamW state and step) used by ``--resume``.
On Linux, train with the OpenBLAS preload of SPEC section 7 (float32 matmuls ~15x faster).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten

from dflash_mlx import corpus
from dflash_mlx.train_common import (
    CheckpointTimer,
    evaluate_lm,
    lr_at,
    make_progress,
    sample_batch,
)

TARGET_CONFIG = {
    "model_type": "qwen3",
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "intermediate_size": 768,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rms_norm_eps": 1e-6,
    "vocab_size": 4096,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}
SMOKE_CONFIG = dict(
    TARGET_CONFIG,
    hidden_size=32,
    num_hidden_layers=2,
    intermediate_size=64,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
)


def build_model(config: dict) -> nn.Module:
    """Instantiate an mlx-lm qwen3 model (float32, random init) from a config dict.

    Args:
        config: qwen3 config fields (see ``TARGET_CONFIG``).
    """
    from mlx_lm.models import qwen3

    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model


def loss_fn(model: nn.Module, x: mx.array, y: mx.array) -> mx.array:
    """Mean next-token cross-entropy of ``model`` on inputs ``x`` and targets ``y``."""
    return nn.losses.cross_entropy(model(x).astype(mx.float32), y, reduction="mean")


def save_model_dir(model: nn.Module, config: dict, tokenizer_dir: Path, out: Path) -> None:
    """Write an mlx-lm loadable folder: config.json, model.safetensors, tokenizer files.

    Args:
        model: the trained model.
        config: its config dict (written as config.json, with ``architectures``).
        tokenizer_dir: folder holding tokenizer.json / tokenizer_config.json.
        out: destination folder.
    """
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    tmp = out / "model.tmp.safetensors"
    mx.save_safetensors(str(tmp), weights, metadata={"format": "mlx"})
    tmp.replace(out / "model.safetensors")
    cfg = dict(config, architectures=["Qwen3ForCausalLM"], torch_dtype="float32")
    cfg["eos_token_id"] = corpus.SPECIAL_TOKENS.index(corpus.EOS_TOKEN)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in Path(tokenizer_dir).iterdir():
        shutil.copy(f, out / f.name)


def save_checkpoint(ckpt: Path, model, optimizer, state: dict) -> None:
    """Save weights, optimizer state and a JSON of counters into ``ckpt`` (atomically per file).

    Args:
        ckpt: checkpoint folder.
        model: the model being trained.
        optimizer: its optimizer.
        state: JSON-able counters (step, tokens, elapsed seconds, ...).
    """
    ckpt.mkdir(parents=True, exist_ok=True)
    for name, tree in (("weights", model.parameters()), ("optimizer", optimizer.state)):
        tmp = ckpt / f"{name}.tmp.safetensors"
        mx.save_safetensors(str(tmp), dict(tree_flatten(tree)))
        tmp.replace(ckpt / f"{name}.safetensors")
    (ckpt / "state.tmp.json").write_text(json.dumps(state, indent=1))
    (ckpt / "state.tmp.json").replace(ckpt / "state.json")


def load_checkpoint(ckpt: Path, model, optimizer) -> dict:
    """Restore what :func:`save_checkpoint` wrote; returns the counters dict."""
    model.load_weights(str(ckpt / "weights.safetensors"))
    opt = mx.load(str(ckpt / "optimizer.safetensors"))
    optimizer.state = tree_unflatten(list(opt.items()))
    mx.eval(model.parameters(), optimizer.state)
    return json.loads((ckpt / "state.json").read_text())


def train(
    out: Path,
    minutes: float = 40.0,
    steps: int | None = None,
    resume: bool = False,
    config: dict | None = None,
    batch: int = 16,
    seq: int = 256,
    lr: float = 2e-3,
    warmup: int = 100,
    weight_decay: float = 0.1,
    eval_every_s: float = 300.0,
    ckpt_every_s: float = 180.0,
    eval_windows: int = 64,
    corpus_limit: int | None = None,
    corpus_dir: Path | None = None,
    train_tokens: np.ndarray | None = None,
    seed: int = 0,
    log_every: int = 20,
    quiet: bool = False,
) -> dict:
    """Train (or resume) the target and write the model folder.

    The learning rate warms up for ``warmup`` steps, then follows a cosine to 10% over the
    run's progress, which is the larger of step / ``steps`` and wall time / ``minutes``
    (time spent in earlier runs counts when resuming).

    Args:
        out: output folder (model files + ``checkpoint/``).
        minutes: wall-clock budget for the whole run, resumes included.
        steps: optional step budget (whichever budget ends first stops training).
        resume: continue from ``out/checkpoint`` if present.
        config: qwen3 config; ``TARGET_CONFIG`` by default (vocab must match the corpus).
        batch: sequences per step.
        seq: tokens per sequence.
        lr: peak learning rate.
        warmup: linear warm-up steps.
        weight_decay: AdamW decoupled weight decay.
        eval_every_s: seconds between held-out evaluations.
        ckpt_every_s: seconds between checkpoints.
        eval_windows: held-out windows (of ``seq`` tokens) per periodic evaluation.
        corpus_limit: build the corpus from the first N stdlib files only (smoke runs).
        corpus_dir: explicit corpus cache folder.
        train_tokens: train on this token array instead of the corpus (tests).
        seed: data-order seed.
        log_every: steps between plain log lines.
        quiet: no progress bar or log lines.

    Returns:
        Summary dict: step, tokens, losses, final evaluation, tokens/s, wall time.
    """
    out = Path(out)
    config = dict(config or TARGET_CONFIG)
    cache = corpus.build_corpus(corpus_dir, config["vocab_size"], corpus_limit)
    held = corpus.load_split(cache, "heldout")
    data = train_tokens if train_tokens is not None else corpus.load_split(cache, "train").all()
    model = build_model(config)
    optimizer = optim.AdamW(learning_rate=lr, betas=[0.9, 0.95], weight_decay=weight_decay)
    optimizer.init(model.trainable_parameters())
    ckpt = out / "checkpoint"
    st = {"step": 0, "tokens": 0, "elapsed_s": 0.0, "history": []}
    if resume and (ckpt / "state.json").exists():
        st = load_checkpoint(ckpt, model, optimizer)
    budget_s = minutes * 60.0
    state = [model.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step_fn(x, y):
        loss, grads = nn.value_and_grad(model, loss_fn)(model, x, y)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(model, grads)
        return loss

    def log(msg):
        if not quiet:
            progress.console.log(msg)

    def do_eval(full=False):
        ev = evaluate_lm(model, held, seq, None if full else eval_windows)
        st["history"].append({"step": st["step"], **ev})
        log(
            f"eval step {st['step']}: "
            + " ".join(f"{k}={v:.4f}" for k, v in ev.items() if isinstance(v, float))
        )
        return ev

    t0 = time.time() - st["elapsed_s"]
    start_step, start_t = st["step"], time.time()
    timer = CheckpointTimer(ckpt_every_s, eval_every_s)
    losses = []
    progress = make_progress(quiet)
    with progress:
        task = progress.add_task("target", total=steps or None, loss=float("nan"), tps=0.0)
        while True:
            elapsed = time.time() - t0
            frac = max(
                elapsed / budget_s if budget_s else 0.0, st["step"] / steps if steps else 0.0
            )
            if frac >= 1.0:
                break
            optimizer.learning_rate = lr_at(st["step"], frac, lr, warmup)
            x, y = sample_batch(data, batch, seq, seed, st["step"])
            loss = step_fn(mx.array(x), mx.array(y))
            mx.eval(loss, state)
            losses.append(loss.item())
            st["step"] += 1
            st["tokens"] += batch * seq
            tps = (st["step"] - start_step) * batch * seq / max(time.time() - start_t, 1e-9)
            progress.update(task, advance=1, loss=losses[-1], tps=tps)
            if st["step"] % log_every == 0:
                recent = float(np.mean(losses[-log_every:]))
                log(
                    f"step {st['step']} loss {recent:.4f} lr {lr_at(st['step'], frac, lr, warmup):.2e} "
                    f"tok/s {tps:.0f} elapsed {elapsed / 60:.1f} min"
                )
            due_ckpt, due_eval = timer.due()
            if due_eval:
                do_eval()
            if due_ckpt:
                st["elapsed_s"] = time.time() - t0
                save_checkpoint(ckpt, model, optimizer, st)
                save_model_dir(model, config, cache / "tokenizer", out)
    final = do_eval(full=True)
    st["elapsed_s"] = time.time() - t0
    save_checkpoint(ckpt, model, optimizer, st)
    save_model_dir(model, config, cache / "tokenizer", out)
    run_tokens = (st["step"] - start_step) * batch * seq
    summary = {
        "step": st["step"],
        "tokens": st["tokens"],
        "losses": losses,
        "final": final,
        "tokens_per_s": run_tokens / max(time.time() - start_t, 1e-9),
        "wall_s": st["elapsed_s"],
        "params": sum(v.size for _, v in tree_flatten(model.parameters())),
    }
    (out / "train_summary.json").write_text(
        json.dumps({k: v for k, v in summary.items() if k != "losses"}, indent=1) + "\n"
    )
    log(f"done: {json.dumps({k: v for k, v in summary.items() if k != 'losses'})}")
    return summary


def main(argv=None) -> None:
    """Command-line entry point (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--minutes", type=float, default=40.0)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--eval-every", type=float, default=300.0, help="seconds")
    p.add_argument("--ckpt-every", type=float, default=180.0, help="seconds")
    p.add_argument("--smoke", action="store_true", help="tiny model and corpus subset")
    a = p.parse_args(argv)
    cfg = SMOKE_CONFIG if a.smoke else TARGET_CONFIG
    train(
        a.out,
        a.minutes,
        a.steps,
        a.resume,
        cfg,
        a.batch,
        a.seq,
        a.lr,
        eval_every_s=a.eval_every,
        ckpt_every_s=a.ckpt_every,
        corpus_limit=40 if a.smoke else None,
    )


if __name__ == "__main__":
    main()
