"""On/off switches read from the environment (a leaf module: nothing of the package imported).

Every ``DFLASH_*`` switch is read here the same way: unset means its default, and ``0``,
``off``, ``false`` or ``no`` (any case, spaces ignored) turn it off.
"""

from __future__ import annotations

import os

OFF = ("0", "off", "false", "no")


def switch(name: str, default: bool = True) -> bool:
    """Whether the switch ``name`` is on.

    Args:
        name: the environment variable, e.g. ``DFLASH_SMALL_GEMM``.
        default: its value when unset or empty.
    """
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    return value not in OFF
