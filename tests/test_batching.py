"""batch_generate / BatchGenerator: each completion equals its completion alone (greedy),
with its own settings, stop strings and statistics; aborted rows leave the others intact."""

import random
from itertools import pairwise
from types import SimpleNamespace

import pytest

import dflash_mlx
from dflash_mlx import generate, load
from dflash_mlx.batching import BatchGenerator, batch_generate
from dflash_mlx.decoding.batch_auto import BatchCosts, BatchPlanner, Option
from dflash_mlx.decoding.costs import CostTable
from dflash_mlx.decoding.schedule import Scheduler
from dflash_mlx.errors import DFlashError
from dflash_mlx.settings import GenerationConfig

PROMPTS = ["def parse_args(", "import os\nfor i in", "x", "class Foo:\n    def __init__(self"]


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])  # qwen3_5: a hybrid, batched too
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


def _rows(rates, budget=100):
    """Auto rows whose acceptance per position is ``rate`` (no context lookup)."""
    out = []
    for i, rate in enumerate(rates):
        sched = Scheduler(CostTable(8), [rate] * 7)
        sched.acc.weight = 1e6  # the rate, held firmly
        out.append(
            SimpleNamespace(
                uid=i, sched=sched, block=None, index=None, max_tokens=budget, generated=0
            )
        )
    return out


def _costs(head):
    """A batch whose verify costs 10 ms + 0.2 ms per row and token, and each drafting row's
    drafter head ``head`` seconds per draft position."""
    costs = BatchCosts({1: 0.011})
    for _ in range(60):  # observations of every kind teach the fit its four terms
        for rows, width, drafting in [(1, 1, 0), (4, 1, 0), (4, 8, 0), (4, 8, 4), (2, 4, 1)]:
            secs = 0.01 + 0.0002 * rows * width + head * drafting * (width - 1)
            costs.observe(rows, width, drafting, secs)
    return costs


def test_batch_costs_learn_a_verify_of_b_rows_by_k_tokens_is_not_b_verifies():
    costs = _costs(0.002)
    assert costs(8, 4, 8) == pytest.approx(0.01 + 0.0064 + 0.002 * 24, rel=0.05)  # unseen
    assert costs(4, 8, 4) < 4 * costs(1, 8, 1)


def test_planner_drafts_for_rows_that_accept_and_leaves_the_others_plain():
    planner = BatchPlanner(_costs(0.0005), 8)
    plan = planner.plan(_rows([0.9, 0.02, 0.9, 0.02]))
    assert [o.block > 1 for o in plan] == [True, False, True, False]
    assert max(o.block for o in plan) > 2  # the accepting rows use a deep block


@pytest.mark.parametrize("rate", [0.05, 0.2])
def test_planner_falls_back_to_plain_and_reprobes_ever_more_rarely(rate):
    """Drafting loses at either rate; at 0.2 it might win given the benefit of the doubt
    (probes, ever rarer), at 0.05 not even then (no probe)."""
    planner, rows = BatchPlanner(_costs(0.0005), 8), _rows([rate] * 4)
    widths = []
    for r in rows:
        r.sched.acc.weight = 8.0  # a prior's usual weight: doubt left to probe
    for _ in range(200):
        widths.append(max(o.block for o in planner.plan(rows)))
        planner.since_spec = 0 if widths[-1] > 1 else planner.since_spec + 1
    probes = [i for i, w in enumerate(widths) if w > 1]
    assert widths[:7] == [1] * 7 and (len(probes) >= 3) == (rate > 0.1)
    gaps = [q - p for p, q in pairwise(probes)]
    assert all(g2 > g1 for g1, g2 in pairwise(gaps))  # probes ever rarer


class _RandomPlanner:
    """Any plan at all: per row a random block 1..8 and copy flag, each cycle."""

    def __init__(self, seed):
        self.rng = random.Random(seed)

    def plan(self, rows):
        return [Option(self.rng.randint(1, 8), self.rng.random() < 0.5, 0.0) for _ in rows]

    def record(self, *_):
        pass

    def describe(self, *_):
        return "random"


def test_auto_rows_of_any_plan_equal_their_text_alone(pairs):
    """Rows plain, drafted and copied side by side at ragged widths, joining mid-batch
    (max_batch 3 of 4) with different budgets: each text is its text alone."""
    model, tok = pairs("qwen3", "d2")
    gen = BatchGenerator(model, tok, max_batch=3)
    budgets = [30, 12, 25, 30]
    uids = [gen.insert(p, max_tokens=m, raw=True) for p, m in zip(PROMPTS, budgets)]
    gen.planner = _RandomPlanner(0)
    texts = {u: "" for u in uids}
    while len(gen):
        for uid, r in gen.step():
            texts[uid] += r.text
    for u, p, m in zip(uids, PROMPTS, budgets):
        assert texts[u] == generate(model, tok, p, max_tokens=m, raw=True)


def test_an_auto_rows_response_says_its_batch_plan(pairs):
    model, tok = pairs("qwen3", "d2")
    out = batch_generate(model, tok, PROMPTS[:2], max_tokens=12, raw=True)
    for r in out.responses:
        assert r.schedule and r.schedule[0].startswith("step ")
        assert "batch of" in r.schedule[0] and sum(r.blocks.values()) == r.cycles


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


def test_the_server_batches_a_hybrid_target_as_an_attention_one(pairs):
    from dflash_mlx.server.worker import Engine

    assert Engine(*pairs("qwen3_5", "d2"), max_batch=8).max_batch == 8
    assert Engine(*pairs("qwen3", "d2"), max_batch=8).max_batch == 8
    assert BatchGenerator(*pairs("qwen3_5", "d2")).decoder is not None  # not one at a time


def test_batch_api_is_exported_from_the_package():
    assert dflash_mlx.batch_generate is batch_generate
    assert dflash_mlx.BatchGenerator is BatchGenerator
