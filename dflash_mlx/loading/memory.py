"""A memory plan before loading: what a pair will need at its peak, against what the
machine can give, so an oversized pair is refused before any download or load.

Every figure here is an estimate, read from file headers and ``config.json`` (no weight is
read). Only the standard library at import; MLX is imported inside the functions that need it.
"""

from __future__ import annotations

import os
import platform

GB = 1e9


def _metal_budget() -> int | None:
    """MLX's recommended working set on a Mac (Metal), or None off Metal."""
    if platform.system() != "Darwin":
        return None
    try:
        import mlx.core as mx

        if not mx.metal.is_available():
            return None
        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        size = int(info.get("max_recommended_working_set_size", 0))
    except (ImportError, AttributeError, RuntimeError, TypeError, ValueError):
        return None
    return size or None


def _meminfo_available(path: str = "/proc/meminfo") -> int | None:
    """MemAvailable from /proc/meminfo (Linux), in bytes, or None."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _physical_memory() -> int | None:
    """Total physical memory by sysconf, or None."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def device_budget(max_memory_gb: float | None = None) -> tuple[int, str]:
    """The bytes a pair may use on this machine, and where that number came from.

    Args:
        max_memory_gb: ``--max-memory`` in GB (10**9 bytes); when given it is the budget.

    Returns:
        (bytes, description): e.g. ``(22906503168, "Metal's recommended working set")``;
        ``(0, "unknown")`` when nothing can be measured.
    """
    if max_memory_gb is not None:
        return int(max_memory_gb * GB), f"--max-memory {max_memory_gb:g} GB"
    size = _metal_budget()
    if size:
        return size, "Metal's recommended working set (mx.device_info)"
    size = _meminfo_available()
    if size:
        return size, "MemAvailable in /proc/meminfo"
    size = _physical_memory()
    if size:
        return size, "physical memory (sysconf)"
    return 0, "unknown"
