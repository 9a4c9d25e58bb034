"""Where a loaded pair gets its backend's accelerations: the Linux CPU backend's twins, or
on a Mac the few-row quantized matmul's per-shape choices stored per chip and MLX version.
The one place outside the package's ``__init__`` that reaches ``dflash_mlx.cpu``
(tests/cpu/test_seam.py guards it)."""

from __future__ import annotations

import hashlib


def install(pair=None) -> bool:
    """Install the backend's twins of ``dflash_mlx.ops`` (once) and prepare a pair for them:
    on Linux, MLX's CPU backend (``cpu.install``); on a Metal GPU, the few-row quantized
    matmul's stored choices (``qmm_choices``); elsewhere nothing, plain MLX.

    Args:
        pair: a loaded ``DFlashModel``, or None for the ops alone (call it before any target
            layer is wrapped).

    Returns:
        whether a backend is installed.
    """
    from .. import cpu
    from ..model import qmm

    if pair is not None and qmm.on_metal():
        qmm_choices()
    return cpu.install(pair)


def qmm_choices() -> None:
    """Give ``qmm_choice.CHOOSER`` the table stored for this chip and MLX version, and
    store it there as it grows (nothing when the caches are off or unwritable)."""
    import mlx.core as mx

    from ..model import qmm_choice
    from .cachedir import cache_dir, enabled, read_json, write_json
    from .diskcache import chip

    if not enabled() or qmm_choice.CHOOSER.saver is not None:
        return
    key = hashlib.sha256(f"{chip()}|{mx.__version__}".encode()).hexdigest()[:16]
    path = cache_dir() / "qmm" / f"{key}.json"
    # write_json never raises: a read-only cache only means the next process times again
    qmm_choice.CHOOSER.restore(read_json(path), lambda table: write_json(path, table))
