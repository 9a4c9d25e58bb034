"""Tape rollback for Gated DeltaNet mixers (docs/algorithm.md §4.4.1).

A verify runs each known mixer through :func:`forward`: the same submodules and mlx-lm
functions, in the same order, as the mixer's own ``__call__`` (the same bits; checked once
per class by :func:`known`), while keeping what the recurrence consumed (a :class:`Tape`).
On a partial acceptance :func:`rewind` restores the snapshot and runs only the recurrence
over the kept steps: no input projections and no conv, which replaying the mixer repeats.
Unknown mixer classes are not taped; the adapter replays them (``target.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx import nn
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk


@dataclass
class Tape:
    """What one call of a mixer fed its recurrence, per step.

    Attributes:
        conv_input: [B, K-1+S, C] the conv state before the call, then the S new conv rows.
        q, k: [B, S, Hk, Dk] after the conv and the L2 norm. v: [B, S, Hv, Dv].
        a, b: [B, S, Hv] the gate and beta inputs (``gated_delta_update`` maps them).
    """

    conv_input: mx.array
    q: mx.array
    k: mx.array
    v: mx.array
    a: mx.array
    b: mx.array


def _front_qwen3_5(m, x: mx.array):
    """qwen3_5's input projections: (conv rows [B, S, C], z [B, S, Hv, Dv], b, a)."""
    B, S, _ = x.shape
    qkv = m.in_proj_qkv(x)
    z = m.in_proj_z(x).reshape(B, S, m.num_v_heads, m.head_v_dim)
    return qkv, z, m.in_proj_b(x), m.in_proj_a(x)


def _front_qwen3_next(m, x: mx.array):
    """qwen3_next's fused projections, reordered as its mixer does (same outputs as above)."""
    B, S, _ = x.shape
    q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(x), m.in_proj_ba(x))
    qkv = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], -1)
    return qkv, z, b, a


# (module, class) of the mixers whose __call__ ``forward`` reproduces; others are replayed
_FRONTS = {
    ("mlx_lm.models.qwen3_5", "GatedDeltaNet"): _front_qwen3_5,
    ("mlx_lm.models.qwen3_next", "Qwen3NextGatedDeltaNet"): _front_qwen3_next,
}
_checked: dict[type, bool] = {}  # class -> whether forward gave the mixer's bits on a probe


def _front(m):
    if getattr(m, "sharding_group", None) is not None:  # distributed: not reproduced
        return None
    return _FRONTS.get((type(m).__module__, type(m).__name__))


def forward(m: nn.Module, x: mx.array, mask=None, cache=None) -> tuple[mx.array, Tape]:
    """Run a known Gated DeltaNet mixer ``m`` on x [B, S, H] as its ``__call__`` does (the
    same bits, the same cache updates) and return (output [B, S, H], its tape).

    Args:
        m: the mixer (``known(m)``). x: its input. mask: [B, S] bool or None. cache: its
            ``ArraysCache`` (conv state, recurrent state) or None.
    """
    B, S, _ = x.shape
    qkv, z, b, a = _front(m)(m, x)
    if cache is not None and cache[0] is not None:
        conv_state = cache[0]
    else:
        conv_state = mx.zeros((B, m.conv_kernel_size - 1, m.conv_dim), dtype=x.dtype)
    if mask is not None:
        qkv = mx.where(mask[..., None], qkv, 0)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)  # [B, K-1+S, C]
    if cache is not None:
        n_keep = m.conv_kernel_size - 1
        if cache.lengths is not None:
            ends = mx.clip(cache.lengths, 0, S)
            positions = (ends[:, None] + mx.arange(n_keep))[..., None]
            cache[0] = mx.take_along_axis(conv_input, positions, axis=1)
        else:
            cache[0] = mx.contiguous(conv_input[:, -n_keep:, :])
    conv_out = nn.silu(m.conv1d(conv_input))
    heads = [m.num_k_heads, m.num_k_heads, m.num_v_heads]
    dims = [m.head_k_dim, m.head_k_dim, m.head_v_dim]
    parts = mx.split(conv_out, [m.key_dim, 2 * m.key_dim], -1)
    q, k, v = [t.reshape(B, S, h, d) for t, h, d in zip(parts, heads, dims)]
    state = cache[1] if cache else None
    q, k = normalize_qk(q, k, inv_scale=m.head_k_dim**-0.5, eps=1e-6)
    out, state = gated_delta_update(
        q, k, v, a, b, m.A_log, m.dt_bias, state, mask, use_kernel=not m.training
    )
    if cache is not None:
        cache[1] = state
        cache.advance(S)
    out = m.out_proj(m.norm(out, z).reshape(B, S, -1))
    return out, Tape(conv_input, q, k, v, a, b)


def rewind(m: nn.Module, tape: Tape, cache, snap: list, keep: int) -> None:
    """Make ``cache`` hold what feeding only the first ``keep`` taped steps from ``snap``
    gives: the conv state is the conv input's rows up to there, the recurrent state the
    snapshot's run through the recurrence over those steps (the same function and order).

    Args:
        m: the mixer that wrote the tape. tape: its last call's. cache: its ArraysCache.
        snap: the cache's entries before that call. keep: steps to keep (0..S).
    """
    cache.cache = list(snap)
    if keep == 0:
        return
    n_keep = m.conv_kernel_size - 1
    cache[0] = mx.contiguous(tape.conv_input[:, keep : keep + n_keep, :])  # [B, K-1, C]
    t = [x[:, :keep] for x in (tape.q, tape.k, tape.v, tape.a, tape.b)]
    _, state = gated_delta_update(
        *t[:3], t[3], t[4], m.A_log, m.dt_bias, snap[1], None, use_kernel=not m.training
    )
    cache[1] = state
    cache.advance(keep)


def known(m: nn.Module) -> bool:
    """Whether ``m`` can be taped: its class is one ``forward`` reproduces, and on a probe
    (two calls, through a cache) ``forward`` gave the mixer's own outputs and states bit for
    bit. A changed mlx-lm that breaks this leaves the mixer to be replayed instead."""
    if _front(m) is None:
        return False
    cls = type(m)
    if cls not in _checked:
        _checked[cls] = _probe(m)
    return _checked[cls]


def _probe(m: nn.Module) -> bool:
    """forward against m.__call__ on a random input, fed 3 rows then 2 through a cache."""
    dtype = m.norm.weight.dtype
    x = mx.random.normal((1, 5, m.hidden_size), key=mx.random.key(7)).astype(dtype)
    mine, theirs = ArraysCache(2), ArraysCache(2)
    got, want = [], []
    for rows in (x[:, :3], x[:, 3:]):
        got.append(forward(m, rows, None, mine)[0])
        want.append(m(rows, None, theirs))
    got += mine.cache
    want += theirs.cache
    mx.eval(got, want)
    return all(mx.array_equal(g, w).item() for g, w in zip(got, want))
