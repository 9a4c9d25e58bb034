"""One rank of a ``dflash`` launch whose ranks are given other model paths (run by
``mlx.launch``): ``python cli_rank.py A B -- ARGS`` runs ``dflash ARGS --model A`` on rank 0
and ``dflash ARGS --model B`` on the others, as if each machine kept its model elsewhere."""

import os
import sys

import dflash_mlx  # noqa: F401 - before MLX: it preloads the system OpenBLAS (Linux)
from dflash_mlx.cli.app import main

first, other, args = sys.argv[1], sys.argv[2], sys.argv[4:]
model = first if os.environ.get("MLX_RANK", "0") == "0" else other
main([*args, "--model", model])
