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
def test_a_grown_context_keeps_offsets_and_tokens_consistent_through_cycles(pairs, kind):
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


def test_a_grown_contexts_rows_are_stored_and_attended(pairs):
    """The rows hold random keys and values, and attention reads them: zeroing their values
    (same offset, same positions) changes the next logits."""
    model, _ = pairs("qwen3", "d2")
    out = []
    for zero in (False, True):
        cache = model.make_cache()
        steps.prefill(model, list(range(3, 23)), cache, SamplingParams(), mx.random.key(0))
        history = list(range(3, 24))
        grow_context(model, cache, history, 200)
        for c in cache.target:
            rows = c.keys[..., 20:220, :]
            assert mx.abs(rows).max().item() > 0.01  # stored, not left zero
            if zero:
                c.values[..., 20:220, :] = 0.0
        logits, _ = model.adapter(mx.array([[history[-1]]]), cache.target)
        out.append(logits)
    assert not mx.allclose(out[0], out[1]).item()


def test_a_grown_context_keeps_the_targets_dtype_in_both_models_caches(pairs, monkeypatch):
    """On a half-precision pair the filler features have the target's dtype, so the
    drafter's context stays as decoding keeps it (float32 zeros had turned it float32)."""
    model, _ = pairs("qwen3", "d2")
    cache = model.make_cache()
    steps.prefill(model, list(range(3, 23)), cache, SamplingParams(), mx.random.key(0))
    for c in cache.target:  # as a bfloat16 target's prefill leaves them
        c.keys, c.values = c.keys.astype(mx.bfloat16), c.values.astype(mx.bfloat16)
    seen = []
    monkeypatch.setattr(model.drafter, "append_context", lambda f, *a, **k: seen.append(f.dtype))
    grow_context(model, cache, list(range(3, 24)), 50)
    assert seen == [mx.bfloat16]
    assert all(c.keys.dtype == c.values.dtype == mx.bfloat16 for c in cache.target)


def test_stored_long_tables_are_checked_like_the_short_ones():
    from dflash_mlx.loading.diskcache import _tables

    good = {"seconds": {"1": 0.01, "8": 0.02}, "lookup_seconds": {"1": 0.01, "8": 0.015}}
    assert sorted(_tables(good, 8)) == ["lookup_seconds", "seconds"]
    long = {"long_seconds": {"1": 0.02, "8": 0.05}, "long_lookup_seconds": {"1": 0.02}}
    assert sorted(_tables({**good, **long}, 8)) == sorted([*good, *long])
    assert _tables({**good, "long_seconds": {"9": 0.02}}, 8) is None  # no such width
    assert _tables({**good, "long_seconds": {"1": "fast"}}, 8) is None
    assert _tables({**good, "long_seconds": {}}, 8) is None
