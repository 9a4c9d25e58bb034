"""Kernel dispatch: fused Metal kernels on a Metal GPU, the pure-MLX reference elsewhere.

The references in ``conv`` and ``selector`` are the semantic definition; the Metal bodies in
``metal/*.metal`` (package data) must match them. Each kernel is built once, lazily, with
``mx.fast.metal_kernel`` the first time it is needed on a Metal GPU. Setting
``DFLASH_MLX_REFERENCE_KERNELS=1`` forces the references (for debugging).

The launch helpers (``conv_launch``, ``select_launch``) take the kernel object as an argument
so that tests can run the very same argument preparation through a CPU emulation of the
kernel body (``tests/metal_emu``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import mlx.core as mx

from .conv import two_tap_conv as _conv_reference

REFERENCE_ENV = "DFLASH_MLX_REFERENCE_KERNELS"
METAL_DIR = Path(__file__).resolve().parent / "metal"

# name -> (input names, output names); the .metal file is metal/<name>.metal
KERNEL_IO: Dict[str, Tuple[Tuple[str, ...], Tuple[str, ...]]] = {
    "two_tap_conv": (("x", "base", "dyn"), ("out",)),
    "path_select": (("U", "cand", "anchor", "g", "A", "Bc", "uniforms", "params"),
                    ("path", "q")),
}
CONV_THREADGROUP = 256  # threads per threadgroup along H for the conv
SELECT_MAX_THREADS = 256  # K * W threads per selector threadgroup (Metal limit: 1024)

_kernels: Dict[str, object] = {}
_metal_available: Optional[bool] = None


def kernel_source(name: str) -> str:
    """Text of ``metal/<name>.metal``, the kernel body passed to ``mx.fast.metal_kernel``."""
    try:
        from importlib.resources import files

        return (files(__package__) / "metal" / f"{name}.metal").read_text()
    except (ImportError, FileNotFoundError, TypeError):
        return (METAL_DIR / f"{name}.metal").read_text()


def build_kernel(name: str, factory: Optional[Callable] = None):
    """Create the kernel object for ``name`` with ``factory`` (default mx.fast.metal_kernel)."""
    factory = factory or mx.fast.metal_kernel
    inputs, outputs = KERNEL_IO[name]
    return factory(
        name=f"dflash_{name}",
        input_names=list(inputs),
        output_names=list(outputs),
        source=kernel_source(name),
    )


def _kernel(name: str):
    """Cached Metal kernel (built on first use)."""
    if name not in _kernels:
        _kernels[name] = build_kernel(name)
    return _kernels[name]


def use_metal() -> bool:
    """True when the fused kernels should run: Metal present, default device GPU, no override."""
    global _metal_available
    if os.environ.get(REFERENCE_ENV, "0") not in ("", "0"):
        return False
    if _metal_available is None:
        _metal_available = bool(mx.metal.is_available())
    return _metal_available and mx.default_device().type == mx.DeviceType.gpu


def conv_launch(kernel, x: mx.array, base: mx.array, dyn: mx.array, block_size: int) -> mx.array:
    """Launch the two-tap conv kernel for one side.

    Args:
        kernel: object returned by ``build_kernel("two_tap_conv", ...)``.
        x: [B, L, H]; base: [taps, H]; dyn: [B, L, taps, G]; block_size: rows per block.

    Returns:
        [B, L, H] in x's dtype.
    """
    Bsz, L, H = x.shape
    taps, G = dyn.shape[-2], dyn.shape[-1]
    if base.shape != (taps, H) or dyn.shape[:2] != (Bsz, L) or H % G:
        raise ValueError(f"conv shapes: x {x.shape}, base {base.shape}, dyn {dyn.shape}")
    (out,) = kernel(
        inputs=[x, base, dyn],
        template=[("T", x.dtype), ("TAPS", taps), ("BLOCK", int(block_size))],
        grid=(H, L, Bsz),
        threadgroup=(min(H, CONV_THREADGROUP), 1, 1),
        output_shapes=[x.shape],
        output_dtypes=[x.dtype],
    )
    return out


def lanes_per_candidate(K: int, R: int) -> int:
    """Lanes W that split one candidate's rank-R dot product (a power of two, K * W <= 256)."""
    w = 1
    while w * 2 * K <= SELECT_MAX_THREADS and w * 2 <= R:
        w *= 2
    return w


