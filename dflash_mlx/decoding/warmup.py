"""The load-time warm-up: what each step the ``block_size="auto"`` scheduler may choose
costs on this machine (docs/algorithm.md §7)."""

from __future__ import annotations

import statistics
import time

import mlx.core as mx

from . import steps
from .acceptance import SamplingParams
from .policy import Choice
from .schedule import CostTable, Tuning
from .state import DFlashModel

WARM_ROUNDS = 3  # timings per block width at warm-up (their median stands)
PLAIN_RUN = 8  # plain steps per timed run


def warm_up(model: DFlashModel, context: int = 48, rounds: int = WARM_ROUNDS) -> Tuning:
    """Measure what a step costs on this machine: plain (block 1), and every speculative
    block the scheduler may choose (``warm_up_blocks``; verify cost by width is not
    monotone on a CPU BLAS, so interpolating would misjudge some) both drafted and copied
    (a context-lookup draft, no drafter pass), on a throwaway cache; sets and returns
    ``model.tuning``.

    Each round times the drafted widths back to back, then plain steps, then the copied
    widths, then plain steps again. A cycle's cost is kept as a ratio to the plain steps
    of its own round, so the machine's drift between rounds (here 1.1-1.5x within a
    minute) cancels; the median ratio of each width, times the median plain step, stands.
    Drafted cycles follow drafted ones, as they do while speculating: a drafted cycle
    right after copied ones also catches the drafter up on their tokens, a cost of
    switching that made the table ~15% dearer than steady decoding.

    Args:
        model: the loaded pair. context: tokens of dummy context before the timed steps.
        rounds: timings per width.
    """
    B = model.block_size
    params = SamplingParams()
    cache = model.make_cache()
    ids = [i % model.adapter.vocab_size for i in range(1, context + 1)]
    ratios: dict[tuple[int, bool], list[float]] = {}
    plains: list[float] = []
    with mx.stream(steps.generation_stream()):
        first, key = steps.prefill(model, ids, cache, params, mx.random.key(0))
        history = ids + first.tokens
        keys = (key, key)
        history += steps.cycle(model, cache, params, history, Choice(B), keys).tokens  # warms up
        for _ in range(max(1, rounds)):
            times: dict[tuple[int, bool], float] = {}
            plain = []
            for lookup in (False, True):
                for b in warm_up_blocks(B):
                    copied = history[-b:-1] if lookup else None
                    t = time.perf_counter()
                    step = steps.cycle(model, cache, params, history, Choice(b), keys, copied)
                    mx.eval(cache.state)
                    times[b, lookup] = time.perf_counter() - t
                    history += step.tokens
                plain.append(_plain_step(model, cache, params, history, key))
            per = statistics.mean(plain)
            plains.append(per)
            for k, v in times.items():
                ratios.setdefault(k, []).append(v / per)
    base = statistics.median(plains)
    drafted, copied = CostTable(B), CostTable(B)
    for (b, lookup), v in ratios.items():
        (copied if lookup else drafted).seconds[b] = statistics.median(v) * base
    drafted.seconds[1] = copied.seconds[1] = base
    model.tuning = Tuning(drafted, copied)
    return model.tuning


def tune(model: DFlashModel, stored: dict | None = None) -> bool:
    """Set ``model.tuning`` from stored step costs, or measure them (:func:`warm_up`) when
    there are none. The costs steer only the block schedule, never the tokens.

    Args:
        model: the loaded pair. stored: costs as ``Tuning.tables`` gives them, or None.

    Returns:
        whether they were measured now (and are worth storing).
    """
    if stored is not None:
        model.tuning = Tuning.from_seconds(model.block_size, stored)
        return False
    warm_up(model)
    return True


def _plain_step(model, cache, params, history: list[int], key, n: int = PLAIN_RUN) -> float:
    """Seconds per plain step: a run of ``n`` pipelined steps from its start to its last
    token, over n (history extended). Not the gaps between a run's tokens: the first gap
    also fills the pipeline (~2 steps) and the last is nearly free (its step was computed
    while the one before was read), so timing steps 2..5 of 5 put a plain step ~20% under
    what plain decoding costs."""
    t = time.perf_counter()
    for step in steps.plain_steps(model, cache, params, history, n, key):
        history += step.tokens
    return (time.perf_counter() - t) / n


def warm_up_blocks(B: int) -> list[int]:
    """The speculative blocks ``warm_up`` times: every one up to 8, then every other one
    (the live timings refine the rest), and always the checkpoint's block B."""
    return sorted({b for b in range(2, B + 1) if b <= 8 or b % 2 == 0} | {B})
