"""The warm-up: what each step the ``block_size="auto"`` scheduler may choose costs on this
machine (docs/algorithm.md §7), measured or read from the start-up cache at the first need
(``ensure``): a fixed block size never pays for it."""

from __future__ import annotations

import statistics
import time

import mlx.core as mx

from .. import env
from . import steps
from .acceptance import SamplingParams
from .costs import LONG_CONTEXT, SHORT_CONTEXT
from .policy import Choice
from .schedule import CostTable, Tuning
from .state import DFlashModel

WARM_ROUNDS = 3  # timings per block width at warm-up (their median stands)
PLAIN_RUN = 8  # plain steps per timed run
# A stored table is trusted while a spot check's plain step and block-B ratio are within
# this factor of it: a table timed on a busy machine had left `auto` 95% plain on a quiet one.
CHECK_TOLERANCE = 1.3
ENV_CHECK = "DFLASH_COSTS_CHECK"  # 0: use a stored table without the spot check


def warm_up(model: DFlashModel, rounds: int = WARM_ROUNDS, long: bool = True) -> Tuning:
    """Measure what a step costs on this machine: plain (block 1), and every speculative
    block the scheduler may choose (``warm_up_blocks``; verify cost by width is not
    monotone on a CPU BLAS, so interpolating would misjudge some) both drafted and copied
    (a context-lookup draft, no drafter pass), on a throwaway cache of ``SHORT_CONTEXT``
    tokens; then the same for a few widths (``long_blocks``) with the cache grown by
    ``LONG_CONTEXT - SHORT_CONTEXT`` rows (``grow_context``), which says how each cost
    grows with the context (``costs.Bands``). Sets and returns ``model.tuning``.

    Args:
        model: the loaded pair. rounds: timings per width.
        long: also time the long context (False: a band starts as a copy of the one below).
    """
    B = model.block_size
    params = SamplingParams()
    cache = model.make_cache()
    ids = [i % model.adapter.vocab_size for i in range(1, SHORT_CONTEXT + 1)]
    with mx.stream(steps.generation_stream()):
        first, key = steps.prefill(model, ids, cache, params, mx.random.key(0))
        history = ids + first.tokens
        keys = (key, key)
        history += steps.cycle(model, cache, params, history, Choice(B), keys).tokens  # warms up
        start = len(history)
        short = _time_blocks(model, cache, history, warm_up_blocks(B), rounds, key)
        grown = None
        if long:
            # the long pass starts as many rows after the short one's start as the tables'
            # contexts are apart, so both passes' own growth while timing is alike
            grow_context(model, cache, history, start + LONG_CONTEXT - SHORT_CONTEXT - len(history))
            grown = _time_blocks(model, cache, history, long_blocks(B), rounds, key)
    model.tuning = Tuning(*short, long=grown)
    return model.tuning


def _time_blocks(model, cache, history: list[int], widths, rounds: int, key):
    """(drafted, copied) CostTables of ``widths`` and the plain step, ``rounds`` rounds.

    Each round times the drafted widths back to back, then plain steps, then the copied
    widths, then plain steps again. A cycle's cost is kept as a ratio to the plain steps
    of its own round, so the machine's drift between rounds (here 1.1-1.5x within a
    minute) cancels; the median ratio of each width, times the median plain step, stands.
    Drafted cycles follow drafted ones, as they do while speculating: a drafted cycle
    right after copied ones also catches the drafter up on their tokens, a cost of
    switching that made the table ~15% dearer than steady decoding.
    """
    params, keys = SamplingParams(), (key, key)
    ratios: dict[tuple[int, bool], list[float]] = {}
    plains: list[float] = []
    for _ in range(max(1, rounds)):
        times: dict[tuple[int, bool], float] = {}
        plain = []
        for lookup in (False, True):
            for b in widths:
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
    drafted, copied = CostTable(model.block_size), CostTable(model.block_size)
    for (b, lookup), v in ratios.items():
        (copied if lookup else drafted).seconds[b] = statistics.median(v) * base
    drafted.seconds[1] = copied.seconds[1] = base
    return drafted, copied


