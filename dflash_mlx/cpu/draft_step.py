"""The drafter's decoding step with each layer's block-only work compiled, on the CPU
backend (docs/algorithm.md §2.3).

On MLX's CPU backend every op costs host time whatever its size (~1-2 us a view, ~5-10 us a
reduction or a pad, ~40 us a compiled call before any op runs), and the CPU has no fused
norm, RoPE, conv or softmax kernels. A layer is attention over the context and block rows
between work on the block rows alone: norms, conv taps, projections, RoPE, the MLP. Only
the attention depends on the context, whose length changes every cycle; the rest has the
block's shape, so it is compiled once per width, one call for a layer's post-attention work
and the next layer's pre-attention work. The norms, the convs and the attention's softmax
are exact_ops kernels with the bits of the ops they replace, RoPE reads one (cos | sin)
table per draft, and rows stay 2-D: a demo draft's layers are ~160 graph nodes (~330
before). ``DFlashDrafter.step`` is the uncompiled twin, used on a GPU; the two give the same
bits on the CPU (tested).
"""

from __future__ import annotations

from functools import partial
from itertools import pairwise

import mlx.core as mx
from mlx import nn

from ..model.conv import TwoTapConv
from ..model.drafter import ContextCache, DecoderLayer, DFlashDrafter
from . import exact_ops, fastmath, small_gemm
from .exact_ops import rms_norm as _norm
from .fastmath import LOG2E


