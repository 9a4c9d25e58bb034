"""Decoding simulated on cost tables, no model and no timing: ``auto`` (``Tuning`` /
``Scheduler``) or a fixed block against drafts accepted at seeded rates, as the decode
loop drives a policy (a plain choice runs ``plain_run()`` plain steps). Cost curves come
from ``dflash roofline``'s predictions (a mixture of experts' steep one) or are given."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field, replace

from dflash_mlx.bench import roofline as rl
from dflash_mlx.bench import roofline_data as data
from dflash_mlx.decoding.costs import CostTable
from dflash_mlx.decoding.estimates import expected_tokens
from dflash_mlx.decoding.schedule import Tuning
from dflash_mlx.decoding.steps import Cycle

MOE, DENSE = "Qwen3.6-35B-A3B", "Qwen3.8-27B"


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


def flat(block: float = 1.1, max_block: int = 16) -> CostTable:
    """Every block costs ``block`` plain steps (a verify as cheap as a wide CPU matmul)."""
    table = CostTable(max_block)
    table.seconds = {1: 1.0} | {b: block for b in range(2, max_block + 1)}
    return table


def best_fixed(table: CostTable, rate: float) -> tuple[int, float]:
    """The fixed block (1: plain) with the highest expected speed, and that speed."""
    rates = [rate] * (table.max_block - 1)
    speeds = {
        b: expected_tokens(rates, b) / table(b) * table(1) for b in range(1, table.max_block + 1)
    }
    b = max(speeds, key=speeds.get)
    return b, speeds[b]


@dataclass
class Run:
    """What a simulated decode committed: tokens, time in plain steps, blocks chosen."""

    tokens: int = 0
    seconds: float = 0.0
    blocks: Counter = field(default_factory=Counter)

    @property
    def speed(self) -> float:
        """Tokens per plain step's time: plain decoding is 1.0."""
        return self.tokens / self.seconds


def simulate(table: CostTable, rate: float, tokens=256, requests=1, seed=0, tuning=None) -> Run:
    """``requests`` requests of ``tokens`` tokens each under ``auto`` on one loaded model
    (``tuning``: a fresh one by default, whose first request starts from the default
    prior), every draft accepted with probability ``rate`` (seeded)."""
    rng, out = random.Random(seed), Run()
    tuning = tuning or Tuning(table)
    plain = table(1)
    for _ in range(requests):
        sched = tuning.scheduler(greedy=True, selector=True)
        left = tokens
        while left > 0:
            b = sched.choose(budget=left).block
            if b == 1:
                run = min(left, sched.plain_run())
                for _ in range(run):
                    sched.record(1, Cycle([0]), None)
                out.tokens, out.seconds, left = out.tokens + run, out.seconds + run, left - run
                out.blocks[1] += run
                continue
            accepted = 0
            while accepted < b - 1 and rng.random() < rate:
                accepted += 1
            sched.record(b, Cycle([0] * (accepted + 1), accepted=accepted, drafted=b - 1), None)
            out.tokens, out.seconds = out.tokens + accepted + 1, out.seconds + table(b) / plain
            out.blocks[b] += 1
            left -= accepted + 1
        tuning.finish(sched)
    return out