def grow_context(model: DFlashModel, cache, history: list[int], n: int) -> None:
    """Grow a throwaway cache by ``n`` rows as if ``n`` more tokens had been fed, without
    running the target on them (a 2,048-token prefill takes ~25 s on a 2-core CPU): random
    keys and values in every growing target cache, zero features in the drafter's context.
    Only for timing: what the rows hold does not change what attending to them costs.

    Args:
        model: the pair. cache: its ``PromptCache``, ``history`` its tokens plus the next
            to feed. n: rows to add (``history`` gets as many filler ids before its last).
    """
    if n <= 0:
        return
    key, dtype = mx.random.key(0), mx.float32

    def rows(like):  # [B, H_kv, S, D] -> n random rows of the same heads, width and dtype
        shape = (1, like.shape[1], n, like.shape[3])
        return (0.1 * mx.random.normal(shape, key=key)).astype(like.dtype)

    for c in cache.target:
        keys, values = getattr(c, "keys", None), getattr(c, "values", None)
        if keys is None or isinstance(keys, tuple):  # recurrent state (or quantized)
            continue
        dtype = keys.dtype  # the target's: its features have it too
        c.update_and_fetch(rows(keys), rows(values))
    features = mx.zeros((1, n, model.drafter.feature_size), dtype=dtype)  # [1, n, nT*H]
    model.drafter.append_context(features, cache.drafter, lazy=False)
    filler = [i % (model.adapter.vocab_size - 1) + 1 for i in range(n)]
    history[-1:-1] = filler
    cache.tokens += filler
    mx.eval(cache.state)


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


def ensure(model: DFlashModel, log=None) -> Tuning:
    """``model.tuning``, set at its first need: the costs stored for this pair on this chip
    when a spot check (:func:`spot_check`) agrees with them, else measured now
    (:func:`warm_up`) and stored. Only ``block_size="auto"`` needs them.

    Args:
        model: the loaded pair. log: callable(str) for the one note on a stale table
            (default: ``model.notes``, else stderr).
    """
    if model.tuning is not None:
        return model.tuning
    from ..loading import diskcache  # the store; loading imports decoding, never the reverse

    log = log or model.notes

    stored = diskcache.read_costs(model)
    if stored is not None:
        checked = env.switch(ENV_CHECK)  # off: a machine whose load varies keeps its table
        why = disagreement(stored, *spot_check(model), model.block_size) if checked else None
        if why is None:
            tune(model, stored)
            return model.tuning
        diskcache.note(f"the stored warm-up costs {why}; measuring them again", log)
    warm_up(model)
    diskcache.write_costs(model, model.tuning.tables())
    return model.tuning


def spot_check(model: DFlashModel, context: int = SHORT_CONTEXT) -> tuple[float, float]:
    """What a plain step costs now and a drafted block of the checkpoint's width as a ratio
    to it: 2 timed cycles and one 8-step plain run on a throwaway cache (a full warm-up
    runs ~40 cycles and 48 plain steps at that context, then about half as many
    cycles and 48 plain steps 2,000 tokens further on).

    Returns:
        (seconds per plain step, drafted block B's cost / plain step's).
    """
    B, params, cache = model.block_size, SamplingParams(), model.make_cache()
    ids = [i % model.adapter.vocab_size for i in range(1, context + 1)]
    with mx.stream(steps.generation_stream()):
        first, key = steps.prefill(model, ids, cache, params, mx.random.key(0))
        history, keys = ids + first.tokens, (key, key)
        history += steps.cycle(model, cache, params, history, Choice(B), keys).tokens
        _plain_step(model, cache, params, history, key, n=2)  # compiles the plain step
        history += steps.cycle(model, cache, params, history, Choice(B), keys).tokens
        t = time.perf_counter()
        for _ in range(2):  # drafted after drafted, as warm_up times them
            history += steps.cycle(model, cache, params, history, Choice(B), keys).tokens
            mx.eval(cache.state)
        block = (time.perf_counter() - t) / 2
        plain = _plain_step(model, cache, params, history, key)
    return plain, block / plain


def disagreement(stored: dict, plain: float, ratio: float, B: int) -> str | None:
    """Why a stored table does not describe the machine as a spot check found it, or None.

    Args:
        stored: ``Tuning.tables()``'s form. plain, ratio: :func:`spot_check`'s result.
        B: the checkpoint's block.
    """
    table = stored["seconds"]
    if 1 not in table or B not in table:
        return "lack the plain step or the checkpoint's block"
    then = table[B] / table[1]
    off = max(plain / table[1], table[1] / plain)
    if off > CHECK_TOLERANCE:
        return f"put a plain step at {table[1] * 1e3:.1f} ms, {plain * 1e3:.1f} ms now"
    if max(ratio / then, then / ratio) > CHECK_TOLERANCE:
        return f"put block {B} at {then:.2f} plain steps, {ratio:.2f} now"
    return None


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


def long_blocks(B: int) -> list[int]:
    """The blocks ``warm_up`` times at its long context: 2, 4, 8 and the checkpoint's B
    (growth with the context is smooth in the width; the rest is interpolated)."""
    return sorted({b for b in (2, 4, 8) if b <= B} | {B})


def warm_up_blocks(B: int) -> list[int]:
    """The speculative blocks ``warm_up`` times: every one up to 8, then every other one
    (the live timings refine the rest), and always the checkpoint's block B."""
    return sorted({b for b in range(2, B + 1) if b <= 8 or b % 2 == 0} | {B})
