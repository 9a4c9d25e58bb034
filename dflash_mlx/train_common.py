"""Small helpers shared by the demo-pair trainers (target and drafter)."""

from __future__ import annotations

import math
import time

import mlx.core as mx
import numpy as np


def sample_batch(data: np.ndarray, batch: int, seq: int, seed: int, step: int):
    """Draw ``batch`` random windows of ``seq + 1`` tokens, reproducibly per step.

    The generator is seeded by ``(seed, step)``, so a resumed run sees the same data order.

    Args:
        data: 1-D token array.
        batch: number of windows.
        seq: input length (targets are shifted by one).
        seed: run seed.
        step: optimizer step.

    Returns:
        ``(x, y)`` int32 arrays of shape ``[batch, seq]``.
    """
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(data) - seq - 1, size=batch)
    idx = starts[:, None] + np.arange(seq + 1)[None, :]
    win = data[idx].astype(np.int32)
    return win[:, :-1], win[:, 1:]


def lr_at(step: int, frac: float, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warm-up over ``warmup`` steps, then a cosine from ``peak`` to ``floor * peak``.

    Args:
        step: optimizer step.
        frac: run progress in [0, 1] (steps or wall time, whichever is further).
        peak: peak learning rate.
        warmup: warm-up steps.
        floor: final learning rate as a fraction of ``peak``.
    """
    warm = min(1.0, (step + 1) / max(warmup, 1))
    cos = floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(max(frac, 0.0), 1.0)))
    return peak * warm * cos


class CheckpointTimer:
    """Tells when a checkpoint and an evaluation are due, by wall-clock intervals.

    Args:
        ckpt_every_s: seconds between checkpoints.
        eval_every_s: seconds between evaluations.
    """

    def __init__(self, ckpt_every_s: float, eval_every_s: float):
        self.every = (ckpt_every_s, eval_every_s)
        self.last = [time.time(), time.time()]

    def due(self):
        """Return ``(checkpoint_due, eval_due)`` and restart the clocks that fired."""
        now, out = time.time(), []
        for i in range(2):
            fire = now - self.last[i] >= self.every[i]
            if fire:
                self.last[i] = now
            out.append(fire)
        return tuple(out)


def make_progress(quiet: bool = False):
    """A rich progress bar with loss and tokens/s fields (disabled when ``quiet``)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}"),
        TextColumn("{task.fields[tps]:.0f} tok/s"),
        TimeElapsedColumn(),
        disable=quiet,
    )


def _windows(stream: np.ndarray, seq: int, limit: int | None) -> np.ndarray:
    n = (len(stream) - 1) // seq
    if n <= 0:
        return np.zeros((0, seq + 1), dtype=np.int32)
    pick = np.arange(n) if limit is None or limit >= n else np.linspace(0, n - 1, limit).astype(int)
    idx = pick[:, None] * seq + np.arange(seq + 1)[None, :]
    return stream[idx].astype(np.int32)


def stream_metrics(model, stream: np.ndarray, seq: int, limit: int | None, batch: int = 16):
    """Summed loss, correct top-1 count and token count of ``model`` over a token stream.

    Args:
        model: a causal LM returning logits ``[B, L, V]``.
        stream: 1-D token array, cut into non-overlapping windows.
        seq: window length.
        limit: evaluate this many evenly spaced windows (all when None).
        batch: windows per forward.
    """
    wins = _windows(stream, seq, limit)
    loss_sum, correct, count = 0.0, 0, 0
    for i in range(0, len(wins), batch):
        w = mx.array(wins[i : i + batch])
        logits = model(w[:, :-1]).astype(mx.float32)
        y = w[:, 1:]
        ce = mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, y[..., None], -1)[..., 0]
        hit = (mx.argmax(logits, axis=-1) == y).sum()
        mx.eval(ce, hit)
        loss_sum += ce.sum().item()
        correct += int(hit.item())
        count += y.size
    return loss_sum, correct, count


def evaluate_lm(model, held, seq: int, limit: int | None) -> dict:
    """Held-out loss (nats/token) and top-1 accuracy, without and with ``encodings/*``.

    The "all" figures weight the two streams by their full token counts, so a subsampled
    evaluation still estimates the whole held-out set.

    Args:
        model: a causal LM.
        held: a :class:`dflash_mlx.corpus.Split` (``main`` and ``encodings`` streams).
        seq: window length.
        limit: windows per stream (None: every window).
    """
    res = {}
    sizes = {"main": len(held.main), "encodings": len(held.encodings)}
    n_enc = None if limit is None else max(1, limit * sizes["encodings"] // max(sizes["main"], 1))
    for part, stream, lim in (("main", held.main, limit), ("encodings", held.encodings, n_enc)):
        ls, c, n = stream_metrics(model, stream, seq, lim)
        if n:
            res[f"loss_{part}"] = ls / n
            res[f"acc_{part}"] = c / n
    w = {p: sizes[p] for p in sizes if f"loss_{p}" in res}
    tot = sum(w.values())
    if tot:
        res["loss_all"] = sum(res[f"loss_{p}"] * w[p] for p in w) / tot
        res["acc_all"] = sum(res[f"acc_{p}"] * w[p] for p in w) / tot
    return res
