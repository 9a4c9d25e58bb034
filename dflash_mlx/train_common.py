"""Helpers shared by the demo-pair trainers: data windows, schedules, progress, evaluation,
and the drafter's batched-block construction (target features, anchors, masks)."""

from __future__ import annotations

import math
import time

import mlx.core as mx
import numpy as np

from dflash_mlx.drafter import block_mask
from dflash_mlx.target import TargetAdapter
from dflash_mlx.selector import select_path_ops as select_path, top_candidates


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


# -- drafter training helpers --------------------------------------------------------


def target_pass(model, x: mx.array, layer_ids):
    """Run a frozen mlx-lm target on x [S, T] without a cache, capturing layer outputs
    through the same ``TargetAdapter`` the decoder uses.

    Args:
        model: the mlx-lm model. x: token ids [S, T].
        layer_ids: decoder layers whose outputs form the context features.

    Returns:
        (features [S, T, len(layer_ids) * H], greedy next tokens [S, T] where entry p is
        the target's argmax after reading x[:, : p + 1]).
    """
    adapter = _adapters.get(id(model))
    if adapter is None or adapter.layer_ids != list(layer_ids):
        adapter = _adapters[id(model)] = TargetAdapter(model, layer_ids)
    logits, feats = adapter(x, None)
    return mx.stop_gradient(feats), mx.argmax(logits, axis=-1).astype(mx.int32)


_adapters: dict = {}


def make_blocks(
    x: np.ndarray,
    teacher: np.ndarray,
    n_blocks: int,
    B: int,
    mask_id: int,
    rng: np.random.Generator,
    window: int | None = None,
):
    """Pick anchors and build block inputs, labels, RoPE offsets and the attention mask.

    Args:
        x: token windows [S, T]. teacher: [S, T], entry p = label for position p + 1.
        n_blocks: blocks per window (distinct anchors in [1, T - B]).
        B: block size. mask_id: mask token id. rng: numpy generator.
        window: sliding window of the drafter (context rows visible: the last window - 1).

    Returns:
        dict of numpy arrays: ids [N, B], labels [N, B-1], offsets [N], mask [N, 1, B, T+B].
    """
    S, T = x.shape
    anchors = np.stack(
        [np.sort(rng.choice(np.arange(1, T - B + 1), n_blocks, replace=False)) for _ in range(S)]
    )  # [S, nb]
    a = anchors.reshape(-1)
    rows = np.repeat(np.arange(S), n_blocks)
    ids = np.full((len(a), B), mask_id, dtype=np.int32)
    ids[:, 0] = x[rows, a]
    pos = a[:, None] + np.arange(B - 1)[None, :]  # label of row k sits at teacher[a + k - 1]
    labels = teacher[rows[:, None], pos].astype(np.int32)
    mask = block_mask(a, T, B, window)
    return {"ids": ids, "labels": labels, "offsets": a.astype(np.int32), "mask": mask}


def evaluate_drafter(
    drafter, target, windows: np.ndarray, layer_ids, n_blocks: int, mask_id: int, seed: int = 1234
) -> dict:
    """Teacher-forced acceptance figures on held-out windows.

    Per block (anchor drawn at random), row k counts as accepted while every row <= k equals
    the target's greedy token given the true prefix. Reports per-position top-1 accuracy and
    Recall@K, and tau = 1 + mean accepted rows for argmax drafting (DFlash 1), the greedy
    selector walk (DFlash 2) and the top-K oracle.

    Args:
        drafter: the drafter. target: the mlx-lm target. windows: [n, T] token windows.
        layer_ids: target layers of the features. n_blocks: anchors per window.
        mask_id: mask token id. seed: anchor seed (fixed for comparable evaluations).
    """
    rng = np.random.default_rng(seed)
    B, K = drafter.args.block_size, drafter.args.selector_top_k
    W = target.model.embed_tokens.weight
    acc = {"argmax": [], "selector": [], "oracle": []}
    for i in range(0, len(windows), 8):
        x = mx.array(windows[i : i + 8])
        feats, teacher = target_pass(target, x, layer_ids)
        blk = make_blocks(
            np.array(x), np.array(teacher), n_blocks, B, mask_id, rng, drafter.args.sliding_window
        )
        ids = mx.array(blk["ids"])
        kv = drafter.context_kv(drafter.project_context(feats), 0)
        kv = [(mx.repeat(k, n_blocks, 0), mx.repeat(v, n_blocks, 0)) for k, v in kv]
        h = drafter(
            target.model.embed_tokens(ids), kv, mx.array(blk["offsets"]), B, mx.array(blk["mask"])
        )[:, 1:]
        logits = drafter.logits(h, lambda t: t @ W.T).astype(mx.float32)
        labels = mx.array(blk["labels"])
        U, cand = top_candidates(logits, K)
        acc["argmax"].append(mx.argmax(logits, -1) == labels)
        acc["oracle"].append((cand == labels[..., None].astype(cand.dtype)).any(-1))
        if drafter.has_selector:
            sel = drafter.candidate_selector
            path, _ = select_path(
                U,
                cand,
                ids[:, 0],
                sel.hidden_projection(h),
                sel.predecessor_codebook,
                sel.successor_codebook,
            )
            chosen = mx.take_along_axis(cand, path[..., None].astype(mx.uint32), -1)[..., 0]
            acc["selector"].append(chosen.astype(mx.int32) == labels)
    out = {}
    for name, parts in acc.items():
        if not parts:
            continue
        ok = np.array(mx.concatenate(parts, axis=0))  # [N, B-1]
        run = np.cumprod(ok, axis=1)
        out[f"tau_{name}"] = float(1 + run.sum(1).mean())
        out[f"pos_{name}"] = [round(float(v), 4) for v in ok.mean(0)]
    return out


def held_windows(stream: np.ndarray, seq: int, n: int) -> np.ndarray:
    """``n`` evenly spaced non-overlapping windows of ``seq`` tokens from a stream."""
    count = (len(stream) - 1) // seq
    pick = np.linspace(0, count - 1, min(n, count)).astype(int)
    return np.stack([stream[p * seq : (p + 1) * seq] for p in pick]).astype(np.int32)
