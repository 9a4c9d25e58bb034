"""The server's prompt-cache pool (``server/prompt_cache.py``) and its disk tier
(``server/prompt_cache_disk.py``), in process on the tiny pairs: the longest prefix wins,
eviction is least recently used by bytes, restored entries decode exactly as fresh ones
(attention and hybrid targets), a damaged or foreign entry on disk is removed, the batched
worker takes and gives back, and ``--prompt-cache-gb`` is checked."""

from __future__ import annotations

import json
import threading

import pytest
from typer.testing import CliRunner

from dflash_mlx import stream_generate
from dflash_mlx.server.prompt_cache import PromptPool
from dflash_mlx.server.prompt_cache_disk import DiskTier
from dflash_mlx.server.worker import Engine, Job
from dflash_mlx.settings import GenerationConfig

EOS = 3  # the tiny models' <|im_end|>
GREEDY = {"max_tokens": 12, "logit_bias": {EOS: -100}}


def ids(seed: int, n: int) -> list[int]:
    """n token ids of the tiny vocabulary, fixed by seed (away from the special ids)."""
    return [10 + (seed * 7919 + i * 104729) % 300 for i in range(n)]


def run(model, tok, prompt, cache=None):
    """(text, prompt tokens the generation reused from cache)."""
    out, last = [], None
    for r in stream_generate(model, tok, prompt, prompt_cache=cache, **GREEDY):
        out.append(r.text)
        last = r
    return "".join(out), last.prompt_tokens - last.prompt_processed


def filled(pool, model, tok, prompt):
    """Take a cache for prompt, decode with it, give it back; returns what was reused."""
    cache = pool.take(prompt)
    _, reused = run(model, tok, prompt, cache)
    pool.give(cache)
    return reused


def test_the_pool_lends_the_entry_sharing_the_longest_prefix(pairs):
    model, tok = pairs("qwen3", "d2")
    pool = PromptPool(model, 10**9)
    system = ids(1, 40)
    prompts = [
        system + ids(2, 5),  # shares the system prompt
        system + ids(3, 30) + ids(4, 3),  # shares the system prompt and 30 more
        ids(5, 50),  # shares nothing
    ]
    caches = [pool.take(p) for p in prompts]  # three requests at once: three fresh caches
    for p, c in zip(prompts, caches):
        run(model, tok, p, c)
        pool.give(c)
    assert pool.stats()["entries"] == 3
    prompt = system + ids(3, 30) + ids(6, 4)
    cache = pool.take(prompt)
    assert cache.tokens[:70] == prompt[:70]  # the second entry
    assert cache.usable(prompt) == 70
    assert pool.stats()["entries"] == 2 and pool.stats()["in_use"] == 1
    text, reused = run(model, tok, prompt, cache)
    assert reused == 70
    assert text == run(model, tok, prompt)[0]  # greedy: the same text as without a cache
    pool.give(cache)
    stats = pool.stats()
    assert stats["lookups"] == 4 and stats["hits"] == 1 and stats["cached_tokens"] == 70
    assert stats["in_use"] == 0


def test_a_prompt_sharing_nothing_gets_a_fresh_cache_and_the_entries_stay(pairs):
    model, tok = pairs("qwen3", "d2")
    pool = PromptPool(model, 10**9)
    filled(pool, model, tok, ids(1, 30))
    cache = pool.take(ids(9, 30))
    assert cache.tokens == [] and pool.stats()["entries"] == 1


def test_eviction_is_least_recently_used_by_bytes(pairs):
    model, tok = pairs("qwen3", "d2")
    a, b, c = ids(1, 40), ids(2, 40), ids(3, 40)
    probe = PromptPool(model, 10**9)
    filled(probe, model, tok, a)
    one = probe.nbytes
    assert one > 0
    pool = PromptPool(model, int(2.5 * one))  # room for two entries of this size
    filled(pool, model, tok, a)
    filled(pool, model, tok, b)
    assert filled(pool, model, tok, a + ids(7, 3)) == 40  # a is used again: b is older now
    filled(pool, model, tok, c)  # over the budget: b goes
    held = [e[0].tokens[:40] for e in pool.entries]
    assert a in held and c in held and b not in held
    assert pool.stats()["evicted"] == 1 and pool.nbytes <= pool.max_bytes


