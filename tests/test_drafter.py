"""The drafter's context cache: lazily projected features equal eagerly projected ones,
whatever is trimmed in between."""

import mlx.core as mx
import pytest

from dflash_mlx import drafter as drafter_mod


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
