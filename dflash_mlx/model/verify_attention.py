"""A verify's attention split into row chunks that keep MLX's fused vector kernel on Metal.

``mx.fast.scaled_dot_product_attention`` runs its fused vector kernel only while
``q_len <= 8`` and ``q_len x (heads / KV heads) <= 32`` (and the head dim is 64, 96, 128
or 256); past that, a verify of up to 8 rows falls to the unfused path, which materialises
every score and is slow at long context (an 8-row verify of a GQA-6 model). Here the
projections stay one product over all rows (weights are what a Mac pays for) and only the
attention is split into chunks of :func:`fused_rows` rows; each chunk's causal mask or tree
mask rows are its own, so the result equals the unchunked attention.

Nothing in mlx-lm is edited: :func:`wrap_layers` wraps the attention *instances* of known
families (``llama`` (mistral too) / ``qwen2``, ``qwen3``, the full-attention layers of
``qwen3_next`` / ``qwen3_5``), re-running their own submodules in their own order; each
wrapper is checked against its module on a probe at wrap time, and unknown families are left
alone. ``ops.prepare_target`` wraps on a Metal GPU (``DFLASH_VERIFY_CHUNKS=0`` turns it off);
the CPU backend does not (no fused kernel there: the chunks only add ops).
"""

from __future__ import annotations

import sys

import mlx.core as mx
from mlx import nn

from .. import env
from .wrapper import Wrapper

ENV = "DFLASH_VERIFY_CHUNKS"
VECTOR_MAX_ROWS = 8  # MLX's sdpa_vector: q_len <= 8 ...
VECTOR_MAX_PRODUCT = 32  # ... and q_len * gqa <= 32
VECTOR_HEAD_DIMS = (64, 96, 128, 256)
FULL_HEAD_DIMS = (64, 80, 128)  # past 8 rows MLX's fused full kernel takes these: one call
# module -> (class name, whether q/k are RMS-normed per head, whether q carries a gate)
FAMILIES = {
    "mlx_lm.models.llama": ("Attention", False, False),
    "mlx_lm.models.qwen2": ("Attention", False, False),
    "mlx_lm.models.qwen3": ("Attention", True, False),
    "mlx_lm.models.qwen3_next": ("Qwen3NextAttention", True, True),
}