def test_a_zero_budget_keeps_nothing(pairs):
    model, tok = pairs("qwen3", "d2")
    pool = PromptPool(model, 0)
    filled(pool, model, tok, ids(1, 20))
    assert pool.stats()["entries"] == 0
    assert filled(pool, model, tok, ids(1, 20) + [11]) == 0


def test_an_entry_holding_a_prefix_of_another_is_dropped(pairs):
    model, tok = pairs("qwen3", "d2")
    pool = PromptPool(model, 10**9)
    short = pool.take(ids(1, 20))
    long_ = pool.take(ids(1, 20))  # the first is out: a second cache for the same prefix
    run(model, tok, ids(1, 20), short)  # holds the prompt and its answer
    run(model, tok, short.tokens + ids(2, 10), long_)
    pool.give(short)
    pool.give(long_)
    assert pool.stats()["entries"] == 1 and pool.entries[0][0] is long_


def test_a_long_branch_gets_a_copy_and_the_entry_stays_whole(pairs):
    model, tok = pairs("qwen3", "d2")
    pool = PromptPool(model, 10**9, fork_min=32)
    system, first = ids(1, 50), ids(2, 60)
    filled(pool, model, tok, system + first)  # a conversation after the system prompt
    (held,) = [e[0] for e in pool.entries]
    before = list(held.tokens)
    other = system + ids(3, 10)  # another conversation after the same system prompt
    cache = pool.take(other)
    assert cache is not held and held.tokens == before  # a copy of the shared prefix
    text, reused = run(model, tok, other, cache)
    assert reused == 50 and text == run(model, tok, other)[0]
    pool.give(cache)
    assert pool.stats()["forks"] == 1 and pool.stats()["entries"] == 2
    follow = before + ids(4, 5)  # the first conversation goes on: its entry is whole
    cache = pool.take(follow)
    assert cache is held
    text, reused = run(model, tok, follow, cache)
    assert reused == len(before) and text == run(model, tok, follow)[0]


@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("drop", [0, 3, 12, 20])
def test_a_copied_context_equals_the_context_trimmed(window, drop):
    import mlx.core as mx

    from dflash_mlx.model.context import ContextCache
    from dflash_mlx.server.prompt_cache import _context_prefix

    c = ContextCache(window)
    for n in (7, 6, 7):  # 20 rows [1, n_kv, n, head_dim]
        c.append(mx.random.normal((1, 2, n, 4)), mx.random.normal((1, 2, n, 4)))
    copied = _context_prefix(c, drop)
    trimmed = ContextCache.load_state(*c.save_state())
    trimmed.trim(drop)
    assert copied.offset == trimmed.offset == 20 - drop and c.offset == 20
    assert copied.size == trimmed.size
    for a, b in zip(copied.held(), trimmed.held()):
        assert (a is None and b is None) or mx.array_equal(a, b).item()


def test_a_hybrid_targets_entries_restore_exactly(pairs):
    model, tok = pairs("qwen3_5", "d2")
    pool = PromptPool(model, 10**9)
    system = ids(1, 40)
    filled(pool, model, tok, system + ids(2, 6))  # checkpoint after the prompt: 46 tokens
    for follow in (system + ids(2, 6) + ids(3, 5), system + ids(4, 6)):
        cache = pool.take(follow)
        expect = cache.usable(follow)
        text, reused = run(model, tok, follow, cache)
        assert reused == expect
        assert text == run(model, tok, follow)[0]
        pool.give(cache)
    # the first follow-up extends the checkpointed prompt; the branch goes back to nothing
    # (a recurrent state cannot drop tokens past its checkpoint)
    assert pool.stats()["cached_tokens"] == 46


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_the_disk_tier_restores_an_evicted_entry_exactly(pairs, tmp_path, kind):
    model, tok = pairs(kind, "d2")
    prompt = ids(1, 40)
    pool = PromptPool(model, 0, DiskTier.open(str(tmp_path), model))  # evicted at once
    filled(pool, model, tok, prompt)
    assert pool.stats()["disk"]["entries"] == 1 and pool.stats()["entries"] == 0
    # a new server process: a fresh tier over the same folder finds the entry
    again = PromptPool(model, 10**9, DiskTier.open(str(tmp_path), model))
    follow = prompt + ids(2, 5)
    cache = again.take(follow)
    assert cache.usable(follow) == 40
    text, reused = run(model, tok, follow, cache)
    assert reused == 40 and text == run(model, tok, follow)[0]
    assert again.stats()["disk"]["restored"] == 1


