"""The block-size scheduler's decisions (pure logic; the decode loop's use is tested with
the parity tests)."""

from itertools import pairwise

import pytest

from dflash_mlx.decoding.probe import PROBE_START
from dflash_mlx.decoding.schedule import (
    PLAIN_RUN_MAX,
    Acceptance,
    CostTable,
    Scheduler,
    expected_tokens,
)
from dflash_mlx.decoding.steps import Cycle


def costs(per_block):
    t = CostTable(len(per_block))
    for b, c in enumerate(per_block, start=1):
        t.observe(b, c)
    return t


def test_expected_tokens_counts_the_bonus_and_the_accepted_prefix():
    assert expected_tokens([1.0, 1.0, 1.0], 4) == 4.0
    assert expected_tokens([0.5, 0.5], 3) == 1 + 0.5 + 0.25
    assert expected_tokens([0.9, 0.9], 1) == 1.0


def test_cost_table_interpolates_and_extrapolates_linearly():
    t = CostTable(8)
    t.observe(1, 1.0)
    t.observe(4, 2.5)
    assert abs(t(2) - 1.5) < 1e-9
    assert abs(t(8) - 4.5) < 1e-9  # extrapolated from 1 and 4
    t.observe(4, 3.5)  # an EMA, not a replacement
    assert 2.5 < t(4) < 3.5


def test_reference_blas_costs_mean_plain_decoding_and_no_probes():
    # Verifying b tokens costs b plain steps: even perfect acceptance cannot win.
    sched = Scheduler(costs([1.0] + [b * 1.0 + 0.3 for b in range(2, 9)]), [0.95] * 7)
    picks = []
    for _ in range(200):
        c = sched.choose()
        picks.append(c.block)
        sched.record(c.block, Cycle([], accepted=0), None)
    assert set(picks) == {1}
    assert "no block beats plain" in sched.last_reason


def test_refused_probes_keep_plain_runs_long():
    # Runs of one step would lose the pipelining (each run's first step waits for its graph).
    sched = Scheduler(costs([1.0] + [b * 1.0 + 0.3 for b in range(2, 9)]), [0.95] * 7)
    assert sched.plain_run() == PROBE_START  # up to the first probe point
    for _ in range(3 * PLAIN_RUN_MAX):
        c = sched.choose()
        assert c.block == 1 and not c.probe
        sched.record(1, Cycle([], accepted=0), None)
        assert sched.plain_run() == PLAIN_RUN_MAX or sched.probes.since < PROBE_START


def test_flat_costs_and_high_acceptance_choose_the_largest_block():
    sched = Scheduler(costs([1.0] + [1.3 + 0.05 * b for b in range(2, 9)]), [0.9] * 7)
    assert sched.choose().block == 8


def test_low_acceptance_chooses_a_short_block():
    sched = Scheduler(costs([1.0] + [1.2 + 0.1 * b for b in range(2, 9)]), [0.55, 0.2] + [0.1] * 5)
    b = sched.choose().block
    assert 2 <= b <= 3


def test_live_acceptance_overrides_an_optimistic_prior():
    sched = Scheduler(costs([1.0] + [1.2 + 0.1 * b for b in range(2, 9)]), [0.9] * 7)
    assert sched.choose().block == 8
    for _ in range(60):  # every draft rejected
        c = sched.choose()
        sched.record(c.block, Cycle([], accepted=0), None)
        if c.block == 1:
            break
    assert sched.choose().block == 1


def test_plain_decoding_reprobes_with_doubling_backoff():
    # Plainly better on the estimate, but an optimistic estimate says block 2 might win.
    sched = Scheduler(costs([1.0] + [1.2 + 0.1 * b for b in range(2, 9)]), [0.3] * 7)
    probes = []
    for step in range(200):
        c = sched.choose()
        if c.probe:
            probes.append(step)
        sched.record(c.block, Cycle([], accepted=0), None)
    assert probes, "a plain run must be re-probed while speculation might still win"
    gaps = [b - a for a, b in pairwise(probes)]
    assert probes[0] >= PROBE_START
    assert all(g2 >= g1 for g1, g2 in pairwise(gaps))


