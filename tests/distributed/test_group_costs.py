"""Without a launch: ``auto``'s warm-up costs under a group are stored under a key of their
own (ranks, shard mode, backend, link; ``distributed.describe``) and read back by rank 0 at
the next launch, so no rank warms up again; every rank ends with rank 0's tables; a batch's
batch planner follows rank 0 (``policy.FollowPlans``)."""

import dataclasses

import pytest
from launch import FakeGroup

from dflash_mlx import distributed
from dflash_mlx.decoding import warmup
from dflash_mlx.decoding.schedule import CostTable, Tuning
from dflash_mlx.distributed import policy
from dflash_mlx.loading import diskcache

GROUP = {"ranks": 2, "shard": "tensor", "backend": "ring", "link": "loopback"}


class _Wire:
    """``policy.broadcast`` between a rank 0 that runs first and a rank 1 that runs after."""

    def __init__(self):
        self.sent = []

    def __call__(self, values, group, dtype=None):
        if group.rank() == 0:
            self.sent.append(list(values))
            return self.sent[-1]
        return self.sent.pop(0)


@pytest.fixture
def launches(pairs, tmp_path, monkeypatch):
    """(a rank of a fresh launch of the tiny pair, the ranks that warmed up so far): each
    rank's fake warm-up gives costs of its own, so a rank that kept its own shows."""
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("DFLASH_CACHE", raising=False)
    monkeypatch.setattr(policy, "broadcast", _Wire())
    model, _ = pairs("qwen3", "d2")
    warmed = []

    def warm_up(m):
        warmed.append(m.group.rank())
        tables = [CostTable(m.block_size) for _ in range(2)]
        for t in tables:
            t.seconds = {1: 0.010 * (1 + m.group.rank()), m.block_size: 0.015}
        m.tuning = Tuning(*tables)
        return m.tuning

    monkeypatch.setattr(warmup, "warm_up", warm_up)

    def rank(r, info=GROUP):
        return dataclasses.replace(model, tuning=None, group=FakeGroup(rank=r), group_info=info)

    return rank, warmed


def _launch(rank, info=GROUP):
    """Both ranks of one launch through ``policy.ensure``; their tables."""
    ranks = [rank(0, info), rank(1, info)]
    for m in ranks:
        policy.ensure(m, m.group)
    return [m.tuning.tables() for m in ranks]


def test_a_groups_costs_are_stored_under_its_key_and_the_next_launch_skips_the_warm_up(
    launches, monkeypatch
):
    rank, warmed = launches
    first = _launch(rank)
    assert warmed == [0, 1] and first[0] == first[1]  # rank 1 took rank 0's tables
    assert first[1]["seconds"][1] == pytest.approx(0.010)
    assert diskcache.read_costs(rank(0))["seconds"][1] == pytest.approx(0.010)
    assert _launch(rank) == first and warmed == [0, 1]  # read back: nobody warmed up
    # another group size, and the one-process pair, have tables of their own
    assert diskcache.read_costs(dataclasses.replace(rank(0), group=None, group_info=None)) is None
    _launch(rank, {**GROUP, "ranks": 3})
    assert warmed == [0, 1, 0, 1]
    # with the spot check on, every rank runs it (it runs the sharded target) and rank 0's
    # verdict stands on every rank: here a plain step far from the stored one, measured again
    monkeypatch.setenv(warmup.ENV_CHECK, "1")
    checked = []
    monkeypatch.setattr(warmup, "spot_check", lambda m: checked.append(1) or (0.1, 1.5))
    _launch(rank)
    assert checked == [1, 1] and warmed == [0, 1, 0, 1, 0, 1]


def test_the_batch_planner_of_every_rank_takes_rank_zeros_plan(monkeypatch):
    from dflash_mlx.decoding.batch_auto import Option

    monkeypatch.setattr(policy, "broadcast", _Wire())

    class Planner:
        def __init__(self, lead: bool):
            self.lead, self.recorded = lead, []

        def plan(self, rows):
            if not self.lead:
                raise AssertionError("a rank other than 0 planned for itself")
            return [Option(1 + (i + len(self.recorded)) % 3, i == 2, 0.5) for i in rows]

        def record(self, rows, opts, cycles, seconds):
            self.recorded.append(seconds)

    lead = policy.follow_plans(Planner(True), FakeGroup(rank=0))
    other = policy.follow_plans(Planner(False), FakeGroup(rank=1))
    for cycle in range(3):
        said = lead.plan([0, 1, 2])
        got = other.plan([0, 1, 2])
        assert [(o.block, o.copy) for o in got] == [(o.block, o.copy) for o in said]
        lead.record([0, 1, 2], said, [], 0.1)
        other.record([0, 1, 2], got, [], 0.2)  # its own timings still reach its planner
    assert other.planner.recorded == [0.2] * 3 and said[2].copy
    own = Planner(True)
    assert policy.follow_plans(own, None) is own  # one process: as is


def test_the_group_is_described_by_its_backend_and_link(tmp_path, monkeypatch):
    for k in (
        "MLX_HOSTFILE",
        "MLX_JACCL_COORDINATOR",
        "MLX_JACCL_RING",
        distributed.link.ENV_DELAY,
    ):
        monkeypatch.delenv(k, raising=False)
    hosts = tmp_path / "hosts.json"
    monkeypatch.setenv("MLX_HOSTFILE", str(hosts))
    hosts.write_text('[["127.0.0.1:5000"], ["127.0.0.1:5001"]]')
    assert distributed.describe(FakeGroup(3), "tensor") == dict(GROUP, ranks=3)
    hosts.write_text('[["10.0.0.1:5000"], ["10.0.0.2:5000"]]')
    monkeypatch.setenv(distributed.link.ENV_DELAY, "1")
    got = distributed.describe(FakeGroup(), "pipeline")
    assert got == dict(GROUP, shard="pipeline", link="tcp", injected_delay_ms=1.0)
    monkeypatch.setenv("MLX_JACCL_COORDINATOR", "10.0.0.1:5000")
    assert (distributed.backend(), distributed.link_kind()) == ("jaccl", "rdma")
    assert distributed.describe(None, None) is None
