"""Exact 16-bit copies of float32 weights for the few-row kernel (``small_gemm.py``).

On the CPU every weight is float32 (only float32 matmuls reach the fast BLAS), but many
hold fewer bits: a bfloat16 drafter checkpoint loaded as float32, or a target dequantized
in float16 from a GGUF file. A decode step reads each weight once from memory, so its few-row
products are bound by the bytes read; the kernel multiplies registered weights from their
16-bit words instead, widened exactly, in the same order: the same bits at half the bytes.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from . import small_gemm


def register(arrays) -> int:
    """Register every 2-D float32 MLX array that a 16-bit type holds exactly.

    Args:
        arrays: MLX arrays (weights); others, and inexact ones, are skipped.

    Returns:
        how many were registered.
    """
    if not small_gemm.has_kernel():
        return 0
    arrays = [a for a in arrays if isinstance(a, mx.array) and a.ndim == 2]
    arrays = [a for a in arrays if a.dtype == mx.float32]
    mx.eval(arrays)
    return sum(small_gemm.register(a, np.asarray(memoryview(a))) for a in arrays)


def register_drafter(model) -> int:
    """Register the drafter's weights and its draft-vocabulary head of a ``DFlashModel``:
    on the demo, halves the bytes its layers and head read each cycle.

    Returns:
        how many were registered.
    """
    weights = [w for _, w in tree_flatten(model.drafter.parameters())]
    head = getattr(model.draft_head, "_weight", None)
    return register(weights + ([head] if head is not None else []))
