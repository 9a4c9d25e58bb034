"""The one seam between the engine and a backend's accelerations (docs/architecture.md).

The model and the decode loop call these functions; by default they are plain MLX, which is
what a Mac runs (Metal kernels are chosen inside ``model/conv.py`` and ``model/selector.py``).
``dflash_mlx.cpu.install`` replaces them, once, with twins that make MLX's Linux CPU backend
fast and give the same results (the same bits where the docstring says so). Nothing here
imports a backend; call them through the module (``ops.softmax(x)``) so a replacement is seen.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx


def softmax(x: mx.array, axis: int = -1) -> mx.array:
    """``mx.softmax(x, axis, precise=True)`` in float32 (-inf entries get 0)."""
    return mx.softmax(x.astype(mx.float32), axis=axis, precise=True)


def logsumexp(x: mx.array, axis: int = -1) -> mx.array:
    """``mx.logsumexp(x, axis, keepdims=True)`` in float32."""
    return mx.logsumexp(x.astype(mx.float32), axis=axis, keepdims=True)


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask=None) -> mx.array:
    """The drafter's scaled dot-product attention, q [N, Hq, L, hd] over k, v [N, Hkv, S, hd]."""
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def draft_step(drafter, block_embeds: mx.array, cache: list) -> mx.array:
    """The drafter's pass over one block [1, L, H] after its cached context -> [1, L, H]."""
    return drafter.step(block_embeds, cache)


def append_context(drafter, features: mx.array, cache: list) -> None:
    """Add the kept rows' target features [1, n, nT*H] to the drafter's context after a
    verify. Plain MLX projects them now, so the device does it while the host builds the
    next cycle; the CPU twin leaves them pending for the next draft to project in its own
    pass (``cpu/draft_step.py``)."""
    drafter.append_context(features, cache, lazy=False)


def host_selector(top_k: int, rank: int, codebook_dtype) -> Callable | None:
    """A whole path selector that runs on the host for these sizes, or None (the selector
    then runs as MLX ops or its Metal kernel). Its signature is ``select_host.select``'s."""
    return None


def prepare_target(layers: list) -> int:
    """Prepare a target's decoder layers for this backend; returns how many modules changed.
    Plain MLX: on a Metal GPU, a verify's attention is split into row chunks that keep the
    fused vector kernel (``model/verify_attention.py``) and its quantized projections take
    the few-row kernel (``model/qmm.py``); elsewhere nothing.

    Args:
        layers: the model's decoder layers (some wrapped by the target adapter).
    """
    from .model import qmm, verify_attention

    n = verify_attention.wrap_layers(layers) if verify_attention.enabled() else 0
    if qmm.on_metal():
        n += sum(qmm.wrap_tree(layer) for layer in layers)
    return n


def describe() -> dict[str, str]:
    """What computes, for cache keys and reports: the device and MLX's version, and on the
    CPU backend the BLAS and kernels in use."""
    return {"device": str(mx.default_device()), "mlx": mx.__version__}


def backend_status() -> dict | None:
    """Each part of the installed backend and its state (``dflash doctor``); None: plain
    MLX, no backend installed."""
    return None


def backend_name() -> str:
    """A one-line name of the matmul backend for the stats (``dflash run -v``)."""
    return "Metal" if mx.default_device() == mx.gpu else "MLX CPU"


_NAMES = (
    "softmax",
    "logsumexp",
    "attention",
    "draft_step",
    "append_context",
    "host_selector",
    "prepare_target",
    "describe",
    "backend_name",
    "backend_status",
)


_DEFAULTS = {name: globals()[name] for name in _NAMES}


def use(**impls: Callable) -> None:
    """Replace some of these functions for the rest of the process (a backend's install).

    Args:
        impls: name -> function with the same signature and meaning.
    """
    unknown = set(impls) - set(_NAMES)
    if unknown:
        raise ValueError(f"ops has no {sorted(unknown)}")
    globals().update(impls)


def reset() -> None:
    """Back to the plain MLX functions (tests of the path a Mac runs)."""
    globals().update(_DEFAULTS)
