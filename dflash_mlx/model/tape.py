"""Tape rollback for Gated DeltaNet mixers (docs/algorithm.md §4.4.1).

A verify runs each known mixer through :func:`forward`: the same submodules and mlx-lm
functions, in the same order, as the mixer's own ``__call__`` (the same bits; checked once
per class by :func:`known`), while keeping what the recurrence consumed (a :class:`Tape`).
On a partial acceptance :func:`rewind` restores the snapshot and runs only the recurrence
over the kept steps: no input projections and no conv, which replaying the mixer repeats.
Unknown mixer classes are not taped; the adapter replays them (``target.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx
from mlx import nn
from mlx_lm.models import gated_delta
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.gated_delta import compute_g, gated_delta_update, normalize_qk

# mlx-lm's one step of its ops path: a verify off the Metal kernel runs it step by step as
# ``gated_delta_ops`` does, keeping each step's state (None: that mlx-lm has no such step)
_STEP = getattr(gated_delta, "_gated_delta_step_ops", None)
RECORD_BYTES = 64 << 20  # most bytes of per-step states one verify keeps per mixer


@dataclass
class Tape:
    """What one call of a mixer fed its recurrence, per step.

    Attributes:
        conv_input: [B, K-1+S, C] the conv state before the call, then the S new conv rows.
        q, k: [B, S, Hk, Dk] after the conv and the L2 norm. v: [B, S, Hv, Dv].
        a, b: [B, S, Hv] the gate and beta inputs (``gated_delta_update`` maps them).
        states: the recurrent state after each step, S x [B, Hv, Dv, Dk], when the verify
            ran mlx-lm's ops path step by step (``_recorded``); then a rewind runs nothing.
    """

    conv_input: mx.array
    q: mx.array
    k: mx.array
    v: mx.array
    a: mx.array
    b: mx.array
    states: list | None = None


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
_checked: dict[type, tuple[bool, bool]] = {}  # class -> the probe's verdicts (``_checks``)


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
    states = None
    if mask is None and _recordable(m, k, v):
        out, states = _recorded(m, q, k, v, a, b, state)
        state = states[-1]
    else:
        out, state = gated_delta_update(
            q, k, v, a, b, m.A_log, m.dt_bias, state, mask, use_kernel=not m.training
        )
    if cache is not None:
        cache[1] = state
        cache.advance(S)
    out = m.out_proj(m.norm(out, z).reshape(B, S, -1))
    return out, Tape(conv_input, q, k, v, a, b, states)


def _recordable(m, k, v) -> bool:
    """Whether ``forward`` may run the recurrence itself and keep every step's state: off
    the Metal kernel, with mlx-lm's step at hand, and within ``RECORD_BYTES``."""
    B, S, _, Dk = k.shape
    Hv, Dv = v.shape[2], v.shape[3]
    small = S * B * Hv * Dv * Dk * 4 <= RECORD_BYTES  # float32 states
    return _STEP is not None and small and not _kernel_path(m, k)


