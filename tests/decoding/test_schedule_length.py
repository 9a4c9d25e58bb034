"""``auto`` at long context: costs kept per context band and measured there (a band's
blocks, then a plain run, each replacing the copied costs), and an acceptance prior from a
shorter context held lightly, so a drop shows within a few cycles."""

from __future__ import annotations

import pytest

from dflash_mlx.decoding.costs import (
    LONG_CONTEXT,
    SHORT_CONTEXT,
    Bands,
    CostTable,
    band,
    band_context,
)
from dflash_mlx.decoding.estimates import BORROWED_WEIGHT, PRIOR_WEIGHT
from dflash_mlx.decoding.schedule import CALIBRATE_RUN, Tuning
from dflash_mlx.decoding.steps import Cycle


def cheap_blocks() -> Tuning:
    """A pair whose blocks cost little more than a plain step at the warm-up's context."""
    t = CostTable(8)
    t.seconds = {1: 1.0, **{b: 1.2 + 0.05 * b for b in range(2, 9)}}
    tuning = Tuning(t)
    tuning.priors[("greedy", True, 0)] = [0.7] * 7
    return tuning


def test_context_bands_double_from_1024_tokens():
    got = [band(n) for n in (0, 48, 1023, 1024, 2047, 2048, 3500, 4096, 7000, 8192)]
    assert got == [0, 0, 0, 1, 1, 2, 2, 3, 3, 4]


def test_a_new_band_starts_from_the_band_below_and_its_first_timings_replace_the_copy():
    bands = Bands(cheap_blocks().measured)
    long = bands.at(3)
    assert long.seconds == bands.at(0).seconds and long.fresh == {"plain", "block"}
    long.observe(8, 3.0)  # block 8 now costs 3 s: replaced (no EMA), other widths alike
    assert long.seconds[8] == 3.0 and long.seconds[4] == pytest.approx(1.4 * 3.0 / 1.6)
    long.observe(1, 2.0)  # the plain step: replaced; the blocks, timed here, stay
    assert long.seconds[1] == 2.0 and long.seconds[8] == 3.0 and long.fresh == set()
    long.observe(1, 2.4)  # from now on a plain step's move is drift: blocks move alike
    assert long.seconds[8] == pytest.approx(3.0 * (0.75 * 2.0 + 0.25 * 2.4) / 2.0)
    plain_first = Bands(cheap_blocks().measured).at(2)
    plain_first.observe(1, 2.0)  # no block timed here yet: they follow the plain step
    assert plain_first.seconds[8] == pytest.approx(3.2) and plain_first.fresh == {"block"}
    assert bands.at(0).seconds[8] == 1.6  # the short context's table is untouched


def test_a_long_request_times_a_plain_run_after_its_first_blocks_then_weighs_both():
    tuning = cheap_blocks()
    sched = tuning.scheduler(greedy=True, selector=True, context=7000)
    first = sched.choose()
    assert first.block > 1  # the short context's costs say speculation pays
    sched.record(first.block, Cycle([5] * 3, accepted=2), 4.0)  # a block is dear out here
    calibrate = sched.choose()
    assert calibrate.block == 1 and "timing a plain step at 7003 tokens" in calibrate.reason
    assert sched.plain_run() == CALIBRATE_RUN
    for _ in range(CALIBRATE_RUN):
        sched.record(1, Cycle([5]), None)
    sched.observe(1, 1.2)  # the run's cost per step
    # measured here, a block costs 3.3 plain steps: at 70% acceptance no block pays (a
    # probe may still run: the optimistic estimate gets its benefit of the doubt)
    nxt = sched.choose()
    assert (nxt.block == 1 or nxt.probe) and sched.costs.seconds[first.block] == 4.0
    tuning.finish(sched)
    assert tuning.costs["greedy"].tables[3].seconds[1] == 1.2
    again = tuning.scheduler(greedy=True, selector=True, context=6000)
    assert again.costs is tuning.costs["greedy"].tables[3] and again.costs.fresh == set()
    short = tuning.scheduler(greedy=True, selector=True, context=100)
    assert short.choose().block > 1  # the short context keeps its own costs


