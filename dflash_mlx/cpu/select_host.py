"""The path selector's CPU twin (docs/algorithm.md §3.4): top-K, the lattice rows the walk
visits and the walk, in one C call (``cpu/path_select.c``) on the host, after one
evaluation of the drafter's logits.

On MLX's CPU backend the selector's ~40 small ops cost more than their arithmetic: each op
pays its dispatch, and ``argpartition`` over an 8,192-id row takes ~0.1 ms. The C twin
reads each row once with a sorted buffer of K. ``selector.select_path_ops`` stays the
definition; this twin is tested against it. The extra host sync costs nothing on the CPU,
whose evaluation is synchronous anyway.
"""

from __future__ import annotations

import ctypes

import mlx.core as mx
import numpy as np

from .. import env
from . import fastmath, small_gemm

ENV = "DFLASH_HOST_SELECT"  # "0": the MLX ops on the CPU too (A/B, debugging)
MAX_K, MAX_RANK = 64, 256  # cpu/path_select.c's buffers


def _fn():
    return small_gemm.function("dflash_select_path")


def enabled() -> bool:
    """Whether the host selector may run: on MLX's CPU backend with the C library loaded
    (built with the few-row kernel), unless ``DFLASH_HOST_SELECT=0``."""
    if not env.switch(ENV) or not fastmath.on_cpu():
        return False
    return _fn() is not None


def selector_for(top_k: int, rank: int, codebook_dtype):
    """``ops.host_selector``: :func:`select` when it may run for these sizes (float32
    codebooks, the C buffers' limits), else None."""
    fits = top_k <= MAX_K and rank <= MAX_RANK and codebook_dtype == mx.float32
    return select if fits and enabled() else None


def view(a: mx.array) -> np.ndarray:
    """A numpy view of an evaluated MLX array's buffer (no copy)."""
    return np.asarray(memoryview(a))


def _ptr(a: np.ndarray | None):
    return None if a is None else ctypes.c_void_p(a.ctypes.data)


def select(logits, g, anchor, A, Bc, top_k, temperature=0.0, uniforms=None, to_target=None):
    """The whole CPU selector: (tokens [B, L] uint32, cand [B, L, K] uint32 target ids,
    q [B, L, K] float32 or None, path [B, L] int32), as MLX arrays.

    Args:
        logits: [B, L, V'] drafter logits (V' may be a draft vocabulary); g: gates
        [B, L, R]; anchor: [B]; A, Bc: float32 codebooks [V, R]; top_k: K;
        temperature: T; uniforms: [B, L] when T > 0; to_target: the target ids [V'] of
        logits' last axis (a draft vocabulary), or None.
    """
    ids = None if to_target is None else to_target.astype(mx.int32)
    arrays = [logits.astype(mx.float32), g.astype(mx.float32), anchor.astype(mx.int32), A, Bc]
    extra = [a for a in (ids, uniforms) if a is not None]
    mx.eval(*arrays, *extra)
    x, gv, av, Av, Bv = (np.ascontiguousarray(view(a)) for a in arrays)
    iv = None if ids is None else np.ascontiguousarray(view(ids))
    u = None if uniforms is None else np.ascontiguousarray(view(uniforms), np.float32)
    Bsz, L, V = x.shape
    K, R = min(top_k, V), gv.shape[-1]
    cand = np.empty((Bsz, L, K), np.int32)
    path = np.empty((Bsz, L), np.int32)
    q = None if temperature == 0 else np.empty((Bsz, L, K), np.float32)
    fn, T = _fn(), ctypes.c_float(float(temperature))
    for b in range(Bsz):
        rc = fn(
            L, V, _ptr(x[b]), V, _ptr(iv), int(av.reshape(-1)[b]), R, _ptr(gv[b]),
            _ptr(Av), _ptr(Bv), K, T, None if u is None else _ptr(u[b]),
            _ptr(cand[b]), _ptr(path[b]), None if q is None else _ptr(q[b]),
        )  # fmt: skip
        if rc:  # PathSelector checks MAX_K / MAX_RANK first
            raise ValueError(f"selector: top-k {K} or rank {R} out of the kernel's range")
    tokens = np.take_along_axis(cand, path[..., None], axis=-1)  # [B, L, 1]
    # One transfer (each costs ~50 us cold); the slices are views, evaluated only if used.
    packed = mx.array(np.concatenate([tokens, cand, path[..., None]], -1).astype(np.uint32))
    tok, ids_out = packed[..., 0], packed[..., 1 : K + 1]
    return tok, ids_out, None if q is None else mx.array(q), packed[..., K + 1].astype(mx.int32)
