"""``python -m dflash_mlx.cli``: the ``dflash`` command line."""

from .app import main

main()
