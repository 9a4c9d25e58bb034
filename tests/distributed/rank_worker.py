"""One rank of the sharded-decoding test (run by ``mlx.launch``): load the tiny pair sharded
over the launched group, decode plain (mlx-lm) and with DFlash greedily (blocks 2, 4 and
``auto``), ``dflash bench``'s methods (``auto`` among them), then the sampling law of an
8-token pair on the tensor-sharded target (``sharded_law``); write it all. For ``auto``, every rank but 0 gets a scheduler that would
always choose a plain step: the ranks stay paired only if they take rank 0's choices."""

import json
import sys
from pathlib import Path

import dflash_mlx  # noqa: F401 - before MLX: it preloads the system OpenBLAS (Linux)

# isort: split
import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: laws.py
import sharded_law

from dflash_mlx import load, stream_generate
from dflash_mlx.bench.runner import run_bench
from dflash_mlx.decoding.policy import Choice
from dflash_mlx.decoding.schedule import Scheduler

out, target, drafter = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
group = mx.distributed.init()
model, tok = load(target, drafter=drafter)
ids = tok.encode("def parse_args(argv):")
plain = [int(t) for t, _ in generate_step(mx.array(ids), model.target, max_tokens=24)]
# mlx-lm leaves its next step in flight on its own stream: let it finish, or its all_sums
# would run beside the next decode's and the ranks could pair different ones
mx.synchronize(generation_stream)
if group.rank() != 0:  # its own clock would decide otherwise: here, always plain
    Scheduler.choose = lambda self, budget=None, match=0: Choice(1)
runs = {}
for block in (2, 4, "auto"):
    got = []
    for r in stream_generate(model, tok, ids, max_tokens=24, block_size=block, temperature=0.0):
        got += r.tokens
    runs[str(block)] = got
blocks = {str(b): n for b, n in r.blocks.items()}  # auto's: steps per block size
# the bench's methods, auto's blocks rank 0's, and the group it states in its report
rep = run_bench(model, tok, ["def parse_args(argv):"], max_tokens=8, lookup=False)
auto = rep["methods"]["auto"]["blocks"]
bench = {"group": rep["group"], "parity": rep["parity"]["summary"], "auto_blocks": auto}
shards = model.target.layers[0].self_attn.n_heads  # query heads kept on this rank
(out / f"rank{group.rank()}.json").write_text(
    json.dumps(
        {
            "size": group.size(),
            "plain": plain,
            "dflash": runs,
            "heads": shards,
            "blocks": blocks,
            "bench": bench,
            "law": sharded_law.report(Path(sys.argv[4]), group, "tensor"),
        }
    )
)
