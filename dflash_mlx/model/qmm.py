"""A verify's few-row quantized matmul on Metal: the twin (MLX's own ``quantized_matmul``),
the kernel's launch (``metal/few_row_qmm.metal``), the dispatch between them, the
instance wrappers that route a target's ``QuantizedLinear`` and LM head through it, and
doctor's check that a verify's rows equal plain decoding's (``rows_match``).

MLX's quantized matmul costs far more for 8 rows than for 1 (docs/cli.md, roofline); the
kernel reads each weight once for all 2..16 rows of a verify. It is used only on a Metal
GPU (``ops.prepare_target``); the Linux CPU backend keeps its own few-row kernel.
"""

from __future__ import annotations

import mlx.core as mx

from .. import env
from . import metal_kernel, qmm_choice
from .metal_kernel import KernelSpec
from .wrapper import Wrapper

KERNEL = KernelSpec("few_row_qmm", ("x", "w", "scales", "biases"), ("out",))
MAX_ROWS = 16  # rows the kernel takes; wider inputs (prefill) go to MLX's qmm
BITS = (4, 8)
GROUPS = (32, 64, 128)
COLS, LANES, SIMDGROUPS = 4, 32, 2  # the body's tiling (see its header)


def qmm_ops(x, w, scales, biases, group_size: int, bits: int) -> mx.array:
    """The twin: ``mx.quantized_matmul(x, w, scales, biases, transpose=True)`` in MLX's
    affine layout, the semantic definition of the kernel.

    Args:
        x: [..., K]. w: [N, K * bits / 32] uint32. scales, biases: [N, K / group_size].
        group_size: 32, 64 or 128. bits: 4 or 8.

    Returns:
        [..., N] in x's dtype.
    """
    return mx.quantized_matmul(
        x, w, scales, biases, transpose=True, group_size=group_size, bits=bits
    )


def fits(x: mx.array, w: mx.array, group_size: int, bits: int) -> bool:
    """Whether the kernel takes this call: 2..16 rows, 4 / 8 bits, group 32 / 64 / 128."""
    rows = x.size // x.shape[-1] if x.ndim else 0
    k = w.shape[-1] * 32 // bits if bits in BITS else -1
    return 2 <= rows <= MAX_ROWS and group_size in GROUPS and x.shape[-1] == k and w.ndim == 2


