"""The ``dflash`` command line (``dflash_mlx.cli:app``); one module per command."""

from .app import app, main

__all__ = ["app", "main"]
