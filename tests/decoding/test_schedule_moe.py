"""``auto`` on a steep verify: given what a verify costs per width (the warm-up's table,
here the one ``dflash roofline`` predicts; no timing), a mixture of experts, whose verify
reads more experts with every row, gets small blocks or plain decoding, and a flat curve
wide blocks; the trial of unseen deep positions stays cheap on either."""

import random
from collections import Counter
from dataclasses import replace

import pytest

from dflash_mlx.bench import roofline as rl
from dflash_mlx.bench import roofline_data as data
from dflash_mlx.decoding.schedule import CostTable, Scheduler, expected_tokens
from dflash_mlx.decoding.steps import Cycle
from dflash_mlx.decoding.warmup import warm_up_blocks


def predicted(alias: str, column: str, chip: str = "M4 Pro") -> CostTable:
    """Seconds per cycle by width 1..16 as ``dflash roofline`` predicts them (1: plain)."""
    arch, bandwidth = data.ARCHS[alias], data.chip(chip)[1]
    inp = rl.Inputs(arch["target"], arch["drafter"], block=16)
    table = CostTable(16)
    table.seconds[1] = rl.estimate(inp).plain / (bandwidth * 1e9)
    for b in range(2, 17):
        at = replace(inp, block=b)
        table.seconds[b] = rl.compute(rl.estimate(at), at, chip, bandwidth)[column]["cycle_seconds"]
    return table


def flat() -> CostTable:
    table = CostTable(16)
    table.seconds = {1: 1.0} | {b: 1.1 for b in range(2, 17)}
    return table


MOE, DENSE = "Qwen3.6-35B-A3B", "Qwen3.8-27B"


def test_the_warm_up_times_every_width_where_a_steep_curve_has_its_best():
    assert set(range(2, 9)) | {16} <= set(warm_up_blocks(16))


@pytest.mark.parametrize(
    "costs,rate,lo,hi",
    [
        ((MOE, "few_row"), 0.7, 3, 6),  # the grouped verify: small blocks pay
        ((MOE, "mlx_qmm"), 0.8, 1, 1),  # MLX's SwitchGLU re-reads: nothing pays
        ((DENSE, "few_row"), 0.7, 8, 12),  # the dense 27B with the few-row kernel: wide
        (None, 0.6, 16, 16),  # a flat curve: the widest
    ],
)
def test_auto_chooses_small_blocks_or_plain_on_a_moe_curve_and_wide_on_a_flat_one(
    costs, rate, lo, hi
):
    table = flat() if costs is None else predicted(*costs)
    assert lo <= Scheduler(table, [rate] * 15).choose().block <= hi


def run(table: CostTable, rate: float, cycles: int = 300, seed: int = 0):
    """Decode ``cycles`` choices with drafts accepted at ``rate`` a position (seeded):
    the blocks chosen in the second half, and tokens per plain step's time."""
    rng, sched = random.Random(seed), Scheduler(table, [rate] * 15)
    late, tokens, seconds = Counter(), 0, 0.0
    for i in range(cycles):
        b = sched.choose().block
        accepted = 0
        while accepted < b - 1 and rng.random() < rate:
            accepted += 1
        sched.record(b, Cycle([0] * (accepted + 1), accepted=accepted), None)
        late[b] += i >= cycles // 2
        tokens, seconds = tokens + accepted + 1, seconds + table(b)
    return late, tokens / seconds * table(1)


def test_trying_unseen_deep_positions_stays_near_the_best_block_on_a_steep_curve():
    table, rate = predicted(MOE, "mlx_qmm"), 0.9
    late, speed = run(table, rate)
    best = max(expected_tokens([rate] * 15, b) / table(b) * table(1) for b in range(2, 17))
    assert late.most_common(1)[0][0] <= 12 and late[16] < 15  # not the checkpoint's 16
    assert speed > 0.9 * best
    wide, _ = run(flat(), rate)
    assert wide.most_common(1)[0][0] == 16
