"""batch_generate / BatchGenerator: each completion equals its completion alone (greedy),
with its own settings, stop strings and statistics; aborted rows leave the others intact."""

from itertools import pairwise

import pytest

import dflash_mlx
from dflash_mlx import generate, load
from dflash_mlx.batching import BatchGenerator, BlockChooser, batch_generate
from dflash_mlx.errors import DFlashError
from dflash_mlx.settings import GenerationConfig

PROMPTS = ["def parse_args(", "import os\nfor i in", "x", "class Foo:\n    def __init__(self"]


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])  # qwen3_5: hybrid, one at a time
def test_batch_generate_texts_equal_generate_alone(pairs, kind):
    model, tok = pairs(kind, "d2")
    configs = [
        GenerationConfig(max_tokens=30, block_size=4),
        GenerationConfig(max_tokens=17, block_size=8, stop=["\n\n"]),
        GenerationConfig(max_tokens=25, block_size=2, repetition_penalty=1.2),
        GenerationConfig(max_tokens=30, block_size="auto"),
    ]
    out = batch_generate(model, tok, PROMPTS, configs=configs, max_batch=3, raw=True)
    for p, c, text, r in zip(PROMPTS, configs, out.texts, out.responses):
        assert text == generate(model, tok, p, config=c, raw=True)
        assert r.finish_reason in ("stop", "length") and r.generation_tokens <= c.max_tokens


def test_stop_strings_and_stats_are_per_row(pairs):
    model, tok = pairs("qwen3", "d2")
    alone = generate(model, tok, PROMPTS[0], max_tokens=40, raw=True)
    stop = alone[10:14]
    out = batch_generate(
        model,
        tok,
        PROMPTS[:2],
        configs=[GenerationConfig(max_tokens=40, stop=[stop]), None],
        max_tokens=40,
        raw=True,
    )
    assert out.texts[0] == alone[: alone.find(stop)]
    assert out.responses[0].finish_reason == "stop"
    assert out.texts[1] == generate(model, tok, PROMPTS[1], max_tokens=40, raw=True)
    assert out.responses[1].prompt_tokens == len(tok.encode(PROMPTS[1]))


def test_an_aborted_row_leaves_the_others_exact(pairs):
    model, tok = pairs("qwen3", "d2")
    gen = BatchGenerator(model, tok, max_batch=4)
    cfg = GenerationConfig(max_tokens=32, block_size=4)
    uids = [gen.insert(p, cfg, raw=True) for p in PROMPTS]
    texts = {u: "" for u in uids}
    steps = 0
    while len(gen):
        for uid, r in gen.step():
            texts[uid] += r.text
        steps += 1
        if steps == 6:
            gen.remove(uids[1])
    for u, p in zip(uids, PROMPTS):
        if u != uids[1]:
            assert texts[u] == generate(model, tok, p, config=cfg, raw=True)
    assert gen.occupancy == 0 and len(gen.decoder) == 0 and gen.decoder.target is None


def test_a_bad_setting_is_refused_before_anything_runs(pairs):
    model, tok = pairs("qwen3", "d2")
    with pytest.raises(DFlashError):
        batch_generate(model, tok, PROMPTS[:2], temperature=-1)


@pytest.mark.parametrize("fast", [1, 8])
def test_block_chooser_keeps_the_faster_block_and_reprobes_less_often(fast):
    ch, picks = BlockChooser(8), []
    for _ in range(120):
        b = ch.choose()
        picks.append(b)
        ch.record(b, 12 if b == fast else 4, 1.0)
    assert picks[:7] == [1] * 7 and picks[7] == 8  # plain first, the block tried at cycle 8
    slow = 8 if fast == 1 else 1
    probes = [i for i, b in enumerate(picks) if b == slow and i > 7]
    assert len(probes) >= 2 and picks[8:].count(fast) > 100
    gaps = [q - p for p, q in pairwise(probes)]
    assert all(g2 > g1 for g1, g2 in pairwise(gaps))  # probes ever rarer


@pytest.fixture(scope="module")
def demo():
    return load("demo", quiet=True)


def test_demo_chat_requests_batched_equal_their_solo_text(demo):
    model, tok = demo
    chats = [
        [{"role": "user", "content": q}]
        for q in (
            "What is a rainbow?",
            "Write a haiku about the sea.",
            "Name three prime numbers.",
            "How do I reverse a list in Python?",
        )
    ]
    out = batch_generate(model, tok, chats, max_tokens=48, block_size="auto")
    for chat, text in zip(chats, out.texts):
        assert text == generate(model, tok, chat, max_tokens=48)


def test_memory_returns_after_a_batch(pairs):
    import mlx.core as mx

    model, tok = pairs("qwen3", "d2")
    batch_generate(model, tok, PROMPTS, max_tokens=8, raw=True)  # warm
    mx.clear_cache()
    before = mx.get_active_memory()
    gen = BatchGenerator(model, tok, max_batch=4)
    for p in PROMPTS:
        gen.insert(p, max_tokens=40, raw=True)
    for _ in range(5):
        gen.step()
    assert gen.occupancy == 4
    for uid in range(4):
        gen.remove(uid)
    assert gen.decoder.target is None and gen.decoder.context is None
    mx.clear_cache()
    assert mx.get_active_memory() <= before + 1_000_000


def test_the_server_serves_a_hybrid_target_one_request_at_a_time(pairs):
    from dflash_mlx.server.worker import Engine

    assert Engine(*pairs("qwen3_5", "d2"), max_batch=8).max_batch == 1
    assert Engine(*pairs("qwen3", "d2"), max_batch=8).max_batch == 8


def test_batch_api_is_exported_from_the_package():
    assert dflash_mlx.batch_generate is batch_generate
    assert dflash_mlx.BatchGenerator is BatchGenerator
