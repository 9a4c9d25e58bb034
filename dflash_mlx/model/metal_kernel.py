"""What the fused Metal kernels of ``conv`` and ``selector`` share: where their ``.metal``
bodies are, building a kernel object once, and whether to run it at all.

Each kernel lives in one module next to its pure-MLX twin and its dispatch (``conv.py``,
``selector.py``), as mlx-lm's ``gated_delta.py`` does; this module knows nothing about them.
The bodies are the files in the repository's top-level ``metal/`` folder, which a wheel
carries as ``dflash_mlx/metal/``. Setting ``DFLASH_MLX_REFERENCE_KERNELS=1`` forces the
pure-MLX twins (for debugging).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from .. import env

REFERENCE_ENV = "DFLASH_MLX_REFERENCE_KERNELS"


@dataclass(frozen=True)
class KernelSpec:
    """The argument names of one ``mx.fast.metal_kernel``; its body is ``metal/<name>.metal``.

    Attributes:
        name: file stem of the body. inputs, outputs: buffer names, in launch order.
    """

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


_cache: dict[str, object] = {}
_metal_available: bool | None = None


def source_dir() -> Path:
    """Folder of the ``.metal`` bodies: ``dflash_mlx/metal`` in a wheel, the top-level
    ``metal/`` of a checkout (editable install, PYTHONPATH)."""
    here = Path(__file__).resolve().parents[1]  # the dflash_mlx package
    for d in (here / "metal", here.parent / "metal"):
        if d.is_dir():
            return d
    raise FileNotFoundError(f"no metal/ folder next to {here}; reinstall dflash-mlx")


def source(name: str) -> str:
    """Text of ``metal/<name>.metal``: the kernel body given to ``mx.fast.metal_kernel``.

    Args:
        name: the file stem, e.g. ``two_tap_conv``.
    """
    return (source_dir() / f"{name}.metal").read_text()


def build(spec: KernelSpec, factory: Callable | None = None):
    """Create the kernel object of ``spec``.

    Args:
        spec: names of the kernel, its body and its buffers.
        factory: ``mx.fast.metal_kernel`` (default), or a stand-in with its signature (the
            tests' CPU emulation).
    """
    factory = factory or mx.fast.metal_kernel
    return factory(
        name=f"dflash_{spec.name}",
        input_names=list(spec.inputs),
        output_names=list(spec.outputs),
        source=source(spec.name),
    )


def cached(spec: KernelSpec):
    """The kernel object of ``spec``, built on first use with ``mx.fast.metal_kernel``.

    Args:
        spec: the kernel's names.
    """
    if spec.name not in _cache:
        _cache[spec.name] = build(spec)
    return _cache[spec.name]


def use_metal() -> bool:
    """True when the fused kernels should run: Metal present, default device GPU, no override."""
    global _metal_available
    if env.switch(REFERENCE_ENV, default=False):
        return False
    if _metal_available is None:
        _metal_available = bool(mx.metal.is_available())
    return _metal_available and mx.default_device().type == mx.DeviceType.gpu
