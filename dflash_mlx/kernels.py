"""Kernel dispatch: fused Metal kernels on a Metal GPU, the pure-MLX reference elsewhere.

The references in ``conv`` and ``selector`` are the semantic definition; the Metal bodies in
``metal/*.metal`` must match them.
"""

from __future__ import annotations

import mlx.core as mx

from .conv import two_tap_conv as _conv_reference


def two_tap_conv(x: mx.array, base: mx.array, dyn: mx.array, block_size: int) -> mx.array:
    """Dynamic two-tap conv of one side; see ``conv.two_tap_conv`` for the semantics."""
    return _conv_reference(x, base, dyn, block_size)


def select_path(U, cand, anchor, g, A, B, temperature=0.0, uniforms=None):
    """Path selection of SPEC §4; see ``selector.select_path`` for the semantics."""
    from .selector import select_path as _reference

    return _reference(U, cand, anchor, g, A, B, temperature, uniforms)