def test_closing_the_pool_writes_its_entries_to_disk(pairs, tmp_path):
    model, tok = pairs("qwen3", "d2")
    pool = PromptPool(model, 10**9, DiskTier.open(str(tmp_path), model))
    filled(pool, model, tok, ids(1, 30))
    filled(pool, model, tok, ids(2, 30))
    assert pool.stats()["disk"]["entries"] == 0  # nothing evicted yet
    pool.close()  # the server stopping
    again = PromptPool(model, 10**9, DiskTier.open(str(tmp_path), model))
    assert again.stats()["disk"]["entries"] == 2
    assert filled(again, model, tok, ids(2, 30) + [11]) == 30


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """The tiny qwen3 target with head_dim 32 (16 is below mlx-lm's group sizes), loaded
    with a drafter."""
    from tiny_models import build_drafter, build_target

    from dflash_mlx import load

    root = tmp_path_factory.mktemp("wide")
    build_target(root / "qwen3", "qwen3", hidden=128)
    build_drafter(root / "d", root / "qwen3", block_size=16)
    return load(str(root / "qwen3"), drafter=str(root / "d"))


def test_the_disk_tier_restores_a_quantized_kv_cache_exactly(wide, tmp_path):
    from mlx_lm.models.cache import QuantizedKVCache

    model, tok = wide
    kv = {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 0}
    prompt, follow = ids(1, 40), ids(1, 40) + ids(2, 5)
    pool = PromptPool(model, 0, DiskTier.open(str(tmp_path), model))
    cache = pool.take(prompt)
    list(stream_generate(model, tok, prompt, prompt_cache=cache, **GREEDY, **kv))
    assert all(isinstance(c, QuantizedKVCache) for c in cache.target)
    pool.give(cache)
    again = PromptPool(model, 10**9, DiskTier.open(str(tmp_path), model))
    cache = again.take(follow)
    assert all(isinstance(c, QuantizedKVCache) for c in cache.target)
    out = list(stream_generate(model, tok, follow, prompt_cache=cache, **GREEDY, **kv))
    fresh = list(stream_generate(model, tok, follow, **GREEDY, **kv))
    assert out[-1].prompt_tokens - out[-1].prompt_processed == 40
    assert "".join(r.text for r in out) == "".join(r.text for r in fresh)


def test_a_branch_of_a_quantized_kv_cache_gets_an_exact_copy(wide):
    model, tok = wide
    kv = {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 0}
    pool = PromptPool(model, 10**9, fork_min=16)
    cache = pool.take(ids(1, 60))
    list(stream_generate(model, tok, ids(1, 60), prompt_cache=cache, **GREEDY, **kv))
    pool.give(cache)
    branch = ids(1, 30) + ids(5, 6)
    copied = pool.take(branch)
    assert copied is not cache and pool.stats()["forks"] == 1
    out = list(stream_generate(model, tok, branch, prompt_cache=copied, **GREEDY, **kv))
    fresh = list(stream_generate(model, tok, branch, **GREEDY, **kv))
    assert out[-1].prompt_tokens - out[-1].prompt_processed == 30
    assert "".join(r.text for r in out) == "".join(r.text for r in fresh)


def _saved_entry(model, tok, tmp_path):
    pool = PromptPool(model, 0, DiskTier.open(str(tmp_path), model))
    filled(pool, model, tok, ids(1, 40))
    (entry,) = pool.disk.folder.glob("e-*")
    return entry


