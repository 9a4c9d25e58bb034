"""The drafter's context cache: lazily projected features equal eagerly projected ones,
whatever is trimmed in between."""

import mlx.core as mx
import pytest

from dflash_mlx.model import drafter as drafter_mod


def feats(model, n, seed):
    D = len(model.drafter.args.target_layer_ids) * model.drafter.args.hidden_size
    return mx.random.normal((1, n, D), key=mx.random.key(seed))


@pytest.mark.parametrize("trims", [[], [3], [5, 9], [20]])
def test_lazy_context_equals_eager_context_after_trims(pairs, trims):
    model, _ = pairs("qwen3", "d2")
    d = model.drafter
    lazy, eager = d.make_cache(), d.make_cache()
    parts = [feats(model, n, i) for i, n in enumerate([7, 4, 6])]
    for f in parts:
        d.append_context(f, lazy)  # pending until the drafter runs
        d.append_context(f, eager, lazy=False)
    assert lazy[0].keys is None and lazy[0].pending_rows == 17
    for n in trims:
        for c in lazy + eager:
            c.trim(n)
    d.flush_context(lazy)
    assert lazy[0].offset == eager[0].offset == max(0, 17 - sum(trims))
    for a, b in zip(lazy, eager):
        assert (a.keys is None) == (b.keys is None)
        if a.keys is not None:
            assert mx.allclose(a.keys, b.keys, atol=1e-5).item()
            assert mx.allclose(a.values, b.values, atol=1e-5).item()
    emb = model.embed_block(mx.array([5], mx.uint32), 4)
    assert mx.allclose(d.step(emb, lazy), d.step(emb, eager), atol=1e-4).item()


def test_pending_features_are_bounded(pairs, monkeypatch):
    model, _ = pairs("qwen3", "d2")
    monkeypatch.setattr(drafter_mod, "PENDING_MAX", 10)
    cache = model.drafter.make_cache()
    model.drafter.append_context(feats(model, 6, 0), cache)
    assert cache[0].pending_rows == 6 and cache[0].offset == 0
    model.drafter.append_context(feats(model, 6, 1), cache)
    assert cache[0].pending_rows == 0 and cache[0].offset == 12  # flushed past the bound


def test_a_step_attends_in_place_and_keeps_no_block_rows(pairs):
    model, _ = pairs("qwen3", "d2")
    d = model.drafter
    cache = d.make_cache()
    emb = model.embed_block(mx.array([5], mx.uint32), 4)
    for i, n in enumerate([250, 9, 3]):  # the second append crosses a buffer step
        d.append_context(feats(model, n, i), cache, lazy=False)
        size = cache[0].size
        kv = [(mx.array(c.keys), mx.array(c.values)) for c in cache]
        ref = d(emb, kv, cache[0].offset)  # the context passed as plain arrays
        assert mx.allclose(d.step(emb, cache), ref, atol=1e-4).item()
        assert cache[0].size == size and cache[0].offset == size  # block rows forgotten
        for c in cache:
            c.trim(2)


def test_a_windowed_context_holds_only_its_window():
    c = drafter_mod.ContextCache(window=5)
    rows = lambda n, x: mx.full((1, 1, n, 2), x)
    c.append(rows(4, 1.0), rows(4, 1.0))
    c.append(rows(3, 2.0), rows(3, 2.0))
    assert c.size == 5 and c.offset == 7
    k, _ = c.with_block(rows(2, 3.0), rows(2, 3.0))
    assert k.shape[2] == 7 and c.size == 5
    c.trim(2)
    assert c.size == 3 and c.offset == 5 and c.keys[0, 0, :, 0].tolist() == [1.0, 1.0, 2.0]


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("flush", [True, False])
def test_a_saved_context_cache_restores_identical_drafts(pairs, window, flush):
    model, _ = pairs("qwen3", "d2")
    d = model.drafter
    cache = [drafter_mod.ContextCache(window) for _ in d.layers]
    d.append_context(feats(model, 9, 0), cache, lazy=False)
    for c in cache:
        c.trim(2)
    d.append_context(feats(model, 4, 1), cache, lazy=not flush)
    saved = [c.save_state() for c in cache]
    assert all(isinstance(v, str) for _, meta in saved for v in meta.values())
    restored = [drafter_mod.ContextCache.load_state(*s) for s in saved]
    assert [c.position for c in restored] == [c.position for c in cache] == [11] * len(cache)
    emb = model.embed_block(mx.array([5], mx.uint32), 4)
    assert mx.array_equal(d.step(emb, restored), d.step(emb, cache)).item()


def test_loading_something_else_than_a_saved_context_cache_is_refused():
    with pytest.raises(ValueError, match="not a saved context cache"):
        drafter_mod.ContextCache.load_state({}, {"window": "none", "offset": "0"})
