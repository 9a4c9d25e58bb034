"""Everything that exists only to make MLX's Linux CPU backend fast, behind one seam.

The engine never imports these modules: it calls ``dflash_mlx.ops``, whose plain-MLX
functions :func:`install` replaces with this package's twins, and the loader calls
:func:`install` once per loaded pair. A Mac never imports a compiler path: :func:`enabled`
is false there and nothing below is loaded.

- ``blas``: the system OpenBLAS (else the scipy-openblas32 wheel's), loaded before MLX
  (:func:`preload`);
- ``small_gemm``: the few-row matmul in front of it (with the host selector's C code);
- ``exact_ops``: exact vectorised SiLU, softmax and attention (a nanobind extension);
- ``half_weights``: exact 16-bit copies of float32 weights for the few-row kernel;
- ``select_host``: the path selector in one C call; ``draft_step``: the compiled drafter
  step; ``target``: the target's compiled layers; ``fastmath``: exp-free softmax;
- ``builder``: the one way their sources are compiled and cached (``csrc/``);
  ``sharedlib``: a library checked on disk before it is mapped, MLX's compile cache swept.

Switches (``env.switch``): ``DFLASH_CPU=0`` turns the whole backend off (plain MLX, as on a
Mac); ``DFLASH_SYSTEM_BLAS``, ``DFLASH_SCIPY_OPENBLAS``, ``DFLASH_SMALL_GEMM``, ``DFLASH_EXACT_OPS``,
``DFLASH_HOST_SELECT`` turn off one part each.
"""

from __future__ import annotations

import sys

from .. import env

ENV = "DFLASH_CPU"
_installed: dict = {"ops": False}


def enabled() -> bool:
    """Whether this backend applies: Linux, unless ``DFLASH_CPU=0``. (MLX on Linux runs on
    its CPU backend; each twin still checks the device it runs on.)"""
    return sys.platform.startswith("linux") and env.switch(ENV)


def preload() -> str | None:
    """Load the system OpenBLAS and the few-row kernel in front of it, before anything
    imports MLX (``dflash_mlx/__init__.py``). Returns the BLAS's path, or None.

    First a missing or unwritable temp folder is replaced (Linux, even with the backend
    off: MLX's compiler needs one), and the libraries of MLX's compile cache that would
    crash or fail its load are removed (``sharedlib.sweep_mlx_cache``)."""
    if sys.platform.startswith("linux"):
        from ..loading import cachedir

        cachedir.fix_tmpdir()
    if not enabled():
        return None
    from .sharedlib import sweep_mlx_cache

    sweep_mlx_cache()
    from .blas import load_system_blas

    return load_system_blas()


def install(pair=None) -> bool:
    """Swap ``dflash_mlx.ops`` to the CPU twins (once), and prepare a loaded pair: its
    drafter's and draft head's weights are read as exact 16-bit words by the few-row kernel.

    Args:
        pair: a loaded ``DFlashModel``, or None for the ops alone.

    Returns:
        whether the backend is on.
    """
    if not enabled():
        return False
    if not _installed["ops"]:
        _install_ops()
        _installed["ops"] = True
    if pair is not None:
        from .half_weights import register_drafter

        register_drafter(pair)
    return True


def _install_ops() -> None:
    from .. import ops
    from . import draft_step, fastmath, select_host, target

    ops.use(
        softmax=fastmath.softmax,
        logsumexp=fastmath.logsumexp,
        attention=fastmath.attention,
        draft_step=draft_step.step,
        append_context=draft_step.append_context,
        host_selector=select_host.selector_for,
        prepare_target=target.compile_layers,
        describe=describe,
        backend_name=backend_name,
        backend_status=status,
    )


def describe() -> dict[str, str]:
    """``ops.describe`` with the BLAS and the kernels in use."""
    import mlx.core as mx

    from . import blas, exact_ops, small_gemm

    return {
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "blas": str(blas.loaded_path()),
        "small_gemm": str(small_gemm.status()["path"]),
        "exact_ops": str(exact_ops.status()["path"]),
    }


def backend_name() -> str:
    """``ops.backend_name``: the BLAS really in use, timed (``blas.measure``)."""
    from .blas import measure

    return measure()["name"]


def status() -> dict:
    """Each part's state, for ``dflash doctor``-style reports: the BLAS, the few-row kernel,
    the exact ops and the host selector."""
    from . import blas, exact_ops, select_host, small_gemm

    return {
        "enabled": enabled(),
        "blas": blas.loaded_path(),
        "blas_in_use": blas.in_use(),
        "small_gemm": small_gemm.status(),
        "exact_ops": exact_ops.status(),
        "host_select": select_host.enabled(),
    }