def fused_rows(n_heads: int, n_kv_heads: int) -> int:
    """Query rows one fused vector-kernel call can take for this head layout.

    Args:
        n_heads: query heads. n_kv_heads: key/value heads (GQA factor = their ratio).

    Returns:
        at most 8 rows with rows x GQA <= 32; 1 when even one row exceeds it (GQA > 32:
        no chunking keeps the kernel then).
    """
    gqa = max(1, n_heads // max(1, n_kv_heads))
    return max(1, min(VECTOR_MAX_ROWS, VECTOR_MAX_PRODUCT // gqa))


def chunked_sdpa(sdpa, queries, keys, values, cache, scale: float, mask, rows: int):
    """``sdpa`` (mlx-lm's ``scaled_dot_product_attention``) over row chunks of ``rows``.

    A causal chunk sees the keys up to its own last row (the cache's keys cut there, so
    MLX's lower-right causal alignment is the chunk's); an array mask gives each chunk its
    own rows. Keys may be quantized (mlx-lm's tuples of data, scales, biases).

    Args:
        sdpa: ``f(q, k, v, cache=, scale=, mask=)``. queries: [B, Hq, L, D];
            keys, values: [B, Hkv, S, D] (or quantized tuples); mask: None, "causal" or an
            array broadcastable to [B, Hq, L, S]. rows: query rows per call.

    Returns:
        [B, Hq, L, Dv], the unchunked attention's values.
    """
    L = queries.shape[-2]
    if L <= rows:
        return sdpa(queries, keys, values, cache=cache, scale=scale, mask=mask)
    S = (keys[0] if isinstance(keys, (tuple, list)) else keys).shape[-2]
    outs = []
    for i in range(0, L, rows):
        j = min(L, i + rows)
        q, k, v, m = queries[..., i:j, :], keys, values, mask
        if isinstance(mask, str):  # causal: chunk rows i..j-1 see keys < S - L + j
            k, v = _cut(keys, S - L + j), _cut(values, S - L + j)
        elif mask is not None and mask.ndim >= 2 and mask.shape[-2] == L:
            m = mask[..., i:j, :]  # [..., rows, S]: the chunk's own mask rows
        outs.append(sdpa(q, k, v, cache=cache, scale=scale, mask=m))
    return mx.concatenate(outs, axis=-2)


def _cut(kv, n: int):
    """The first n positions of keys or values (each part of a quantized tuple)."""
    if isinstance(kv, (tuple, list)):
        return type(kv)(p[..., :n, :] for p in kv)
    return kv[..., :n, :]


class ChunkedAttention(Wrapper):
    """One attention instance of a known family whose sdpa runs in row chunks.

    Calls the inner module as is when no chunking applies (one row, a quantized cache,
    rows within one fused call); otherwise runs the family's steps with its own submodules.
    """

    def __init__(self, inner: nn.Module, norms: bool, gated: bool, rows: int, full: bool):
        super().__init__(inner)
        object.__setattr__(self, "_how", (norms, gated))
        object.__setattr__(self, "rows", rows)
        object.__setattr__(self, "_full", full)  # more than 8 rows: one fused full call
        object.__setattr__(self, "_sdpa", sys.modules[type(inner).__module__])

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        L = x.shape[1]
        if L <= self.rows or hasattr(cache, "bits") or (self._full and L > VECTOR_MAX_ROWS):
            return self.inner(x, mask=mask, cache=cache)  # quantized: no fused kernel
        return self.forward(x, mask, cache, self.rows)

    def forward(self, x: mx.array, mask, cache, rows: int) -> mx.array:
        """The family's attention with the sdpa in chunks of ``rows`` (a huge ``rows``:
        exactly the module's own computation, which the wrap-time probe checks)."""
        norms, gated = self._how
        B, L, _ = x.shape  # [B, L, hidden]
        hq, hkv = _heads(self.inner)
        q = self.q_proj(x)
        if gated:  # [B, L, Hq, 2D] -> queries and a sigmoid gate on the output
            q, gate = mx.split(q.reshape(B, L, hq, -1), 2, axis=-1)
            gate = gate.reshape(B, L, -1)
        q = q.reshape(B, L, hq, -1)  # [B, L, Hq, D]
        k = self.k_proj(x).reshape(B, L, hkv, -1)  # [B, L, Hkv, D]
        v = self.v_proj(x).reshape(B, L, hkv, -1).transpose(0, 2, 1, 3)  # [B, Hkv, L, D]
        if norms:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)  # [B, H, L, D]
        if cache is not None:
            q, k = self.rope(q, offset=cache.offset), self.rope(k, offset=cache.offset)
            k, v = cache.update_and_fetch(k, v)
        else:
            q, k = self.rope(q), self.rope(k)
        sdpa = self._sdpa.scaled_dot_product_attention
        out = chunked_sdpa(sdpa, q, k, v, cache, self.scale, mask, rows)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)  # [B, L, Hq * D]
        return self.o_proj(out * mx.sigmoid(gate) if gated else out)


def _heads(attn) -> tuple[int, int]:
    """(query heads, KV heads) of an attention module of a known family."""
    for hq, hkv in (("n_heads", "n_kv_heads"), ("num_attention_heads", "num_key_value_heads")):
        if hasattr(attn, hq) and hasattr(attn, hkv):
            return int(getattr(attn, hq)), int(getattr(attn, hkv))
    raise AttributeError(f"{type(attn).__name__} has no head counts")


def wrap(attn: nn.Module, rows: int | None = None) -> ChunkedAttention | None:
    """``attn`` chunked, when its family is known, its head dim has the fused kernel, one
    fused call cannot take an 8-row verify, and the wrapper gives its bits on a probe.

    Args:
        attn: an mlx-lm attention instance. rows: rows per chunk (tests); default
            :func:`fused_rows`.

    Returns:
        the wrapper, or None (left alone).
    """
    family = FAMILIES.get(type(attn).__module__)
    if family is None or type(attn).__name__ != family[0]:
        return None
    try:
        hq, hkv = _heads(attn)
        head_dim = round(float(attn.scale) ** -2)  # scale = head_dim ** -0.5
    except (AttributeError, TypeError, ZeroDivisionError):
        return None
    if rows is None and (head_dim not in VECTOR_HEAD_DIMS or fused_rows(hq, hkv) >= 8):
        return None  # no fused kernel at this head dim, or an 8-row verify already fits
    full = rows is None and head_dim in FULL_HEAD_DIMS
    wrapper = ChunkedAttention(attn, family[1], family[2], rows or fused_rows(hq, hkv), full)
    return wrapper if _faithful(wrapper) else None


def _faithful(wrapper: ChunkedAttention) -> bool:
    """The wrapper's own steps, unchunked, give the module's bits on a 3-row probe with a
    cache (a check that mlx-lm's family still computes what ``forward`` mirrors)."""
    from mlx_lm.models.cache import KVCache

    hidden = wrapper.q_proj.weight.shape[-1]
    if getattr(wrapper.q_proj, "bits", None):  # quantized: input width from its groups
        hidden = wrapper.q_proj.scales.shape[-1] * wrapper.q_proj.group_size
    x = mx.random.normal((1, 3, hidden), key=mx.random.key(5)).astype(mx.float32)
    try:
        want = wrapper.inner(x, mask="causal", cache=KVCache())
        got = wrapper.forward(x, "causal", KVCache(), rows=1 << 30)
        return bool(mx.array_equal(got, want).item())
    except Exception:  # noqa: BLE001 - a family that changed shape: leave it alone
        return False


def wrap_layers(layers: list, rows: int | None = None) -> int:
    """Wrap each decoder layer's attention where :func:`wrap` applies.

    Args:
        layers: the model's decoder layers (tapped ones are unwrapped here).
        rows: rows per chunk for every layer (tests); default :func:`fused_rows`.

    Returns:
        how many attention modules were wrapped.
    """
    n = 0
    for layer in layers:
        base = getattr(layer, "inner", layer)  # a layer the target adapter taps
        attn = getattr(base, "self_attn", None)
        if attn is None or isinstance(attn, ChunkedAttention):
            continue
        chunked = wrap(attn, rows)
        if chunked is not None:
            base.self_attn, n = chunked, n + 1
    return n


def enabled() -> bool:
    """Whether ``ops.prepare_target`` chunks verify attention: on a Metal GPU (where the
    fused vector kernel exists), unless ``DFLASH_VERIFY_CHUNKS=0``."""
    return _on_metal() and env.switch(ENV)


def _on_metal() -> bool:
    return mx.default_device().type == mx.DeviceType.gpu and mx.metal.is_available()
