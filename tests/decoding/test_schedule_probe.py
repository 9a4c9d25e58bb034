"""``auto``'s probes (``decoding/probe.py``), simulated on cost tables with seeded acceptance
(no model, no timing): a fresh model, whose first request starts from a guessed prior, learns
what its drafter accepts and then speculates where blocks pay, even on a mixture of experts
whose block 2 already costs 1.6-1.9 plain steps; a drafter that never pays costs at most
``LOSS`` of plain decoding's time."""

import random
from itertools import pairwise

import pytest
from schedule_sim import DENSE, MOE, best_fixed, flat, predicted, simulate

from dflash_mlx.decoding.estimates import Acceptance
from dflash_mlx.decoding.probe import LOSS, PROBE_START, Probes
from dflash_mlx.decoding.schedule import Tuning
from dflash_mlx.decoding.steps import Cycle

CURVES = {
    "moe_grouped": lambda: predicted(MOE, "few_row"),  # block 2: 1.58 plain steps
    "moe_mlx": lambda: predicted(MOE, "mlx_qmm"),  # block 2: 1.89, block 16: 7.2
    "dense": lambda: predicted(DENSE, "few_row"),
    "flat": flat,
}


@pytest.mark.parametrize("curve", CURVES)
def test_a_fresh_model_learns_a_good_drafter_and_nears_the_best_fixed_block(curve):
    table = CURVES[curve]()
    _, best = best_fixed(table, 0.9)
    speeds = [simulate(table, 0.9, tokens=128, requests=8, seed=s).speed for s in range(3)]
    assert sum(speeds) / 3 >= 0.85 * best, (speeds, best)  # 0.91-0.94 of it


def test_the_first_request_on_a_fresh_moe_model_already_speculates():
    """Before probes were funded by an account, a prior of 0.25 never cleared the margin on
    a MoE curve: auto stayed plain (1.00x) whatever the drafter accepted."""
    table = CURVES["moe_grouped"]()
    run = simulate(table, 0.9, tokens=256, seed=0)
    assert run.speed > 1.4 and sum(n for b, n in run.blocks.items() if b > 1) > 20


@pytest.mark.parametrize("curve", CURVES)
@pytest.mark.parametrize("tokens,requests", [(64, 1), (256, 1), (128, 6)])
def test_a_drafter_that_never_pays_costs_at_most_the_probe_bound(curve, tokens, requests):
    table = CURVES[curve]()
    run = simulate(table, 0.0, tokens=tokens, requests=requests)
    assert run.speed >= 1 / (1 + LOSS)
    assert any(b > 1 for b in run.blocks)  # it did probe: the bound is what it spent


def test_where_no_block_pays_probing_stays_within_the_bound():
    table = CURVES["moe_mlx"]()  # at 0.3 and 0.6 acceptance plain decoding is best
    for rate in (0.3, 0.6):
        assert best_fixed(table, rate)[0] == 1
        for seed in range(3):
            assert simulate(table, rate, tokens=256, seed=seed).speed >= 1 / (1 + LOSS)


def test_probes_never_spend_more_than_the_account_holds():
    """Every probe commits only the target's own token (its worst case): what they lose
    stays within LOSS of a plain step per token committed, whatever the candidates."""
    rng, probes, tokens, lost = random.Random(0), Probes(), 0, 0.0
    for _ in range(3000):
        width = {(b, 0): 2.0 for b in range(2, 17) if rng.random() < 0.5}
        dear = rng.choice([1.1, 1.6, 3.0, 7.0])
        cost = lambda b, dear=dear: 1.0 + (dear - 1.0) * b / 16
        c = probes.choose(width or {(2, 0): 2.0}, cost, (2, 0.5), 1.05)
        if c.probe:
            lost += cost(c.block) - 1.0
        probes.committed(1, c.probe)
        tokens += 1
        assert probes.balance >= 0
    assert 0 < lost <= LOSS * tokens


def test_losing_probes_back_off_where_no_block_is_expected_to_pay():
    tuning, at = Tuning(flat()), []
    sched = tuning.scheduler(greedy=True, selector=True)
    for step in range(600):
        c = sched.choose()
        at += [step] if c.probe else []
        sched.record(c.block, Cycle([0]), None)  # nothing is ever accepted
    gaps = [b - a for a, b in pairwise(at)]
    assert gaps[-1] >= 8 * PROBE_START and len(at) < 20, at


def test_a_request_that_never_probed_passes_on_no_evidence():
    """Its posterior is still the guess, and the next request must not hold it as learnt
    (it would never probe a MoE then)."""
    tuning = Tuning(CURVES["moe_mlx"]())
    sched = tuning.scheduler(greedy=True, selector=True)
    for _ in range(5):
        assert sched.choose().block == 1
        sched.record(1, Cycle([0]), None)
    tuning.finish(sched)
    nxt = tuning.scheduler(greedy=True, selector=True)
    assert nxt.acc.upper() == [1.0] * 15 and nxt.probes.balance == pytest.approx(5 * LOSS)


def test_a_guessed_prior_gives_way_to_a_few_observations_and_a_learnt_one_does_not():
    guess = Acceptance([0.25] * 3, evidence=[0.0] * 3)
    learnt = Acceptance([0.25] * 3)
    for acc in (guess, learnt):
        for _ in range(4):
            acc.update(drafted=3, accepted=3)
    assert guess.rates()[0] > 0.7 and learnt.rates()[0] < 0.55  # 0.74 and 0.50
    fresh = Acceptance([0.25] * 3, evidence=[0.0] * 3)
    fresh.update(drafted=3, accepted=1)  # position 1 accepted, 2 missed, 3 unreached
    assert fresh.upper()[2] == 1.0 and fresh.upper()[1] < 0.65 < fresh.upper()[0]