def test_acceptance_counts_only_reached_positions():
    acc = Acceptance([0.5] * 4)
    acc.update(drafted=4, accepted=2)  # positions 0, 1 accepted, 2 rejected, 3 unreached
    assert acc.seen[:4] == [1.0, 1.0, 1.0, 0.0]
    assert acc.hits[:3] == [1.0, 1.0, 0.0]
    r = acc.rates()
    assert r[0] > 0.5 and r[2] < 0.5 and r[3] == 0.5


def test_budget_caps_the_block():
    sched = Scheduler(costs([1.0] + [1.3] * 7), [0.95] * 7)
    assert sched.choose(budget=3).block <= 3


def test_summary_reports_histogram_and_plain_share():
    sched = Scheduler(costs([1.0] * 8), [0.5] * 7)
    for b in (1, 1, 4, 8):
        sched.record(b, Cycle([], accepted=1), 0.01)
    s = sched.summary()
    assert s["blocks"] == {1: 2, 4: 1, 8: 1}
    assert s["plain_share"] == 0.5


def test_probe_backoff_carries_across_requests_on_the_same_model():
    from dflash_mlx.decoding.schedule import Tuning

    tuning = Tuning(costs([1.0] + [1.2 + 0.1 * b for b in range(2, 9)]))
    tuning.priors[("greedy", True, 0)] = [0.3] * 7
    probes = []
    for request in range(6):  # six short requests of 20 steps each
        sched = tuning.scheduler(greedy=True, selector=True)
        for step in range(20):
            c = sched.choose()
            probes += [request * 20 + step] if c.probe else []
            sched.record(c.block, Cycle([], accepted=0), None)
        tuning.finish(sched)
    # with a fresh backoff per request each one would probe at step 8 (six probes)
    assert 1 <= len(probes) <= 3
    gaps = [b - a for a, b in pairwise(probes)]
    assert all(g >= 2 * PROBE_START for g in gaps)
    # a seeded request keeps the frozen, default schedule
    seeded = tuning.scheduler(greedy=False, selector=True, seeded=True)
    assert seeded.probes.state() == (PROBE_START, 0, 0.0)  # and no credit


def test_a_plain_steps_drift_moves_every_blocks_cost_alike():
    """The machine's speed drifts; a block's cost stays the same ratio to a plain step."""
    table = CostTable(8)
    table.seconds = {1: 1.0, 4: 1.5, 8: 2.0}
    scale = table.observe(1, 2.0)  # plain steps got slower: 1.0 -> 1.25 (EMA)
    assert scale == pytest.approx(1.25)
    assert table(4) / table(1) == pytest.approx(1.5) and table(8) / table(1) == pytest.approx(2.0)
    assert table.observe(4, 1.5) == 1.0  # a block's own timing moves only itself
    assert table(8) / table(1) == pytest.approx(2.0)


def test_a_plain_cost_observation_rescales_the_copied_blocks_too():
    drafted, copied = CostTable(8), CostTable(8)
    drafted.seconds, copied.seconds = {1: 1.0, 8: 1.6}, {1: 1.0, 8: 1.3}
    sched = Scheduler(drafted, [0.5] * 7, lookup_costs=copied)
    sched.observe(1, 0.6)  # faster: 1.0 -> 0.9
    assert copied(8) == pytest.approx(1.3 * 0.9) and drafted(8) == pytest.approx(1.6 * 0.9)
    frozen = Scheduler(drafted, [0.5] * 7, frozen=True)
    frozen.observe(1, 5.0)
    assert drafted(1) == pytest.approx(0.9)


def test_speculating_it_tries_deeper_blocks_until_their_positions_are_seen():
    """Once speculation pays, the block is chosen with the benefit of the doubt: a deeper
    block whose positions no cycle has reached is tried, and dropped once they are seen to
    fail (a shallow choice alone would never learn them)."""
    table = CostTable(8)
    table.seconds = {1: 1.0} | {b: 1.2 + 0.02 * b for b in range(2, 9)}
    sched = Scheduler(table, [0.6] + [0.3] * 6, frozen=True)
    point = sched._best(sched.acc.rates(), 8)[0]
    first = sched.choose()
    assert first.block > point
    for _ in range(200):  # every cycle: the first draft accepted, the second never
        sched.record(8, Cycle([], accepted=1), None)
    assert sched.choose().block <= 3
