"""The warm-up's long-context tables: a throwaway cache grown without running the target
(``warmup.grow_context``) stays a cache the loop can decode on, and the stored tables that
carry them are checked like the short ones."""

from __future__ import annotations

import mlx.core as mx
import pytest

from dflash_mlx.decoding import steps
from dflash_mlx.decoding.acceptance import SamplingParams
from dflash_mlx.decoding.policy import Choice
from dflash_mlx.decoding.warmup import grow_context


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_a_grown_context_is_attended_like_fed_rows_and_cycles_keep_it_consistent(pairs, kind):
    model, _ = pairs(kind, "d2")
    params, cache = SamplingParams(), model.make_cache()
    ids = list(range(3, 23))
    first, key = steps.prefill(model, ids, cache, params, mx.random.key(0))
    history = ids + first.tokens
    grow_context(model, cache, history, 300)
    assert len(history) == 321 and history[-1] == first.tokens[0]  # fillers before the next
    assert cache.tokens == history[:-1]
    grown = [c for c in cache.target if getattr(c, "keys", None) is not None]
    assert grown and all(c.offset == 320 for c in grown)
    assert all(c.offset == 320 for c in cache.drafter)
    for b in (8, 1, 4):  # a drafted cycle, a plain run, a copied one
        if b == 1:
            history += [
                s.tokens[0] for s in steps.plain_steps(model, cache, params, history, 3, key)
            ]
        else:
            copied = history[-b:-1] if b == 4 else None
            step = steps.cycle(model, cache, params, history, Choice(b), (key, key), copied)
            history += step.tokens
        mx.eval(cache.state)
        assert len(cache.tokens) == len(history) - 1
        assert all(c.offset == len(cache.tokens) for c in grown)
        assert all(c.offset + c.pending_rows == len(cache.tokens) for c in cache.drafter)


def test_a_grown_context_costs_what_its_length_does(pairs):
    """The rows are real rows to attention: logits after growing differ from the short
    cache's (random keys, attended), so the timings see the longer context."""
    model, _ = pairs("qwen3", "d2")
    out = []
    for n in (0, 200):
        cache = model.make_cache()
        steps.prefill(model, list(range(3, 23)), cache, SamplingParams(), mx.random.key(0))
        history = list(range(3, 24))
        if n:
            grow_context(model, cache, history, n)
        logits, _ = model.adapter(mx.array([[history[-1]]]), cache.target)
        out.append(logits)
    assert not mx.allclose(out[0], out[1]).item()


def test_stored_long_tables_are_checked_like_the_short_ones():
    from dflash_mlx.loading.diskcache import _tables

    good = {"seconds": {"1": 0.01, "8": 0.02}, "lookup_seconds": {"1": 0.01, "8": 0.015}}
    assert sorted(_tables(good, 8)) == ["lookup_seconds", "seconds"]
    long = {"long_seconds": {"1": 0.02, "8": 0.05}, "long_lookup_seconds": {"1": 0.02}}
    assert sorted(_tables({**good, **long}, 8)) == sorted([*good, *long])
    assert _tables({**good, "long_seconds": {"9": 0.02}}, 8) is None  # no such width
    assert _tables({**good, "long_seconds": {"1": "fast"}}, 8) is None
    assert _tables({**good, "long_seconds": {}}, 8) is None