def qmm_kernel(kernel, x, w, scales, biases, group_size: int, bits: int) -> mx.array:
    """Launch the few-row kernel (any row count up to 16, one row included).

    Args:
        kernel: object returned by ``metal_kernel.build(KERNEL, ...)``.
        x: [..., K] with at most 16 rows; w, scales, biases, group_size, bits: as
            :func:`qmm_ops`.

    Returns:
        [..., N] in x's dtype.
    """
    K, N = x.shape[-1], w.shape[0]
    rows = x.size // K
    if rows > MAX_ROWS or K % group_size or scales.shape != (N, K // group_size):
        raise ValueError(f"qmm shapes: x {x.shape}, w {w.shape}, scales {scales.shape}")
    (out,) = kernel(
        inputs=[x.reshape(rows, K), w, scales.astype(x.dtype), biases.astype(x.dtype)],
        template=[("T", x.dtype), ("BITS", bits), ("GS", group_size)],
        grid=(LANES, -(-N // COLS), 1),
        threadgroup=(LANES, SIMDGROUPS, 1),
        output_shapes=[(rows, N)],
        output_dtypes=[x.dtype],
    )
    return out.reshape(*x.shape[:-1], N)


def qmm(x, w, scales, biases, group_size: int, bits: int) -> mx.array:
    """Quantized ``x @ dequantize(w).T``: the kernel on a Metal GPU for 2..16 rows, else
    the twin (``DFLASH_MLX_REFERENCE_KERNELS=1`` forces the twin).

    Args:
        x, w, scales, biases, group_size, bits: as :func:`qmm_ops`.
    """
    kernel = metal_kernel.cached(KERNEL, self_check) if metal_kernel.use_metal() else None
    if (
        kernel is not None
        and fits(x, w, group_size, bits)
        and _faster(kernel, x, w, scales, biases, group_size, bits)
    ):
        return qmm_kernel(kernel, x, w, scales, biases, group_size, bits)
    return qmm_ops(x, w, scales, biases, group_size, bits)


def _faster(kernel, x, w, scales, biases, group_size: int, bits: int) -> bool:
    """Whether the kernel is at least as fast as MLX's qmm for this call's shape: timed
    once per shape on stand-in rows (``qmm_choice``), the faster kept."""

    def args():  # random rows of x's shape: x itself is a node of the graph being built
        rows = mx.random.normal(x.shape, key=mx.random.key(0)).astype(x.dtype)
        return rows, w, scales, biases, group_size, bits

    key = qmm_choice.shape_key(x, w, group_size, bits)
    mine, theirs = (lambda: qmm_kernel(kernel, *args())), (lambda: qmm_ops(*args()))
    return qmm_choice.CHOOSER.use_kernel(mine, theirs, key)


def self_check(kernel) -> str | None:
    """Run ``kernel`` and the twin on small random weights (4 and 8 bits, 5 rows).

    Returns:
        why they differ, or None.
    """
    k1, k2 = mx.random.split(mx.random.key(11))  # the process's random state is left alone
    x = mx.random.normal((5, 256), key=k1)  # float32: the twin rounds nothing on any device
    weight = mx.random.normal((12, 256), key=k2)
    for bits in BITS:
        w, s, b = mx.quantize(weight, group_size=64, bits=bits)
        got = qmm_kernel(kernel, x, w, s, b, 64, bits)
        problem = metal_kernel.compare([got], [qmm_ops(x, w, s, b, 64, bits)], atol=1e-3)
        if problem is not None:
            return f"{bits}-bit: {problem}"
    return None


# (K, N) of typical 4-bit projections (attention, MLP up, MLP down) for ``rows_match``
ROW_SHAPES = ((4096, 4096), (4096, 12288), (12288, 4096))
ROWS_LINE = "verify rows = plain rows"


def rows_match(kernel, shapes=None, rows: int = 8) -> str:
    """Whether a verify's rows equal plain decoding's bit for bit: on random 4-bit,
    group-64, bf16 weights of each (K, N), ``kernel(x)[i]`` against MLX's one-row
    ``quantized_matmul(x[i:i+1])`` (the plain step's qmv on Metal), every i.

    Args:
        kernel: object returned by ``metal_kernel.build(KERNEL, ...)``.
        shapes: (K, N) pairs (default :data:`ROW_SHAPES`). rows: the verify's rows.

    Returns:
        "verify rows = plain rows: yes", or "...: no (max diff D)" for ``doctor``.
    """
    worst, same = 0.0, True
    for j, (k, n) in enumerate(shapes or ROW_SHAPES):
        kx, kw = mx.random.split(mx.random.key(101 + j))  # the process's state is left alone
        x = mx.random.normal((rows, k), key=kx).astype(mx.bfloat16)
        w, s, b = mx.quantize(mx.random.normal((n, k), key=kw), group_size=64, bits=4)
        s, b = s.astype(mx.bfloat16), b.astype(mx.bfloat16)
        got = qmm_kernel(kernel, x, w, s, b, 64, 4)
        plain = mx.concatenate([qmm_ops(x[i : i + 1], w, s, b, 64, 4) for i in range(rows)])
        same = same and bool(mx.array_equal(got, plain))
        diff = mx.abs(got.astype(mx.float32) - plain.astype(mx.float32)).max()
        worst = max(worst, float(diff.item()))
    return f"{ROWS_LINE}: yes" if same else f"{ROWS_LINE}: no (max diff {worst:.3g})"


def on_metal() -> bool:
    """Whether to wrap a target's projections at all: a Metal GPU is the default device (the
    dispatch still honours ``DFLASH_MLX_REFERENCE_KERNELS``)."""
    return mx.default_device().type == mx.DeviceType.gpu and mx.metal.is_available()


def report() -> str:
    """The kernel's state for ``dflash doctor``: not applicable off Metal, forced to the
    twin, not used yet, or built and checked (``ok``) / failed and why."""
    if not mx.metal.is_available():
        return "not applicable (no Metal GPU; the CPU backend has its own few-row kernel)"
    if env.switch(metal_kernel.REFERENCE_ENV, default=False):
        return f"off ({metal_kernel.REFERENCE_ENV}=1: MLX's quantized_matmul runs)"
    state = metal_kernel.report().get(KERNEL.name)
    return "not used yet" if state is None else state


class FewRowLinear(Wrapper):
    """A ``QuantizedLinear`` (affine) whose 2..16-row calls go through :func:`qmm`.

    Args:
        inner: the mlx-lm ``nn.QuantizedLinear`` instance (left unchanged).
    """

    def __call__(self, x: mx.array) -> mx.array:
        q = self.inner
        rows = x.size // x.shape[-1]
        if not 2 <= rows <= MAX_ROWS:
            return q(x)  # one row (plain decoding) and prefill: MLX's own kernels
        y = qmm(x, q["weight"], q["scales"], q["biases"], q.group_size, q.bits)
        return y + q["bias"] if "bias" in q else y


class FewRowEmbedding(Wrapper):
    """A tied ``QuantizedEmbedding`` whose ``as_linear`` (the LM head) sends 2..16 rows
    through :func:`qmm`; token lookups and other row counts are the inner's own.

    Args:
        inner: the mlx-lm ``nn.QuantizedEmbedding`` instance (left unchanged).
    """

    def __call__(self, ids: mx.array) -> mx.array:
        return self.inner(ids)

    def as_linear(self, x: mx.array) -> mx.array:
        q = self.inner
        if not 2 <= x.size // x.shape[-1] <= MAX_ROWS:
            return q.as_linear(x)
        return qmm(x, q["weight"], q["scales"], q["biases"], q.group_size, q.bits)


def _affine(m) -> bool:
    return (
        getattr(m, "mode", "affine") == "affine"
        and m.bits in BITS
        and m.group_size in GROUPS
        and m.get("biases") is not None
    )


def wrappable(m) -> bool:
    """An affine ``QuantizedLinear`` of 4 / 8 bits and group 32 / 64 / 128."""
    from mlx import nn

    return isinstance(m, nn.QuantizedLinear) and _affine(m)


def wrap_head(text_model) -> int:
    """Wrap the LM head of a model (instances only): its ``lm_head`` if it has one (as
    :class:`FewRowLinear`), else its tied ``model.embed_tokens`` (as
    :class:`FewRowEmbedding`), where affine-quantized.

    Args:
        text_model: the module holding ``lm_head`` / ``model.embed_tokens``.

    Returns:
        how many were wrapped (0 or 1).
    """
    from mlx import nn

    head = getattr(text_model, "lm_head", None)
    if head is not None:
        if wrappable(head):
            text_model.lm_head = FewRowLinear(head)
            return 1
        return 0
    inner = text_model.model
    emb = inner.embed_tokens
    if isinstance(emb, nn.QuantizedEmbedding) and _affine(emb):
        inner.embed_tokens = FewRowEmbedding(emb)
        return 1
    return 0


def unwrap(m):
    """The module a few-row wrapper holds (``m`` itself when not wrapped)."""
    return m.inner if isinstance(m, (FewRowLinear, FewRowEmbedding)) else m


def wrap_tree(root) -> int:
    """Wrap every eligible ``QuantizedLinear`` below ``root`` (instances only).

    Args:
        root: a module (a decoder layer, a model).

    Returns:
        how many were wrapped.
    """
    n = 0
    for _, parent in root.named_modules():
        if isinstance(parent, FewRowLinear):
            continue
        for key in parent.children():
            child = parent[key]  # children() copies lists: edit the module's own
            slots = list(enumerate(child)) if isinstance(child, list) else [(key, child)]
            owner = child if isinstance(child, list) else parent
            for k, m in slots:  # a module, or each module of a list (mlx-lm's layers)
                if not isinstance(m, FewRowLinear) and wrappable(m):
                    owner[k] = FewRowLinear(m)
                    n += 1
    return n
