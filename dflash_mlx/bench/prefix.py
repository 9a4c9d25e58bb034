"""One prefill per prompt for ``dflash bench``: every method decodes from a copy of it.

A long prompt then costs one prefill per bench instead of one per method, and the methods
are compared on decoding alone, from the same cached state (which is also what their greedy
parity check compares). The Recall@k diagnostic runs the target over the continuation only
and reads the prompt's context rows from the drafter's cache.
"""

from __future__ import annotations

import copy
import time

import mlx.core as mx
import numpy as np

from ..decoding.acceptance import SamplingParams
from ..decoding.state import PromptCache
from ..decoding.steps import prefill, prefill_chunk


def prefilled(model, ids: list[int]) -> PromptCache:
    """A cache holding ``ids[:-1]``: the last prompt token is each method's first forward.

    Args:
        model: the loaded pair. ids: the prompt's token ids (at least one).
    """
    cache = model.make_cache()
    if len(ids) > 1:
        prefill(model, ids[:-1], cache, SamplingParams(0.0), mx.random.key(0))
    model.drafter.flush_context(cache.drafter)  # projected once, not by every copy
    mx.eval(cache.state)
    return cache


def copied(cache: PromptCache) -> PromptCache:
    """An independent copy of cache: forwards on it leave the original as it was (mlx-lm's
    caches and ours write their buffers in place, and recurrent states are lists)."""
    out = PromptCache(
        copy.deepcopy(cache.target),
        copy.deepcopy(cache.drafter),
        list(cache.tokens),
        checkpoint=copy.deepcopy(cache.checkpoint),
        kv=cache.kv,
    )
    mx.eval(out.state)  # own buffers now, before anything writes into either
    return out


def context_rows(model, cache: PromptCache, ids: list[int], continuation: list[int]):
    """The drafter's context for teacher-forced drafting over ``continuation``: per layer
    (keys, values) [1, n_kv, rows, head_dim] of positions ``start`` .. len(seq) - 1, and
    ``start``; None when the drafter's layers hold different rows of the prompt (then the
    whole sequence must be run).

    Args:
        model: the pair. cache: ``prefilled(model, ids)`` (left as it was). ids: the
            prompt. continuation: the target's tokens after it.
    """
    sizes = {c.size for c in cache.drafter}
    if len(sizes) != 1:
        return None
    held = sizes.pop()
    target = copy.deepcopy(cache.target)  # the forward writes it; the drafter's is only read
    _, feats = model.adapter(mx.array(ids[-1:] + continuation)[None], target)
    x_ctx = model.drafter.project_context(feats)  # [1, 1 + len(continuation), H]
    rows = []
    for layer, c in zip(model.drafter.layers, cache.drafter):
        k, v = layer.self_attn.kv(x_ctx, len(ids) - 1)
        old_k, old_v = c.held()
        if old_k is not None:
            k, v = mx.concatenate([old_k, k], axis=2), mx.concatenate([old_v, v], axis=2)
        rows.append((k, v))
    return rows, len(ids) - 1 - held


def _timed(model, cache: PromptCache, ids: list[int], steps: int) -> tuple[float, float]:
    """(seconds of one prefill chunk of ``ids`` after cache, seconds per plain step after
    it); the cache grows by both."""
    t = time.perf_counter()
    prefill(model, ids, cache, SamplingParams(0.0), mx.random.key(0))
    chunk = time.perf_counter() - t
    t = time.perf_counter()
    for tok in ids[:steps]:
        logits, _ = model.adapter(mx.array([[tok]]), cache.target)
        mx.eval(logits)
    return chunk, (time.perf_counter() - t) / steps


def speeds(model, context: int, steps: int = 4) -> tuple[tuple, tuple]:
    """A prefill chunk's seconds and a plain step's, timed after no context and after
    ``context`` rows (grown without running the target, ``warmup.grow_context``): a long
    bench's forecast, before it starts. Filler ids; nothing is kept."""
    from ..decoding.warmup import grow_context

    n = prefill_chunk(2048)
    ids = np.random.default_rng(0).integers(100, 1000, n).tolist()
    cache = model.make_cache()
    short = _timed(model, cache, ids, steps)  # (its plain steps are not in cache.tokens)
    grow_context(model, cache, list(cache.tokens) + [ids[0]], context - len(cache.tokens))
    long = _timed(model, cache, cache.tokens + ids, steps)
    return short, long


def expected_seconds(model, lengths: list[int], max_tokens: int, methods: int) -> float:
    """A rough forecast of a bench's time, from ``speeds`` timed once (see ``forecast``).

    Args:
        model: the pair. lengths: the prompts' token counts. max_tokens: per method.
        methods: how many methods decode each prompt.
    """
    return forecast(speeds(model, max(lengths)), lengths, max_tokens, methods)


def forecast(
    timed: tuple[tuple, tuple], lengths: list[int], max_tokens: int, methods: int
) -> float:
    """Seconds for each prompt prefilled once in chunks and every method decoding
    ``max_tokens`` plainly, both costs linear in the context between ``timed``'s two
    (chunk, step) timings: after no context and after the longest prompt.

    Args:
        timed: ``speeds``' result. lengths, max_tokens, methods: as ``expected_seconds``.
    """
    top = max(lengths)
    (c0, s0), (c1, s1) = timed
    n = prefill_chunk(2048)
    total = 0.0
    for length in lengths:
        mid = length / 2 / max(top, 1)  # a prompt's chunks sit at half its length on average
        total += length / n * (c0 + (c1 - c0) * mid)
        total += methods * max_tokens * (s0 + (s1 - s0) * length / max(top, 1))
    return total
