"""The load-time warm-up: what each step the ``block_size="auto"`` scheduler may choose
costs on this machine (docs/algorithm.md §7)."""

from __future__ import annotations

import statistics
import time

import mlx.core as mx

from . import decode
from .acceptance import SamplingParams
from .schedule import CostTable, Tuning
from .state import DFlashModel

WARM_ROUNDS = 3  # timings per block width at warm-up (their median stands)


def warm_up(model: DFlashModel, context: int = 48, rounds: int = WARM_ROUNDS) -> Tuning:
    """Measure what a step costs on this machine: plain (block 1), and every speculative
    block the scheduler may choose (``warm_up_blocks``; verify cost by width is not
    monotone on a CPU BLAS, so interpolating would misjudge some) both drafted and copied
    (a context-lookup draft, no drafter pass), on a throwaway cache; sets and returns
    ``model.tuning``.

    Every width is timed once per round, round after round, and its median stands: one
    timing each put block 2 anywhere from 1.1 to 2.1 plain steps on a noisy machine.

    Args:
        model: the loaded pair. context: tokens of dummy context before the timed steps.
        rounds: timings per width.
    """
    B = model.block_size
    params = SamplingParams()
    cache = model.make_cache()
    ids = [i % model.adapter.vocab_size for i in range(1, context + 1)]
    samples: dict[tuple[int, bool], list[float]] = {}
    with mx.stream(decode.generation_stream()):
        first, key = decode.prefill(model, ids, cache, params, mx.random.key(0))
        history = ids + first.tokens
        keys = (key, key)
        history += decode.cycle(model, cache, params, history, B, True, keys).tokens  # warms up
        for _ in range(max(1, rounds)):
            for b in warm_up_blocks(B):
                for copied in (None, history[-b:-1]):
                    t = time.perf_counter()
                    step = decode.cycle(model, cache, params, history, b, True, keys, copied=copied)
                    mx.eval(cache.state)
                    samples.setdefault((b, copied is not None), []).append(time.perf_counter() - t)
                    history += step.tokens
            t = None
            for i, step in enumerate(decode.plain_steps(model, cache, params, history, 5, key)):
                t = time.perf_counter() if i == 0 else t  # steps 2..5 (the pipeline is full)
                history += step.tokens
            samples.setdefault((1, False), []).append((time.perf_counter() - t) / 4)
    drafted, copied = CostTable(B), CostTable(B)
    for (b, lookup), v in samples.items():
        (copied if lookup else drafted).seconds[b] = statistics.median(v)
    copied.seconds[1] = drafted.seconds[1]
    model.tuning = Tuning(drafted, copied)
    return model.tuning


def warm_up_blocks(B: int) -> list[int]:
    """The speculative blocks ``warm_up`` times: every one up to 8, then every other one
    (the live timings refine the rest), and always the checkpoint's block B."""
    return sorted({b for b in range(2, B + 1) if b <= 8 or b % 2 == 0} | {B})
