"""Where dflash keeps what it caches on disk (a leaf module: only ``env`` of the package imported).

``DFLASH_CACHE_DIR``, else ``$XDG_CACHE_HOME/dflash-mlx``, else ``~/.cache/dflash-mlx``;
``DFLASH_CACHE=0`` turns the caches off. ``diskcache.py`` keeps the entries.
"""

from __future__ import annotations

import os
from pathlib import Path

from .. import env

ENV_DIR, ENV_OFF = "DFLASH_CACHE_DIR", "DFLASH_CACHE"


def enabled() -> bool:
    """False when ``DFLASH_CACHE=0`` (or off / false / no) turns the caches off."""
    return env.switch(ENV_OFF)


def cache_dir() -> Path:
    """The cache folder; not created here."""
    if os.environ.get(ENV_DIR):
        return Path(os.path.expanduser(os.environ[ENV_DIR]))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dflash-mlx"