def _conv_ops(conv: TwoTapConv, x: mx.array, side: int, dyn: mx.array) -> mx.array:
    """One side of a two-tap conv over a single block x [B, L, H]: the same sums as
    ``conv.two_tap_conv_ops``, written without the constants (row positions, block size)
    that would make the compiled kernels differ from one block width to the next."""
    B, L, H = x.shape
    G = dyn.shape[-1]
    x4 = x.reshape(B, L, G, H // G)
    # Slices only (no gather, no [B, L, 2, G, gs] sum to split): one fused kernel of the
    # same adds and products per element, ~4 fewer graph ops a call.
    b = conv.base_kernel.reshape(4, G, H // G)[2 * side : 2 * side + 2]  # [2, G, gs]
    d = dyn.swapaxes(-1, -2)  # [B, L, G, 2]
    prev = mx.pad(x4[:, :-1], [(0, 0), (1, 0), (0, 0), (0, 0)])  # x[t - 1]; 0 at t = 0
    k0, k1 = b[:1] + d[..., :1], b[1:] + d[..., 1:]  # [B, L, G, gs]
    return (k0 * x4 + k1 * prev).reshape(B, L, H)


_KERNELS: dict = {}  # exact_ops' kernels once they gave our ops' bits on a probe (or False)


def _conv_probe(kernel) -> bool:
    conv = TwoTapConv(48, 2, 16)
    conv.base_kernel = mx.random.normal((2, 2, 48), key=mx.random.key(1))
    x = mx.random.normal((1, 5, 48), key=mx.random.key(2)) * 3.0
    d = mx.random.normal((1, 5, 2, 2, 3), key=mx.random.key(3))
    want = _conv_ops(conv, x, 1, d[:, :, 1])
    return mx.array_equal(kernel(x, conv.base_kernel, d, 1), want).item()


def _softmax_probe(kernel) -> bool:
    s = mx.random.normal((1, 3, 24, 213), key=mx.random.key(4)) * 30.0
    p = mx.power(2.0, s - s.max(axis=-1, keepdims=True))
    return mx.array_equal(kernel(s), p / p.sum(axis=-1, keepdims=True)).item()


def _kernel(name: str):
    """exact_ops' ``conv`` (``two_tap``) or ``softmax`` (``pow2_softmax``) kernel when it
    gives the bits of our ops on a probe, else None (not built, or it differs here)."""
    if name not in _KERNELS:
        getter = exact_ops.two_tap if name == "conv" else exact_ops.pow2_softmax
        probe = _conv_probe if name == "conv" else _softmax_probe
        kernel = getter()
        with mx.stream(mx.cpu):
            _KERNELS[name] = kernel if kernel is not None and probe(kernel) else False
    return _KERNELS[name] or None


def _conv(conv: TwoTapConv, x: mx.array, side: int, d: mx.array) -> mx.array:
    """One side of a two-tap conv over a single block x [L, H] with both sides'
    coefficients d [L, 2, taps, G]: exact_ops' kernel (one op, not ~11, reading the side's
    rows in place) where it applies, else ``_conv_ops``; more taps: the module's."""
    kernel = _kernel("conv") if conv.taps == 2 else None
    if kernel is not None and x.dtype == conv.base_kernel.dtype == d.dtype == mx.float32:
        return kernel(x, conv.base_kernel, d, side)
    if conv.taps != 2:
        return conv.conv(x[None], side, d[None, :, side], x.shape[0])[0]
    return _conv_ops(conv, x[None], side, d[None, :, side])[0]


def _prepare(conv: TwoTapConv, u: mx.array):
    """``conv.prepare`` for one block u [L, H]: (conv0(u), both sides' coefficients, for
    side 1)."""
    d = conv.kernel_projection(u).reshape(u.shape[0], 2, conv.taps, conv.groups)
    return _conv(conv, u, 0, d), d


def _rope(x: mx.array, table: mx.array) -> mx.array:
    """``nn.RoPE`` (not traditional, every dim rotated) of x [N, heads, T, hd] from a table
    [1, 1, T, hd] of its rows' (cos | sin): the products and sums of MLX's own fallback,
    whose cos and sin the table holds (``_RopeTable``), so the same bits."""
    half = x.shape[-1] // 2
    x1, x2, c, s = x[..., :half], x[..., half:], table[..., :half], table[..., half:]
    return mx.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)


def _pre(layer: DecoderLayer, x: mx.array, offset: mx.array, table, ctx: mx.array | None = None):
    """Block rows x [L, H] -> (q grouped [1, Hkv, g * L, hd], k, v [1, Hkv, L, hd][, taps]).

    With ``ctx`` [n, H] (new context rows, projected) k and v are those n rows' then the
    block's [1, Hkv, n + L, hd], from one projection, at positions offset..; q at offset + n.
    ``table``: the (cos | sin) rows of those n + L positions (``_RopeTable``), or None (the
    layer's own RoPE). Rows are 2-D here: a product of [1, L, H] rows costs two more graph
    ops (a flatten and an unflatten) for the same call to the kernel.
    """
    attn = layer.self_attn
    L = x.shape[0]
    u = _norm(layer.input_layernorm, x)
    taps = ()
    if layer.has_conv:
        u, d1 = _prepare(layer.attention_conv, u)
        taps = (d1,)
    q = _norm(attn.q_norm, attn.q_proj(u).reshape(1, L, attn.n_heads, -1)).transpose(0, 2, 1, 3)
    n = 0 if ctx is None else ctx.shape[0]
    rows = u if ctx is None else mx.concatenate([ctx, u], axis=0)
    if table is None:
        k, v = attn.kv(rows[None], offset)
        return (_grouped(attn, attn.rope(q, offset=offset + n if n else offset)), k, v) + taps
    k = _norm(attn.k_norm, attn.k_proj(rows).reshape(1, n + L, attn.n_kv_heads, -1))
    v = attn.v_proj(rows).reshape(1, n + L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    k = _rope(k.transpose(0, 2, 1, 3), table)
    return (_grouped(attn, _rope(q, table[:, :, n:] if n else table)), k, v) + taps


def _grouped(attn, q: mx.array) -> mx.array:
    """q [N, Hq, L, hd] scaled and grouped as ``fastmath.attention`` does (its first op),
    here inside the compiled call: [N, Hkv, (Hq / Hkv) * L, hd]."""
    N, Hq, L, hd = q.shape
    return (q * (attn.scale * LOG2E)).reshape(N, attn.n_kv_heads, (Hq // attn.n_kv_heads) * L, hd)


def _attention(qg: mx.array, k: mx.array, v: mx.array, heads: int) -> mx.array:
    """``fastmath.attention`` from its grouped, scaled queries qg [N, Hkv, g * L, hd] over
    k, v [N, Hkv, S, hd] -> [N, heads, L, hd]: the same matmuls, and its softmax of powers
    of 2 as one exact_ops kernel where checked (five ops and their broadcasts otherwise)."""
    N, _, GL, hd = qg.shape
    s = qg @ k.swapaxes(-1, -2)  # [N, Hkv, g * L, S], in units of log2
    kernel = _kernel("softmax") if s.dtype == mx.float32 else None
    if kernel is None:
        p = mx.power(2.0, s - s.max(axis=-1, keepdims=True))
        p = p / p.sum(axis=-1, keepdims=True)
    else:
        p = kernel(s)
    return (p @ v).reshape(N, heads, GL * k.shape[1] // heads, hd)


def _mlp(mlp, u: mx.array) -> mx.array:
    """``mlp(u)`` whose SiLU is the exact vectorised kernel (``exact_ops.silu_mul``, MLX's
    bits): MLX's scalar exp made the SiLU ~0.25 ms of each layer's ~2.5 ms here."""
    return mlp.down_proj(exact_ops.silu_mul(mlp.gate_proj(u), mlp.up_proj(u)))


def _post(layer: DecoderLayer, final_norm, x: mx.array, o: mx.array, *taps):
    """The rest of the layer after attention o [1, Hq, L, hd] on rows x [L, H]; on the last
    layer the final norm, as [1, L, H]."""
    L = x.shape[0]
    r = layer.self_attn.o_proj(o.transpose(0, 2, 1, 3).reshape(L, -1))
    if layer.has_conv:
        h = x + _conv(layer.attention_conv, r, 1, taps[0])
        u, d2 = _prepare(layer.mlp_conv, _norm(layer.post_attention_layernorm, h))
        h = h + _conv(layer.mlp_conv, _mlp(layer.mlp, u), 1, d2)
    else:
        h = x + r
        h = h + _mlp(layer.mlp, _norm(layer.post_attention_layernorm, h))
    return h if final_norm is None else _norm(final_norm, h).reshape(1, *h.shape)


def _first(drafter: DFlashDrafter, tabled: bool, x, offset, *rest):
    """The projection of the pending rows (``rest``'s last, when given), the RoPE table
    (from the probe ``rest[0]`` when ``tabled``) and the first layer's ``_pre``: returns
    [table][, ctx], q, k, v[, taps]."""
    probe = rest[0] if tabled else None
    ctx = None
    if len(rest) > tabled:  # the pending rows' features [1, n, nT*H], as [n, H]
        feats = rest[-1].reshape(-1, rest[-1].shape[-1])
        ctx = _norm(drafter.hidden_norm, drafter.fc(feats))
    table = None if probe is None else drafter.layers[0].self_attn.rope(probe, offset=offset)
    out = _pre(drafter.layers[0], x, offset, table, ctx)
    return [a for a in (table, ctx) if a is not None] + list(out)


def _between(done: DecoderLayer, layer: DecoderLayer, tabled: bool, x, o, *rest):
    """One layer's ``_post`` then the next one's ``_pre`` (one compiled call, not two):
    ``rest`` is the taps, offset[, table][, ctx]; returns h, q, k, v[, taps]."""
    n = 1 if done.has_conv else 0
    taps, (offset, *extra) = rest[:n], rest[n:]
    table = extra[0] if tabled else None
    ctx = extra[-1] if len(extra) > tabled else None
    h = _post(done, None, x, o, *taps)
    return [h, *_pre(layer, h, offset, table, ctx)]


class _RopeTable:
    """The (cos | sin) rows [1, 1, T, hd] of T positions from an offset, shared by every
    layer's q and k in a draft (one table instead of four RoPE graphs: ~0.2 ms a demo draft).

    They are read from the layers' own ``nn.RoPE`` applied to ones then zeros: its fallback
    gives 1 * cos - 0 * sin = cos and 1 * sin + 0 * cos = sin exactly, so ``_rope`` with them
    repeats MLX's products. Used only where every layer has the same plain ``nn.RoPE`` over
    the whole head and that gives the layer's bits on a probe; else ``rope`` is None.
    """

    def __init__(self, drafter: DFlashDrafter):
        ropes = [layer.self_attn.rope for layer in drafter.layers]
        r = ropes[0]
        hd = drafter.args.head_dim
        plain = all(type(o) is nn.RoPE and vars(o) == vars(r) for o in ropes)
        self.rope = r if plain and not r.traditional and r.dims == hd else None
        self._probes: dict[int, mx.array] = {}
        if self.rope is not None and not self._agrees(hd):
            self.rope = None

    def _agrees(self, hd: int) -> bool:
        """Whether ``_rope`` from a table gives the RoPE's bits on a probe."""
        x = mx.random.normal((1, 3, 5, hd), key=mx.random.key(5)) * 4.0
        off = mx.array(1000, mx.int32)
        table = self.rope(self.probe(5), offset=off)
        return mx.array_equal(_rope(x, table), self.rope(x, offset=off)).item()

    def probe(self, rows: int) -> mx.array | None:
        """Ones then zeros [1, 1, rows, hd], whose RoPE is the table; None when unused."""
        if self.rope is None:
            return None
        probe = self._probes.get(rows)
        if probe is None:
            half = self.rope.dims // 2
            one = mx.concatenate([mx.ones((half,)), mx.zeros((half,))])
            probe = self._probes[rows] = mx.broadcast_to(one, (1, 1, rows, 2 * half))
        return probe


class CompiledStep:
    """``drafter.step`` with each layer's block-only work compiled.

    The context rows appended since the last step (``append_context``'s pending features,
    e.g. the kept rows of the last verify) are projected in the same pass: their keys and
    values come from the block's own projection, one product of n + L rows instead of two
    calls, when the few-row kernel takes n + L rows (then a row's bits do not depend on the
    rows beside it, so they are the bits ``flush_context`` gives); else they are flushed
    first, as on a GPU.

    The weights are compiled as inputs, not constants, so a later update of the same
    modules (new weights loaded into them) is seen.

    Args:
        drafter: the drafter whose step this runs.
    """

    def __init__(self, drafter: DFlashDrafter):
        self.drafter = drafter
        exact_ops.load()  # the MLP's exact SiLU (built once; MLX's ops without it)
        self._table = _RopeTable(drafter)
        tabled = self._table.rope is not None
        layers = drafter.layers
        # Each layer's post-attention work and the next one's pre-attention work are one
        # compiled call: each call costs ~40 us of host time before any op runs.
        state = [drafter.fc.state, drafter.hidden_norm.state, layers[0].state]
        self._stages = [mx.compile(partial(_first, drafter, tabled), inputs=state)]
        for done, layer in pairwise(layers):
            fn = partial(_between, done, layer, tabled)
            self._stages.append(mx.compile(fn, inputs=[done.state, layer.state]))
        fn = partial(_post, layers[-1], drafter.norm)
        self._stages.append(mx.compile(fn, inputs=[layers[-1].state, drafter.norm.state]))

    def convs(self, x: mx.array) -> list[mx.array]:
        """Every layer's two convs, both sides, on block rows x [1, L, H], as the step runs
        them (for ``bench``'s conv share)."""
        out = []
        for layer in self.drafter.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                u, d = _prepare(conv, x[0])
                out.append(_conv(conv, u, 1, d)[None])
        return out

    def _new_rows(self, cache: list[ContextCache], block: int) -> mx.array | None:
        """The pending context rows' features [1, n, nT*H] to project with a block of
        ``block`` rows, or None (nothing pending, or flushed now: too many rows for one
        product)."""
        pending = cache[0].pending
        if not pending:
            return None
        if cache[0].pending_rows + block > small_gemm.max_rows():
            self.drafter.flush_context(cache)
            return None
        feats = pending[0] if len(pending) == 1 else mx.concatenate(pending, axis=1)
        for c in cache:
            c.pending = []
        return feats

    def __call__(self, block_embeds: mx.array, cache: list[ContextCache]) -> mx.array:
        """One block [1, L, H] after the cached context -> final hidden [1, L, H]."""
        d = self.drafter
        L = block_embeds.shape[1]
        feats = self._new_rows(cache, L)
        keep = 0 if feats is None else feats.shape[1]
        offset = mx.array(cache[0].offset, dtype=mx.int32)  # of the new rows, then the block
        probe = self._table.probe(keep + L)
        shared = [a for a in (probe, feats) if a is not None]
        x = block_embeds.reshape(L, -1)  # rows stay 2-D inside the stages (no gather)
        out = self._stages[0](x, offset, *shared)
        shared = out[: len(shared)]  # (table, ctx) as the next stages take them
        q, k, v, *taps = out[len(shared) :]
        for i, (layer, c) in enumerate(zip(d.layers, cache)):
            k, v = c.with_block(k, v, keep)
            o = _attention(q, k, v, layer.self_attn.n_heads)
            if i + 1 == len(d.layers):
                return self._stages[-1](x, o, *taps)
            x, q, k, v, *taps = self._stages[i + 1](x, o, *taps, offset, *shared)


def step(
    drafter: DFlashDrafter, block_embeds: mx.array, cache: list[ContextCache], compiled=None
) -> mx.array:
    """Inference: one block after the cached context.

    Args:
        drafter: the drafter. block_embeds: [1, L, H] embedded [anchor, mask, ...] rows.
        cache: its per-layer context caches.
        compiled: use ``CompiledStep`` (default: on the CPU backend only). Anything but a
            ``DFlashDrafter`` (a test's wrapper) runs its own ``step``.

    Returns:
        the final normed hidden states [1, L, H].
    """
    use = fastmath.on_cpu() if compiled is None else compiled
    if not use or not isinstance(drafter, DFlashDrafter):  # a wrapper keeps its own step
        return drafter.step(block_embeds, cache)
    fn = getattr(drafter, "_compiled_step", None)
    if fn is None:
        fn = drafter._compiled_step = CompiledStep(drafter)
    return fn(block_embeds, cache)


def append_context(drafter: DFlashDrafter, features: mx.array, cache: list[ContextCache]) -> None:
    """``ops.append_context``: leave the kept rows' features pending, so the next ``step``
    projects them in its own pass (``CompiledStep``); a wrapper or the GPU path flushes
    them there too (``DFlashDrafter.step``).

    Args:
        drafter: the drafter. features: [1, n, nT*H] target features of committed tokens.
        cache: its per-layer context caches.
    """
    drafter.append_context(features, cache)
