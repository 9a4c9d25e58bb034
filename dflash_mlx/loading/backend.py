"""Where a loaded pair gets its backend's accelerations: the one place outside the package's
``__init__`` that reaches ``dflash_mlx.cpu`` (tests/cpu/test_seam.py guards it)."""

from __future__ import annotations


def install(pair=None) -> bool:
    """Install the backend's twins of ``dflash_mlx.ops`` (once) and prepare a pair for them:
    on Linux, MLX's CPU backend (``cpu.install``); elsewhere nothing, plain MLX.

    Args:
        pair: a loaded ``DFlashModel``, or None for the ops alone (call it before any target
            layer is wrapped).

    Returns:
        whether a backend is installed.
    """
    from .. import cpu

    return cpu.install(pair)