def _recorded(m, q, k, v, a, b, state):
    """``gated_delta_update`` without the kernel, as mlx-lm's ``gated_delta_ops`` runs it
    (its functions, its order: the same bits), keeping the state after every step.

    Shapes: q, k [B, S, Hk, Dk]; v [B, S, Hv, Dv]; a, b [B, S, Hv]; state [B, Hv, Dv, Dk]
    or None. Returns (y [B, S, Hv, Dv], S states).
    """
    beta, g = mx.sigmoid(b), compute_g(m.A_log, a, m.dt_bias)
    B, S, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if Hv // Hk > 1:
        q, k = mx.repeat(q, Hv // Hk, -2), mx.repeat(k, Hv // Hk, -2)
    ys, states = [], []
    for t in range(S):
        y, state = _STEP(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, None)
        ys.append(y)
        states.append(state)
    return mx.stack(ys, axis=1), states


def _steps(k, v, g, beta, state):
    """The gated delta recurrence's state after T steps (its readout is not needed): the
    arithmetic of mlx-lm's ``_gated_delta_step_ops`` in its order, with each input laid
    out once so a step slices it without reshapes (~4x fewer graph ops than its ops path).

    Shapes: k [B, T, Hk, Dk], v [B, T, Hv, Dv], g and beta [B, T, Hv], state
    [B, Hv, Dv, Dk] float32. Returns the state [B, Hv, Dv, Dk].
    """
    T, Hk, Hv = k.shape[1], k.shape[2], v.shape[2]
    if Hv // Hk > 1:
        k = mx.repeat(k, Hv // Hk, -2)
    ks = mx.split(k.transpose(0, 2, 1, 3), T, axis=2)  # T x [B, Hv, 1, Dk]
    vs = mx.split(v.transpose(0, 2, 3, 1), T, axis=3)  # T x [B, Hv, Dv, 1]
    gs = mx.split(g.transpose(0, 2, 1)[..., None], T, axis=2)  # T x [B, Hv, 1, 1]
    bs = mx.split(beta.transpose(0, 2, 1)[..., None], T, axis=2)  # T x [B, Hv, 1, 1]
    for t in range(T):
        state = state * gs[t]
        kv_mem = (state * ks[t]).sum(axis=-1, keepdims=True)  # [B, Hv, Dv, 1]
        delta = (vs[t] - kv_mem) * bs[t]
        state = state + ks[t] * delta
    return state


_compiled_steps = mx.compile(_steps)


def _kernel_path(m, k) -> bool:
    """Whether ``gated_delta_update`` runs mlx-lm's Metal kernel on these inputs."""
    dk = k.shape[-1]
    metal = mx.default_device() == mx.gpu and mx.metal.is_available()
    return not m.training and metal and dk >= 32 and dk % 32 == 0


def rewind(m: nn.Module, tape: Tape, cache, snap: list, keep: int, own: bool = True) -> None:
    """Make ``cache`` hold what feeding only the first ``keep`` taped steps from ``snap``
    gives: the conv state is the conv input's rows up to there, the recurrent state the
    snapshot's run through the recurrence over those steps (the same arithmetic and order).

    Args:
        m: the mixer that wrote the tape. tape: its last call's. cache: its ArraysCache.
        snap: the cache's entries before that call. keep: steps to keep (0..S).
        own: off mlx-lm's Metal kernel, run the recurrence as ``_steps`` (checked by the
            probe) instead of mlx-lm's op-by-op loop.
    """
    cache.cache = list(snap)
    if keep == 0:
        return
    n_keep = m.conv_kernel_size - 1
    cache[0] = mx.contiguous(tape.conv_input[:, keep : keep + n_keep, :])  # [B, K-1, C]
    if tape.states is not None:  # the verify kept the state after each step
        cache[1] = tape.states[keep - 1]
        cache.advance(keep)
        return
    q, k, v, a, b = (x[:, :keep] for x in (tape.q, tape.k, tape.v, tape.a, tape.b))
    state = snap[1]
    if own and not _kernel_path(m, k):
        if state is None:
            B, Hv, Dv, Dk = k.shape[0], v.shape[2], v.shape[3], k.shape[3]
            state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
        g = compute_g(m.A_log, a, m.dt_bias)
        state = _compiled_steps(k, v, g, mx.sigmoid(b), state)
    else:
        use_kernel = not m.training
        _, state = gated_delta_update(
            q, k, v, a, b, m.A_log, m.dt_bias, state, None, use_kernel=use_kernel
        )
    cache[1] = state
    cache.advance(keep)


def known(m: nn.Module) -> bool:
    """Whether ``m`` can be taped: its class is one ``forward`` reproduces, and on a probe
    (two calls, through a cache) ``forward`` gave the mixer's own outputs and states bit for
    bit. A changed mlx-lm that breaks this leaves the mixer to be replayed instead."""
    return _front(m) is not None and _checks(m)[0]


def own_steps(m: nn.Module) -> bool:
    """Whether ``rewind`` may run ``_steps`` for ``m``: on the probe it gave the state of
    mlx-lm's recurrence bit for bit (else ``rewind`` calls ``gated_delta_update``)."""
    return known(m) and _checks(m)[1]


def _checks(m: nn.Module) -> tuple[bool, bool]:
    """(forward ok, _steps ok) for m's class, probed once."""
    cls = type(m)
    if cls not in _checked:
        _checked[cls] = _probe(m)
    return _checked[cls]


def _probe(m: nn.Module) -> tuple[bool, bool]:
    """forward against m.__call__ on a random input fed 3 rows then 4 through a cache;
    then a rewind to 3 of the 4 with ``_steps`` against one with mlx-lm's recurrence."""
    dtype = m.norm.weight.dtype
    x = mx.random.normal((1, 7, m.hidden_size), key=mx.random.key(7)).astype(dtype)
    mine, theirs = ArraysCache(2), ArraysCache(2)
    got, want = [], []
    for rows in (x[:, :3], x[:, 3:]):
        snap = list(mine.cache)
        out, t = forward(m, rows, None, mine)
        got.append(out)
        want.append(m(rows, None, theirs))
    got += mine.cache
    want += theirs.cache
    rewound = []
    for own in (True, False):
        c = ArraysCache(2)
        rewind(m, replace(t, states=None), c, snap, 3, own)  # the recurrence, run again
        rewound.append(c.cache)
    mx.eval(got, want, rewound)
    same = all(mx.array_equal(g, w, equal_nan=True).item() for g, w in zip(got, want))
    return same, all(mx.array_equal(a, b, equal_nan=True).item() for a, b in zip(*rewound))
