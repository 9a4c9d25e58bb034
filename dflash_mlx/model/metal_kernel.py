"""What the fused Metal kernels of ``conv`` and ``selector`` share: where their ``.metal``
bodies are, building a kernel object once, and whether to run it at all.

Each kernel lives in one module next to its pure-MLX twin and its dispatch (``conv.py``,
``selector.py``), as mlx-lm's ``gated_delta.py`` does; this module knows nothing about them.
The bodies are the files in the repository's top-level ``metal/`` folder, which a wheel
carries as ``dflash_mlx/metal/``. Setting ``DFLASH_MLX_REFERENCE_KERNELS=1`` forces the
pure-MLX twins (for debugging).

The first use of a kernel in a process checks it against its twin on small random inputs
(``cached(spec, check)``): a failed build, a failed launch or a mismatch switches that kernel
to its twin for the rest of the process, with one ``warning:`` line naming it. Lossless
decoding never depends on a kernel being right.
"""

from __future__ import annotations

import sys
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


_cache: dict[str, object] = {}  # name -> kernel object, or None when its check failed
_problems: dict[str, str] = {}  # name -> why its check failed
_metal_available: bool | None = None
factory: Callable | None = None  # builds kernels; None: mx.fast.metal_kernel (tests: a stand-in)
REPORT_HINT = "Please report it with `dflash doctor` output"


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


def cached(spec: KernelSpec, check: Callable | None = None):
    """The kernel object of ``spec``, built (and checked) on first use; None when it failed.

    Args:
        spec: the kernel's names.
        check: ``check(kernel) -> None | str``: runs the kernel and its twin on small inputs
            and returns why they differ, or None. A build or launch error, or a returned
            reason, stores None (the caller runs the twin) and prints one warning line.
    """
    if spec.name not in _cache:
        _cache[spec.name] = _build_checked(spec, check)
    return _cache[spec.name]


def _build_checked(spec: KernelSpec, check: Callable | None):
    try:
        kernel = build(spec, factory)
        problem = check(kernel) if check is not None else None
    except Exception as e:  # noqa: BLE001 - a compile or launch error of any kind
        problem = " ".join(f"{type(e).__name__}: {e}".split())[:200]
    if problem is None:
        return kernel
    _problems[spec.name] = problem
    print(
        f"warning: the {spec.name} Metal kernel failed its check ({problem}); using the MLX "
        f"twin. {REPORT_HINT}",
        file=sys.stderr,
        flush=True,
    )
    return None


def report() -> dict[str, str]:
    """Each kernel used or checked so far: ``ok``, or ``failed: <why>`` (the twin runs)."""
    return {
        n: "ok" if k is not None else f"failed: {_problems.get(n, '?')}" for n, k in _cache.items()
    }


def reset() -> None:
    """Forget built kernels and failed checks (the next use builds and checks again)."""
    _cache.clear()
    _problems.clear()


def compare(got, want, atol: float) -> str | None:
    """Why a kernel's outputs differ from its twin's, or None when they agree.

    Args:
        got, want: sequences of arrays (kernel, twin), compared in float32.
        atol: largest absolute difference allowed (0: bit-equal).
    """
    import numpy as np

    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        a, b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
        if a.shape != b.shape:
            return f"output {i} has shape {a.shape}, the twin's {b.shape}"
        err = float(np.nanmax(np.abs(a - b))) if a.size else 0.0
        if not np.isfinite(a).all() or not err <= atol:
            return f"output {i} differs from the twin by {err:.3g} (allowed {atol:g})"
    return None


def use_metal() -> bool:
    """True when the fused kernels should run: Metal present, default device GPU, no override."""
    global _metal_available
    if env.switch(REFERENCE_ENV, default=False):
        return False
    if _metal_available is None:
        _metal_available = bool(mx.metal.is_available())
    return _metal_available and mx.default_device().type == mx.DeviceType.gpu
