"""Sliding-window context caches written in place (``WindowRows``) hold, and attend to,
exactly the rows today's concatenation held: the same bits, whatever the appends, blocks
and trims, including past the window and across the buffer's compactions."""

import random

import mlx.core as mx
import pytest
from references import reference, run
from tiny_models import build_drafter

from dflash_mlx.model import context as context_mod
from dflash_mlx.model.context import ContextCache


class ConcatRows:
    """The reference: the window kept by concatenating and cutting (the old path)."""

    def __init__(self, window):
        self.window, self.k, self.v = window, None, None

    def append(self, k, v):
        if self.k is not None:
            k, v = mx.concatenate([self.k, k], 2), mx.concatenate([self.v, v], 2)
        self.k, self.v = k[:, :, -self.window :], v[:, :, -self.window :]

    def with_block(self, k, v):
        if self.k is None:
            return k, v
        return mx.concatenate([self.k, k], 2), mx.concatenate([self.v, v], 2)

    def trim(self, n):
        keep = self.k.shape[2] - n if self.k is not None else 0
        self.k, self.v = (None, None) if keep <= 0 else (self.k[:, :, :keep], self.v[:, :, :keep])


def rows(n, seed):
    """Keys and values [1, 2, n, 4] of distinct values."""
    k = mx.random.normal((1, 2, n, 4), key=mx.random.key(seed))
    return k, k * 3 + 1


@pytest.mark.parametrize("window", [1, 5, 16])
def test_window_rows_equal_concatenated_rows_under_random_appends_blocks_and_trims(
    window, monkeypatch
):
    monkeypatch.setattr(context_mod, "SLACK", 1)  # compact every `window` rows
    rng = random.Random(window)
    cache, ref = ContextCache(window), ConcatRows(window)
    for step in range(300):
        op = rng.choice(["append", "append", "block", "trim"])
        if op == "append":
            kv = rows(rng.choice([1, 2, 3, window, 2 * window + 1]), step)
            cache.append(*kv)
            ref.append(*kv)
        elif op == "trim":
            n = rng.choice([1, 2, window])
            cache.trim(n)
            ref.trim(n)
        else:
            kv = rows(rng.choice([1, 4, 8]), step)
            for got, want in zip(cache.with_block(*kv), ref.with_block(*kv)):
                assert mx.array_equal(got, want).item(), (step, op)
        assert cache.size == (0 if ref.k is None else ref.k.shape[2])
        if ref.k is not None:
            assert (
                mx.array_equal(cache.keys, ref.k).item()
                and mx.array_equal(cache.values, ref.v).item()
            )


def test_a_window_buffer_is_written_in_place_between_compactions():
    cache = ContextCache(64)
    cache.append(*rows(10, 0))
    buffer = cache._rows._k
    for i in range(20):  # 20 blocks of 8 and appends of 3: 70 rows, within the slack
        cache.with_block(*rows(8, i))
        cache.append(*rows(3, 100 + i))
        assert cache._rows._k.shape == buffer.shape  # no new buffer, no concatenation
    assert cache.size == 64 and cache.offset == 70


def test_a_long_stream_copies_its_window_rarely_and_never_outgrows_it(monkeypatch):
    copies, room = [], context_mod.WindowRows._room

    def counted(self, n, keys, values):
        copies.append(self._k is None or self._end + n > self._k.shape[2])
        room(self, n, keys, values)

    monkeypatch.setattr(context_mod.WindowRows, "_room", counted)
    cache = ContextCache(1024)  # slack 256
    for i in range(700):  # 2,100 rows in cycles of a block of 8 and 3 rows kept
        cache.with_block(*rows(8, i))
        cache.append(*rows(3, i))
        assert cache._rows._k.shape[2] <= 1024 + 256
    assert cache.size == 1024 and sum(copies) <= 2 + 4 + (2100 - 1024) // 240 + 1


def test_drafts_with_a_window_cache_equal_drafts_over_concatenated_context(pairs):
    model, _ = pairs("qwen3", "d2")
    d = model.drafter
    D = len(d.args.target_layer_ids) * d.args.hidden_size
    cache = [ContextCache(16) for _ in d.layers]
    refs = [ConcatRows(16) for _ in d.layers]
    emb = model.embed_block(mx.array([5], mx.uint32), 8)
    for i, n in enumerate([40, 3, 9, 1, 20, 7]):
        feats = mx.random.normal((1, n, D), key=mx.random.key(i))
        offset = cache[0].offset
        d.append_context(feats, cache, lazy=False)
        x = d.project_context(feats)
        for layer, r in zip(d.layers, refs):
            r.append(*layer.self_attn.kv(x, offset))
        want = d(emb, [(r.k, r.v) for r in refs], cache[0].offset)
        assert mx.array_equal(d.step(emb, cache), want).item()


@pytest.fixture(scope="module")
def window16(tiny_dir):
    """The tiny qwen3 target with a drafter whose layers slide over 16 positions."""
    from dflash_mlx import load

    path = build_drafter(tiny_dir / "d2_w16", tiny_dir / "qwen3", sliding_window=16)
    return load(str(tiny_dir / "qwen3"), drafter=str(path))


@pytest.mark.parametrize("block", [4, 8])
def test_greedy_past_the_drafter_window_equals_plain_decoding(window16, block, monkeypatch):
    monkeypatch.setattr(context_mod, "SLACK", 1)  # the window's buffer compacts too
    model, tok = window16
    assert model.drafter.args.window(0) == 15
    ids = (tok.encode("import os\nfor i in range(10):\n    print(i)\n") * 8)[:100]
    got, stats = run(model, ids, 48, block)
    assert model.drafter.make_cache()[0].window == 15 and stats
    assert got == reference(model, ids, 48)