def select_launch(kernel, U, cand, anchor, g, A, B, temperature=0.0, uniforms=None,
                  lanes: Optional[int] = None):
    """Launch the path-selector kernel (one launch for the whole batch).

    Args:
        kernel: object returned by ``build_kernel("path_select", ...)``.
        U, cand: [B, L, K]; anchor: [B]; g: [B, L, R]; A, B: [V, R];
        temperature: T; uniforms: [B, L] when T > 0; lanes: override W (tests).

    Returns:
        (path [B, L] int32, q [B, L, K] float32 or None when greedy).
    """
    Bsz, L, K = cand.shape
    R = g.shape[-1]
    sample = temperature > 0
    if sample and uniforms is None:
        raise ValueError("sampled selection needs uniforms [B, L]")
    if not mx.issubdtype(cand.dtype, mx.integer):
        raise ValueError(f"cand must hold integer token ids, got {cand.dtype}")
    W = lanes or lanes_per_candidate(K, R)
    if K * W > 1024:
        raise ValueError(f"top-k {K} x lanes {W} exceeds 1024 threads per threadgroup")
    # 64-bit ids are not passed to the kernel; 32-bit ids cover any vocabulary
    cand = cand if cand.dtype in (mx.uint32, mx.int32) else cand.astype(mx.uint32)
    anchor = anchor.reshape(Bsz)
    anchor = anchor if anchor.dtype in (mx.uint32, mx.int32) else anchor.astype(mx.uint32)
    u = uniforms.astype(mx.float32) if sample else mx.zeros((1,), mx.float32)
    params = mx.array([float(temperature) if sample else 1.0], dtype=mx.float32)
    path, q = kernel(
        inputs=[U, cand, anchor, g, A, B, u, params],
        template=[("K", K), ("W", W), ("SAMPLE", bool(sample))],
        grid=(K * W, Bsz, 1),
        threadgroup=(K * W, 1, 1),
        output_shapes=[(Bsz, L), (Bsz, L, K) if sample else (1,)],
        output_dtypes=[mx.int32, mx.float32],
    )
    return path, (q if sample else None)


def two_tap_conv(x: mx.array, base: mx.array, dyn: mx.array, block_size: int) -> mx.array:
    """Dynamic two-tap conv of one side; see ``conv.two_tap_conv`` for the semantics.

    Args:
        x: [B, L, H]; base: [taps, H]; dyn: [B, L, taps, G]; block_size: rows per block.

    Returns:
        [B, L, H] in x's dtype: the fused kernel on a Metal GPU, else the reference.
    """
    if use_metal():
        return conv_launch(_kernel("two_tap_conv"), x, base, dyn, block_size)
    return _conv_reference(x, base, dyn, block_size)


def select_path(U, cand, anchor, g, A, B, temperature=0.0, uniforms=None):
    """Path selection of SPEC §4; see ``selector.select_path`` for the semantics.

    Args:
        U, cand: [B, L, K] scores and ids; anchor: [B]; g: [B, L, R]; A, B: [V, R];
        temperature: T; uniforms: [B, L] in [0, 1) when T > 0.

    Returns:
        (path [B, L] int32 candidate indices, q [B, L, K] float32 or None when greedy).
    """
    if use_metal():
        return select_launch(_kernel("path_select"), U, cand, anchor, g, A, B,
                             temperature, uniforms)
    from .selector import select_path as _reference

    return _reference(U, cand, anchor, g, A, B, temperature, uniforms)
