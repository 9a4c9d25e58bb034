"""The path selector's CPU twin (docs/algorithm.md §3.4): top-K, lattice and walk in numpy
on the host, after one evaluation of the drafter's logits.

On MLX's CPU backend the selector's ~40 small ops cost more than their arithmetic: each op
pays ~10-14 us of dispatch, and ``argpartition`` over an 8,192-id row takes ~0.1 ms (12 ns
an element). Here the top-K is found among the rows' best groups of ids, the lattice is
one batched matmul and the walk a loop over L rows of K scores, all on views of MLX's
buffers. ``selector.select_path_ops`` stays the definition; this twin is tested against
it. The extra host sync costs nothing on the CPU, whose evaluation is synchronous anyway.
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np

from . import fastmath

ENV = "DFLASH_HOST_SELECT"  # "0": the MLX ops on the CPU too (A/B, debugging)


def enabled() -> bool:
    """Whether the host selector may run: on MLX's CPU backend, unless
    ``DFLASH_HOST_SELECT=0``."""
    return fastmath.on_cpu() and os.environ.get(ENV, "1").strip() != "0"


def view(a: mx.array) -> np.ndarray:
    """A numpy view of an evaluated MLX array's buffer (no copy)."""
    return np.asarray(memoryview(a))


def group_size(V: int, k: int) -> int:
    """Members per group of the top-k's first pass: the power of two nearest below
    sqrt(V / k) that divides V, so the groups (V / m) and their members (k * m) are about
    as many; 1 (no grouping) when none does."""
    m = 1
    while V % (2 * m) == 0 and (2 * m) ** 2 * k <= V:
        m *= 2
    return m


def top_candidates(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k scores per row, best first (tied scores in no set order, as ``argpartition``).

    The ids are split into V / m strided groups (group j: j, j + V / m, ...). The k best
    entries lie in the k groups with the highest maxima (each of those maxima is at least
    the k-th best value), so only k * m entries per row are ranked.

    Args:
        x: scores [..., V] float32. k: candidates per row.

    Returns:
        (U [..., k] float32, idx [..., k] int64 indices into V).
    """
    V = x.shape[-1]
    k = min(k, V)
    lead = x.shape[:-1]
    rows = x.reshape(-1, V)
    N, m = rows.shape[0], group_size(V, k)
    if m > 1:
        n = V // m
        best = rows.reshape(N, m, n).max(axis=1)  # [N, n] group maxima
        groups = np.argpartition(-best, k - 1, axis=-1)[:, :k]  # [N, k]
        ids = (groups[:, :, None] + n * np.arange(m)).reshape(N, k * m)
        vals = np.take_along_axis(rows, ids, axis=-1)  # [N, k * m]
    else:
        ids, vals = np.broadcast_to(np.arange(V), rows.shape), rows
    part = np.argpartition(-vals, k - 1, axis=-1)[:, :k]
    top = np.take_along_axis(ids, part, axis=-1)  # [N, k] ids, unordered
    U = np.take_along_axis(vals, part, axis=-1)
    order = np.lexsort((top, -U), axis=-1)  # by score, then by id
    U, top = np.take_along_axis(U, order, -1), np.take_along_axis(top, order, -1)
    return U.reshape(*lead, k), top.reshape(*lead, k)


def lattice_scores(U, cand, anchor, g, A, Bc) -> np.ndarray:
    """``selector.lattice_scores`` in numpy: S [B, L, K, K] (row, predecessor, successor).

    Args:
        U: [B, L, K] float32; cand: target ids [B, L, K]; anchor: [B]; g: [B, L, R];
        A, Bc: codebooks [V, R] float32.
    """
    Bsz, _, K = cand.shape
    first = np.broadcast_to(anchor.reshape(Bsz, 1, 1), (Bsz, 1, K))
    pred = np.concatenate([first, cand[:, :-1]], axis=1)  # [B, L, K]
    a_rows = A[pred] * g[:, :, None, :]  # [B, L, K, R]
    pair = a_rows @ Bc[cand].swapaxes(-1, -2)  # [B, L, K, K]
    return U[:, :, None, :] + pair


def walk(S: np.ndarray, temperature: float = 0.0, uniforms=None):
    """``selector.walk`` in numpy: greedy argmax (ties to the lowest index) or inverse-CDF
    sampling of softmax(S_t(prev, .) / T) with the given uniforms [B, L].

    Returns:
        (path [B, L] int32, q [B, L, K] float32 or None when greedy).
    """
    Bsz, L, K, _ = S.shape
    path = np.zeros((Bsz, L), np.int32)
    q = None if temperature == 0 else np.zeros((Bsz, L, K), np.float32)
    for b in range(Bsz):
        prev = 0
        for t in range(L):
            row = S[b, t, prev]
            if q is None:
                prev = int(np.argmax(row))
            else:
                e = np.exp((row - row.max()) / np.float32(temperature))
                q[b, t] = e / e.sum()
                cdf = np.cumsum(q[b, t])
                prev = min(int((cdf <= uniforms[b, t]).sum()), K - 1)
            path[b, t] = prev
    return path, q


def select(logits, g, anchor, A, Bc, top_k, temperature=0.0, uniforms=None, to_target=None):
    """The whole CPU selector: (tokens [B, L] uint32, cand [B, L, K] uint32 target ids,
    q [B, L, K] float32 or None, path [B, L] int32), as MLX arrays.

    Args:
        logits: [B, L, V'] drafter logits (V' may be a draft vocabulary); g: gates
        [B, L, R]; anchor: [B]; A, Bc: float32 codebooks [V, R]; top_k: K;
        temperature: T; uniforms: [B, L] when T > 0; to_target: the target ids [V'] of
        logits' last axis (a draft vocabulary), or None.
    """
    arrays = [logits.astype(mx.float32), g.astype(mx.float32), anchor, A, Bc]
    extra = [a for a in (to_target, uniforms) if a is not None]
    mx.eval(*arrays, *extra)
    x, gv, av, Av, Bv = (view(a) for a in arrays)
    U, idx = top_candidates(x, top_k)
    cand = idx if to_target is None else view(to_target)[idx]
    S = lattice_scores(U, cand, av.astype(np.int64), gv, Av, Bv)
    u = None if uniforms is None else view(uniforms)
    path, q = walk(S, temperature, u)
    tokens = np.take_along_axis(cand, path[..., None], axis=-1)[..., 0]
    as_mx = lambda a: mx.array(np.ascontiguousarray(a).astype(np.uint32))
    return as_mx(tokens), as_mx(cand), None if q is None else mx.array(q), mx.array(path)
