"""The target's decoder layers compiled for MLX's CPU backend (``ops.prepare_target``).

On the CPU backend each op costs ~10 us of host time, and the compiled fallbacks of RoPE and
RMSNorm, and the MLP, fuse into a few kernels with the same bits. The SwiGLU MLP's SiLU and
the attention's softmax become the exact vectorised kernels (``exact_ops.py``). Nothing in
mlx-lm is edited: the modules of one loaded model are wrapped, as ``model/target.py`` does.
"""

from __future__ import annotations

import mlx.core as mx
from mlx import nn

from ..model.target import _Tap, _Wrapper
from . import exact_ops


class _Compiled(_Wrapper):
    """A target module whose call is ``mx.compile``d (its weights as inputs, so updates are
    seen); on the CPU backend each op costs ~10 us of host time, and the compiled fallbacks
    of RoPE and RMSNorm, and the MLP, fuse into a few kernels with the same bits."""

    def __init__(self, inner: nn.Module):
        super().__init__(inner)
        object.__setattr__(self, "_fn", mx.compile(lambda *a: inner(*a), inputs=[inner.state]))

    def __call__(self, x: mx.array) -> mx.array:
        return self._fn(x)


class _ExactMLP(_Wrapper):
    """A SwiGLU MLP, compiled, whose SiLU is the exact vectorised kernel (``exact_ops.py``):
    the same bits as mlx-lm's ``swiglu`` at ~1/10 of its cost on the CPU."""

    def __init__(self, inner: nn.Module):
        super().__init__(inner)

        def fn(x):
            return inner.down_proj(exact_ops.silu_mul(inner.gate_proj(x), inner.up_proj(x)))

        object.__setattr__(self, "_fn", mx.compile(fn, inputs=[inner.state]))

    def __call__(self, x: mx.array) -> mx.array:
        return self._fn(x)


def _exact_mlp(mlp: nn.Module) -> nn.Module | None:
    """``mlp`` as an :class:`_ExactMLP` if that gives its bits on a probe, else None."""
    if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        return None
    fast = _ExactMLP(mlp)
    x = mx.random.normal((1, 3, mlp.down_proj.weight.shape[0]), key=mx.random.key(3))
    return fast if mx.array_equal(fast(x), mlp(x)).item() else None


class _CompiledRope(_Wrapper):
    """A compiled ``nn.RoPE`` whose int offsets become arrays: one trace per shape, not one
    per position."""

    def __init__(self, inner: nn.Module):
        super().__init__(inner)
        fn = mx.compile(lambda x, offset: inner(x, offset=offset))
        object.__setattr__(self, "_fn", fn)

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        return self._fn(x, mx.array(offset, mx.int32) if isinstance(offset, int) else offset)


def _plain_mlp(mlp) -> bool:
    """An mlx-lm MLP that issues no collective: a sharded one (its ``down_proj`` ends in an
    ``all_sum``) stays uncompiled, since a compiled trace would issue its collectives out of
    the sight of ``distributed/link.py``'s counting and delay (and Metal compiles none)."""
    if type(mlp).__name__ != "MLP" or not type(mlp).__module__.startswith("mlx_lm.models"):
        return False
    return "ShardedToAll" not in type(getattr(mlp, "down_proj", None)).__name__


def compile_layers(layers: list) -> int:
    """Compile each decoder layer's block-only modules: RoPE, the two RMSNorms and a plain
    MLP (only these exact kinds; anything else is left as it is). The attention with its
    cache stays uncompiled. Returns how many modules were wrapped.

    Args:
        layers: the model's decoder layers (tapped ones are unwrapped here).
    """
    kernels = exact_ops.load() is not None
    n, exact = 0, kernels
    for layer in layers:
        base = layer.inner if isinstance(layer, _Tap) else layer
        attn = getattr(base, "self_attn", None)
        if attn is not None and type(getattr(attn, "rope", None)) is nn.RoPE:
            attn.rope, n = _CompiledRope(attn.rope), n + 1
        for name in ("input_layernorm", "post_attention_layernorm"):
            if type(getattr(base, name, None)) is nn.RMSNorm:
                setattr(base, name, _Compiled(getattr(base, name)))
                n += 1
        mlp = getattr(base, "mlp", None)
        if _plain_mlp(mlp):
            fast = _exact_mlp(mlp) if exact else None
            exact = fast is not None  # one probe failing keeps MLX's SiLU for all layers
            base.mlp, n = fast or _Compiled(mlp), n + 1
    return n + (exact_ops.install_attention(layers) if kernels else 0)
