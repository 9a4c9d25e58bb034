"""``dflash`` on one rank (run by ``mlx.launch``) with every rank but 0 given a batch planner
that would draft every row at block 2 each cycle: under ``auto`` the ranks stay paired only if
they take rank 0's plans (``policy.FollowPlans``), which step plain where the tiny random
drafter does not pay."""

import os
import sys

import dflash_mlx  # noqa: F401 - before MLX: it preloads the system OpenBLAS (Linux)

# isort: split
from dflash_mlx.cli import app
from dflash_mlx.decoding.batch_auto import BatchPlanner, Option

if os.environ.get("MLX_RANK", "0") != "0":  # its own clock would decide otherwise
    BatchPlanner.plan = lambda self, rows: [Option(2, False, 0.0) for _ in rows]
sys.argv[0] = "dflash"
app()
