"""Two-tap dynamic depthwise conv of DFlash 2 (docs/algorithm.md §2.5): the pure-MLX twin,
the fused Metal kernel's launch, the dispatch between them, and the ``TwoTapConv`` module.

Each sublayer (attention, MLP) is wrapped by one ``TwoTapConv``: ``prepare`` convolves the
normed sublayer input with side 0 and hands side 1's dynamic coefficients to ``finish``,
which convolves the sublayer output. Taps never cross a block boundary.
"""

from __future__ import annotations

import mlx.core as mx
from mlx import nn

from . import metal_kernel
from .metal_kernel import KernelSpec

KERNEL = KernelSpec("two_tap_conv", ("x", "base", "dyn"), ("out",))
THREADGROUP = 256  # threads per threadgroup along H


def two_tap_conv_ops(x: mx.array, base: mx.array, dyn: mx.array, block_size: int) -> mx.array:
    """Pure-MLX conv of one side; the semantic definition of the Metal kernel.

    ``out[t] = sum_j (base[j] + dyn[t, j, c // gs]) * x[t - j]`` with ``x[t - j] = 0``
    whenever ``t - j`` lies in an earlier block (blocks start at multiples of block_size).

    Args:
        x: inputs [B, L, H].
        base: base kernel of one side [taps, H].
        dyn: per-group dynamic part [B, L, taps, G]; gs = H // G.
        block_size: rows per block; L is a multiple of it or a single partial block.

    Returns:
        [B, L, H] in x's dtype, accumulated in float32.
    """
    _, L, H = x.shape  # [B, L, H]
    taps, G = dyn.shape[-2], dyn.shape[-1]
    gs = H // G
    xf = x.astype(mx.float32)
    # [B, L, taps, H]: group coefficients broadcast over their channels
    k = base.astype(mx.float32) + mx.repeat(dyn.astype(mx.float32), gs, axis=-1)
    pos = mx.arange(L) % block_size  # row index inside its block
    out = k[:, :, 0] * xf
    for j in range(1, taps):
        shifted = mx.pad(xf[:, : L - j], [(0, 0), (j, 0), (0, 0)]) if L > j else mx.zeros_like(xf)
        keep = (pos >= j)[None, :, None]
        out = out + mx.where(keep, k[:, :, j] * shifted, 0.0)
    return out.astype(x.dtype)


def two_tap_conv_kernel(
    kernel, x: mx.array, base: mx.array, dyn: mx.array, block_size: int
) -> mx.array:
    """Launch the fused kernel (``metal/two_tap_conv.metal``) for one side.

    The rows are viewed as one block per batch entry of the launch ([B * L / W, W, H], W the
    block width, or L itself for a single partial block), so the kernel reads the width from
    its input's shape: no width is a template argument, and one compiled Metal library
    serves every block width.

    Args:
        kernel: object returned by ``metal_kernel.build(KERNEL, ...)``.
        x: [B, L, H]; base: [taps, H]; dyn: [B, L, taps, G]; block_size: rows per block;
            L is a multiple of it or a single partial block.

    Returns:
        [B, L, H] in x's dtype.
    """
    Bsz, L, H = x.shape
    taps, G = dyn.shape[-2], dyn.shape[-1]
    width = min(int(block_size), L)
    if base.shape != (taps, H) or dyn.shape[:2] != (Bsz, L) or H % G or width < 1 or L % width:
        raise ValueError(
            f"conv shapes: x {x.shape}, base {base.shape}, dyn {dyn.shape}, block {block_size}"
        )
    nb = Bsz * (L // width)  # blocks
    (out,) = kernel(
        inputs=[x.reshape(nb, width, H), base, dyn.reshape(nb, width, taps, G)],
        template=[("T", x.dtype), ("TAPS", taps)],
        grid=(H, width, nb),
        threadgroup=(min(H, THREADGROUP), 1, 1),
        output_shapes=[(nb, width, H)],
        output_dtypes=[x.dtype],
    )
    return out.reshape(Bsz, L, H)


def two_tap_conv(x: mx.array, base: mx.array, dyn: mx.array, block_size: int) -> mx.array:
    """Conv of one side: the fused kernel on a Metal GPU, else ``two_tap_conv_ops``.

    Args:
        x: [B, L, H]; base: [taps, H]; dyn: [B, L, taps, G]; block_size: rows per block.

    Returns:
        [B, L, H] in x's dtype.
    """
    kernel = metal_kernel.cached(KERNEL, self_check) if metal_kernel.use_metal() else None
    L = x.shape[1]
    if kernel is not None and L and L % min(block_size, L) == 0:  # else: partial blocks
        return two_tap_conv_kernel(kernel, x, base, dyn, block_size)
    return two_tap_conv_ops(x, base, dyn, block_size)


def self_check(kernel) -> str | None:
    """Run ``kernel`` and the twin on small random inputs (two blocks, three groups).

    Args:
        kernel: a built kernel object.

    Returns:
        why they differ, or None.
    """
    key = mx.random.key(7)  # the process's random state is left alone
    k1, k2, k3 = mx.random.split(key, 3)
    x = mx.random.normal((1, 8, 48), key=k1)  # [B, L, H]
    base = mx.random.normal((2, 48), key=k2)  # [taps, H]
    dyn = 0.5 * mx.random.normal((1, 8, 2, 3), key=k3)  # [B, L, taps, G]
    got = two_tap_conv_kernel(kernel, x, base, dyn, 4)
    return metal_kernel.compare([got], [two_tap_conv_ops(x, base, dyn, 4)], atol=1e-4)


class TwoTapConv(nn.Module):
    """One DFlash 2 conv pair (side 0 before the sublayer, side 1 after it).

    Args:
        hidden_size: H.
        kernel_size: taps per side (2 in released checkpoints).
        group_size: channels sharing one dynamic coefficient (G = H // group_size).
    """

    def __init__(self, hidden_size: int, kernel_size: int = 2, group_size: int = 16):
        super().__init__()
        self.taps = kernel_size
        self.groups = hidden_size // group_size
        # Identity at init: tap 0 = 1, other taps 0, no dynamic part.
        base = mx.zeros((2, kernel_size, hidden_size))
        self.base_kernel = base.at[:, 0].add(1.0)
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.kernel_projection.weight = mx.zeros_like(self.kernel_projection.weight)

    def prepare(self, u: mx.array, block_size: int) -> tuple[mx.array, mx.array]:
        """Convolve the normed sublayer input u [B, L, H] with side 0.

        Returns:
            (conv0(u) [B, L, H], side-1 dynamic coefficients [B, L, taps, G]).
        """
        B, L, _ = u.shape
        d = self.kernel_projection(u).reshape(B, L, 2, self.taps, self.groups)
        return self.conv(u, 0, d[:, :, 0], block_size), d[:, :, 1]

    def finish(self, y: mx.array, d1: mx.array, block_size: int) -> mx.array:
        """Convolve the sublayer output y [B, L, H] with side 1's coefficients."""
        return self.conv(y, 1, d1, block_size)

    def conv(self, x: mx.array, side: int, dyn: mx.array, block_size: int) -> mx.array:
        """Convolve x with one side's base kernel and dynamic part."""
        return two_tap_conv(x, self.base_kernel[side], dyn, block_size)
