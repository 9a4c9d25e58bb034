"""``dflash`` on one rank (run by ``mlx.launch``) with every rank but 0 given a batch block
chooser that would always choose a plain step: under ``auto`` the ranks stay paired only if
they take rank 0's blocks (``policy.FollowBlocks``)."""

import os
import sys

import dflash_mlx  # noqa: F401 - before MLX: it preloads the system OpenBLAS (Linux)

# isort: split
from dflash_mlx.batching import BlockChooser
from dflash_mlx.cli import app

if os.environ.get("MLX_RANK", "0") != "0":  # its own clock would decide otherwise
    BlockChooser.choose = lambda self: 1
sys.argv[0] = "dflash"
app()