def test_the_band_changes_when_a_request_grows_past_its_edge():
    tuning = cheap_blocks()
    sched = tuning.scheduler(greedy=True, selector=True, context=1000)
    assert sched.band == 0
    sched.record(4, Cycle([5] * 30, accepted=3), 1.5)
    assert sched.band == 1 and sched.costs is tuning.costs["greedy"].tables[1]


def test_a_prior_from_a_shorter_context_is_held_lightly():
    tuning = cheap_blocks()
    near = tuning.scheduler(greedy=True, selector=True, context=100)
    far = tuning.scheduler(greedy=True, selector=True, context=7000)
    assert near.acc.weight == PRIOR_WEIGHT and far.acc.weight == BORROWED_WEIGHT
    for sched in (near, far):
        for _ in range(3):  # the drafter's first draft fails three times
            sched.record(8, Cycle([5], accepted=0), None)
    assert far.acc.rates()[0] < 0.4 and near.acc.rates()[0] > 0.5  # 0.35 and 0.51 from 0.7
    tuning.finish(far)
    assert tuning.priors["greedy", True, 3] == far.posterior()  # its band's own, from now
    assert tuning.scheduler(True, True, context=5000).acc.weight == PRIOR_WEIGHT


def test_lookup_acceptance_learnt_at_a_shorter_context_is_held_lightly():
    """Copies that paid in a 3,500-token prompt say little about a 7,000-token one: a band
    without its own lookup prior borrows the nearest shorter band's at BORROWED_WEIGHT, so a
    few failed copies show, and keeps its own once it has one."""
    t = CostTable(8)
    t.seconds = {1: 1.0, **{b: 1.2 for b in range(2, 9)}}
    tuning = Tuning(t, measured_lookup=t.copy())
    learnt = tuning.scheduler(True, True, lookup=True, context=3500)
    assert all(a.weight == PRIOR_WEIGHT for a in learnt.lookup_acc.values())  # the default's
    for c in learnt.lookup_acc:
        learnt.lookup_acc[c].prior = [0.8] * 7  # copies paid here
    tuning.finish(learnt)
    far = tuning.scheduler(True, True, lookup=True, context=7000)
    same = tuning.scheduler(True, True, lookup=True, context=3000)
    short = tuning.scheduler(True, True, lookup=True, context=100)
    assert all(a.weight == BORROWED_WEIGHT for a in far.lookup_acc.values())
    assert all(a.weight == PRIOR_WEIGHT for a in same.lookup_acc.values())
    assert [a.rates()[0] for a in far.lookup_acc.values()] == pytest.approx([0.8] * 3)
    assert [a.rates() for a in short.lookup_acc.values()] != [
        a.rates() for a in far.lookup_acc.values()
    ]
    for sched in (far, same):
        for _ in range(3):  # three copies of a 4-token match fail at once
            sched.record(8, Cycle([5], accepted=0, lookup=4), None)
    c = max(far.lookup_acc)
    assert far.lookup_acc[c].rates()[0] < 0.45 and same.lookup_acc[c].rates()[0] > 0.55  # .40 .59
    tuning.finish(far)
    assert (
        tuning.scheduler(True, True, lookup=True, context=5000).lookup_acc[c].weight == PRIOR_WEIGHT
    )


def test_auto_across_a_band_edge_decodes_the_greedy_reference(pairs):
    from references import reference

    from dflash_mlx.decoding.acceptance import SamplingParams
    from dflash_mlx.decoding.loop import DecodeOptions, decode

    model, _ = pairs("qwen3", "d2")
    t = CostTable(model.block_size)
    t.seconds = {1: 1.0, **{b: 1.1 for b in range(2, model.block_size + 1)}}
    ids = [(7 * i) % 200 + 3 for i in range(1010)]  # crosses 1024 while decoding
    sched = Tuning(t, t.copy()).scheduler(True, True, lookup=True, context=len(ids))
    out = []
    opts = DecodeOptions(max_tokens=40, policy=sched)
    for c in decode(model, ids, model.make_cache(), SamplingParams(), opts):
        out += c.tokens
    assert sched.band == 1 and sum(sched.history.values()) + sum(sched.lookup_history.values())
    assert out[:40] == reference(model, ids, 40)


