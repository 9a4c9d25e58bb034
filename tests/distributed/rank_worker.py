"""One rank of the sharded-decoding test (run by ``mlx.launch``): load the tiny pair sharded
over the launched group, decode plain (mlx-lm) and with DFlash greedily (blocks 2, 4 and
``auto``), ``dflash bench``'s methods (``auto`` among them), then the sampling law of an
8-token pair on the tensor-sharded target (``sharded_law``), then 8-bit KV caches as
``dflash serve --kv-bits 8`` decodes them across ranks (rank 0 leads a one-row batch, rank 1
replays it: ``distributed.follow``) against mlx-lm's quantized cache on the same sharded
target (a pair of head width 32); write it all. For ``auto``, every rank but 0 gets a
scheduler that would always choose a plain step: the ranks stay paired only if they take
rank 0's choices."""

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


class Recorded:
    """A batch generator whose steps' tokens are kept (rank 1's replay discards them)."""

    def __init__(self, gen):
        self.gen, self.tokens = gen, []

    def __getattr__(self, name):
        return getattr(self.gen, name)

    def __len__(self):
        return len(self.gen)

    def step(self):
        got = self.gen.step()
        self.tokens += [t for _, r in got for t in r.tokens]
        return got


def served_kv8(target, drafter) -> dict:
    """(mlx-lm's greedy tokens, ours as the server's engine decodes them) with 8-bit KV."""
    from dflash_mlx.distributed import follow
    from dflash_mlx.server.prompt_cache import PromptPool
    from dflash_mlx.server.worker import batch_generator
    from dflash_mlx.settings import GenerationConfig

    model, tok = load(target, drafter=drafter)
    ids = tok.encode("def parse_args(argv):")
    kv = {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 0}
    plain = [int(t) for t, _ in generate_step(mx.array(ids), model.target, max_tokens=16, **kv)]
    mx.synchronize(generation_stream)
    channel, pool = follow.Channel(group), PromptPool(model, 10**9)
    gen = Recorded(batch_generator(model, tok, 1))  # what --max-batch 1 builds on every rank
    if group.rank() != 0:
        follow.follow_batches(channel, pool, lambda: gen)
        return {"plain": plain, "served": gen.tokens}
    lead = follow.Lead(channel)
    batch, pool = lead.batch(gen), lead.pool(pool)
    cache = pool.take(ids)
    batch.insert(ids, GenerationConfig(max_tokens=16, temperature=0.0, block_size=4, **kv),
                 cache=cache)  # fmt: skip
    while len(gen):
        batch.step()
    pool.give(cache)
    lead.quit()
    return {"plain": plain, "served": gen.tokens}


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
            "kv8": served_kv8(sys.argv[5], sys.argv[6]),
        }
    )
)