def test_a_corrupt_disk_entry_is_removed_not_used(pairs, tmp_path):
    model, tok = pairs("qwen3", "d2")
    entry = _saved_entry(model, tok, tmp_path)
    f = entry / "target.safetensors"
    data = bytearray(f.read_bytes())
    data[-8:] = b"\xff" * 8  # same size, other bytes: the manifest's CRC-32 tells
    f.write_bytes(bytes(data))
    pool = PromptPool(model, 10**9, DiskTier.open(str(tmp_path), model))
    cache = pool.take(ids(1, 40) + [11])
    assert cache.tokens == [] and not entry.exists()
    assert pool.stats()["disk"] == {
        "entries": 0,
        "bytes": 0,
        "restored": 0,
        "saved": 0,
        "removed_damaged": 1,
        "writable": True,
    }


def test_a_foreign_or_unsealed_disk_entry_is_removed(pairs, tmp_path):
    model, tok = pairs("qwen3", "d2")
    entry = _saved_entry(model, tok, tmp_path)
    manifest = entry / "manifest.json"
    obj = json.loads(manifest.read_text())
    obj["versions"]["mlx_lm"] = "0.0.1"  # made by another mlx-lm
    manifest.write_text(json.dumps(obj))
    stray = entry.parent / "e-stray"  # a half-written entry: no manifest
    stray.mkdir()
    (stray / "meta.json").write_text("{")
    pool = PromptPool(model, 10**9, DiskTier.open(str(tmp_path), model))
    assert not stray.exists()
    assert pool.take(ids(1, 40) + [11]).tokens == [] and not entry.exists()


def test_the_batched_worker_takes_from_the_pool_and_gives_back(pairs):
    model, tok = pairs("qwen3", "d2")
    engine = Engine(model, tok, max_batch=4, cache_bytes=10**9)
    assert engine.max_batch == 4
    worker = threading.Thread(target=engine.run)
    worker.start()
    system = ids(1, 60)
    cfg = GenerationConfig(max_tokens=8, logit_bias={EOS: -100})
    try:
        results = []
        for tail in (ids(2, 4), ids(3, 4)):  # one after the other: the second reuses
            job = Job(system + tail, cfg)
            assert engine.submit(job)
            items = []
            while (item := job.out.get(timeout=60))[0] != "end":
                items.append(item)
            results.append(items)
    finally:
        engine.stop()
        worker.join(60)
    first, second = ([r for tag, r in items if tag == "data"] for items in results)
    assert first[-1].prompt_tokens - first[-1].prompt_processed == 0
    assert second[-1].prompt_tokens - second[-1].prompt_processed == 60
    expect = run(model, tok, system + ids(3, 4))[0][: len("".join(r.text for r in second))]
    assert "".join(r.text for r in second) == expect
    stats = engine.pool.stats()
    assert stats["hits"] == 1 and stats["cached_tokens"] == 60 and stats["in_use"] == 0
    assert stats["entries"] == 1  # the first prompt's entry, trimmed and refilled


def _refused(args: list[str], flag: str) -> None:
    from dflash_mlx.cli import app

    r = CliRunner().invoke(app, ["serve", "--model", "demo", *args])
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and flag in lines[0]
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("value", ["-1", "abc", "nan"])
def test_a_bad_prompt_cache_gb_is_one_error_line_and_exit_2(value):
    _refused(["--prompt-cache-gb", value], "--prompt-cache-gb")


def test_a_prompt_cache_dir_that_is_a_file_is_one_error_line_and_exit_2(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    _refused(["--prompt-cache-dir", str(f)], "--prompt-cache-dir")


def test_common_prefix_counts_shared_tokens_across_slice_boundaries():
    import random

    from dflash_mlx.decoding.state import common_prefix

    rng = random.Random(0)
    for _ in range(500):
        a = [rng.randint(0, 2) for _ in range(rng.randint(0, 700))]
        b = a[: rng.randint(0, len(a))] + [rng.randint(0, 2) for _ in range(rng.randint(0, 600))]
        limit = rng.randint(0, 900)
        want = 0
        while want < min(len(a), len(b), limit) and a[want] == b[want]:
            want += 1
        assert common_prefix(a, b, limit) == want
