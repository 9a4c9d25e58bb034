"""``python -m dflash_mlx.server ARGS`` is exactly ``dflash serve ARGS``."""

import sys

from ..cli.app import main

main(["serve", *sys.argv[1:]])
