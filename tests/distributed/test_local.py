"""Ranks started without ``mlx.launch`` (``distributed.local``): they form a ring on
loopback, and a failing rank ends the others."""

import sys
import time

from launch import needs_launch

from dflash_mlx.distributed.local import free_port, run_ranks

SUM = (
    "import mlx.core as mx; g = mx.distributed.init(strict=True, backend='ring'); "
    "print('rank', g.rank(), 'of', g.size(), 'sum', mx.distributed.all_sum(mx.array(g.rank() + 1)).item())"
)


@needs_launch
def test_two_ranks_form_a_ring_and_sum_across_it(tmp_path):
    res = run_ranks([sys.executable, "-c", SUM], 2, cwd=tmp_path, timeout=120)
    assert res.codes == [0, 0] and not res.timed_out, res.output
    assert res.output.splitlines() == ["rank 0 of 2 sum 3", "rank 1 of 2 sum 3"]


def test_a_failing_rank_ends_the_others_at_once(tmp_path):
    code = "import os, sys, time; sys.exit(3) if os.environ['MLX_RANK'] == '1' else time.sleep(60)"
    t = time.monotonic()
    res = run_ranks([sys.executable, "-c", code], 2, cwd=tmp_path, timeout=120)
    assert time.monotonic() - t < 30 and not res.timed_out
    assert res.codes == [None, 3] and res.returncode == 3


def test_the_deadline_ends_every_rank(tmp_path):
    res = run_ranks([sys.executable, "-c", "import time; time.sleep(60)"], 2, timeout=1)
    assert res.timed_out and res.codes == [None, None] and res.returncode == -9


def test_free_ports_are_free_and_vary():
    assert len({free_port(3) for _ in range(5)}) > 1