def grows_fast() -> CostTable:
    """The warm-up's long-context table of ``cheap_blocks``: at 2,048 tokens a plain step
    costs 1.5x, a block 2 to 6 plain steps more (a verify's attention reads b rows)."""
    t = CostTable(8)
    t.seconds = {1: 1.5, 2: 3.3, 4: 5.4, 8: 9.6}
    return t


def test_a_new_band_starts_from_costs_grown_as_the_warm_up_timed_them_at_long_context():
    short = cheap_blocks().measured
    bands = Bands(short, grows_fast())
    mid = bands.at(2)  # 2k-4k: predicted at 3,072 tokens, linear through 48 and 2,048
    x = (band_context(2) - SHORT_CONTEXT) / (LONG_CONTEXT - SHORT_CONTEXT)
    assert mid.seconds[1] == pytest.approx(1.0 + 0.5 * x)
    assert mid.seconds[8] == pytest.approx(1.6 + 8.0 * x)
    assert mid.seconds[3] == pytest.approx(1.35 + (4.35 - 1.35) * x)  # long width interpolated
    assert mid.fresh == {"plain", "block"}  # predicted, not measured: the first timing replaces
    mid.observe(8, 10.0)  # measured dearer still; the next band grows from what band 2 has
    far = bands.at(3)
    y = (band_context(3) - SHORT_CONTEXT) / (LONG_CONTEXT - SHORT_CONTEXT)
    assert far.seconds[8] == pytest.approx(10.0 * (1.6 + 8.0 * y) / (1.6 + 8.0 * x))
    assert bands.at(0).seconds == short.seconds  # the warm-up's band is as measured
    bumpy = CostTable(8)  # width 6 dearer than 5 and 7 at 48 tokens (a CPU BLAS's bump)
    bumpy.seconds = {**short.seconds, 6: 1.7}
    far = Bands(bumpy, grows_fast()).at(4)  # growth is interpolated, the bump carried
    middle = (far.seconds[5] + far.seconds[7]) / 2
    assert far.seconds[6] - middle == pytest.approx(1.7 - (1.45 + 1.55) / 2)  # 0.2, as at 48
    cheaper = CostTable(8)  # noise put a long timing under the short one: never shrinks
    cheaper.seconds = {1: 0.9, **{b: 1.0 for b in range(2, 9)}}
    assert Bands(short, cheaper).at(3).seconds == short.seconds


def test_a_long_prompts_first_choice_weighs_costs_the_long_warm_up_predicts():
    """At 7,000 tokens a block the short context's costs call a win is not tried when the
    warm-up's long-context timing says verifies grow too fast; without it, it is."""
    copied = cheap_blocks().scheduler(greedy=True, selector=True, context=7000).choose()
    assert copied.block > 1
    tuning = cheap_blocks()
    tuning.long = (grows_fast(), None)
    grown = tuning.scheduler(greedy=True, selector=True, context=7000).choose()
    assert grown.block == 1 and not grown.probe, grown.reason
    short = tuning.scheduler(greedy=True, selector=True, context=300).choose()
    assert short.block > 1  # the warm-up's own band is unchanged


def test_stored_costs_keep_the_long_context_tables():
    tuning = cheap_blocks()
    tuning.measured_lookup, tuning.long = tuning.measured.copy(), (grows_fast(), grows_fast())
    tables = tuning.tables()
    assert sorted(tables) == ["long_lookup_seconds", "long_seconds", "lookup_seconds", "seconds"]
    back = Tuning.from_seconds(8, tables)
    assert [t.seconds for t in back.long] == [grows_fast().seconds] * 2
    short_only = {k: tables[k] for k in ("seconds", "lookup_seconds")}
    assert Tuning.from_seconds(8, short_only).long is None  # a band then starts as a copy
