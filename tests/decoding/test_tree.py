"""Greedy tree verification (dflash_mlx/tree.py): each tree row's logits are its own path's,
the caches keep the committed path, and decoding with siblings is mlx-lm's greedy output."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from oracle import OracleDrafter

from dflash_mlx.decoding import tree
from dflash_mlx.decoding.acceptance import SamplingParams
from dflash_mlx.decoding.loop import DecodeOptions, decode
from dflash_mlx.decoding.schedule import CostTable, Scheduler
from dflash_mlx.decoding.steps import Cycle

PROMPT = "def parse_args("


def prefilled(model, ids):
    cache = model.adapter.make_cache()
    logits, _ = model.adapter(mx.array(ids)[None], cache)
    mx.eval(logits)
    return cache


def test_mask_shows_each_row_its_context_its_path_and_itself():
    got = np.array(tree.mask(2, 3, 5)).astype(int)
    want = [
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 0, 0, 1, 0],  # a sibling: the anchor and itself
        [1, 1, 1, 0, 0, 0, 1],
    ]
    assert got.tolist() == want


def greedy(targets, drafts, sibs):
    """``tree.commit`` fed as the greedy verify feeds it: the path's leading matches of the
    target's argmax at each row (anchor, path drafts, siblings), then the rows after."""
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return tree.commit(a, targets[a], drafts, sibs, targets[1 + len(drafts) :])


def test_accept_takes_the_path_then_a_sibling_then_the_target_token():
    # rows: anchor, path drafts 7, 8, siblings 5, 6
    assert greedy([7, 8, 9, 1, 2], [7, 8], [5, 6]) == (2, [7, 8, 9], [0, 1, 2], 0)
    assert greedy([7, 3, 9, 1, 2], [7, 8], [5, 6]) == (1, [7, 3], [0, 1], 0)
    assert greedy([6, 3, 9, 1, 4], [7, 8], [5, 6]) == (1, [6, 4], [0, 4], 2)
    assert greedy([5, 3, 9, 1, 4], [7, 8], [5, 6]) == (1, [5, 1], [0, 3], 1)
    assert greedy([4, 3, 9, 1, 2], [7, 8], [5, 6]) == (0, [4], [0], 0)


def test_siblings_are_the_best_first_tokens_other_than_the_path_s():
    logits = mx.array([0.0, 5.0, 3.0, 4.0, 1.0, 2.0])  # ranks: 1, 3, 2, 5, 4, 0

    def ident(i):
        return i.astype(mx.uint32)

    assert tree.siblings(logits, mx.array(1), 3, ident).tolist() == [3, 2, 5]
    assert tree.siblings(logits, mx.array(2), 3, ident).tolist() == [1, 3, 5]
    assert tree.siblings(logits, mx.array(0), 2, ident).tolist() == [1, 3]


def test_a_tiny_draft_vocabulary_has_fewer_siblings_than_asked():
    def ident(i):
        return i.astype(mx.uint32)

    two = mx.array([1.0, 3.0])  # a draft vocabulary of 2 ids has 1 sibling at most
    assert tree.siblings(two, mx.array(1), 3, ident).tolist() == [0]
    assert tree.siblings(two, mx.array(0), 1, ident).tolist() == [1]
    assert tree.siblings(mx.array([2.0]), mx.array(0), 3, ident).tolist() == []


@pytest.mark.parametrize("size", [1, 2, 3])
def test_trees_with_a_tiny_draft_vocabulary_decode_the_target_s_output(pairs, size):
    """A 2-id draft vocabulary with trees on used to fail in ``tree.siblings`` (top 4 of 2);
    now a cycle verifies at most V' - 1 siblings, says so, and greedy is still mlx-lm's."""
    from dflash_mlx import generate
    from dflash_mlx.model.draft_vocab import DraftHead

    model, tok = pairs("qwen3", "d2")
    ids = tok.encode(PROMPT)
    ref = [t for t, _ in generate_step(mx.array(ids), model.target, max_tokens=40)]
    model.draft_head = DraftHead(model.adapter, np.arange(5, 5 + size, dtype=np.int32))
    try:
        assert model.draft_size == size
        for block in (4, 8):
            out = list(
                decode(
                    model,
                    ids,
                    model.make_cache(),
                    SamplingParams(),
                    DecodeOptions(max_tokens=40, block_size=block, lookup=False),
                )
            )
            assert [t for c in out for t in c.tokens][:40] == ref[:40]
            assert max(c.siblings for c in out) == min(size - 1, tree.siblings_for(block))
        kw = {"max_tokens": 24, "block_size": 8, "raw": True}
        assert generate(model, tok, PROMPT, temperature=1.0, seed=1, **kw)  # sampled trees
        assert generate(model, tok, PROMPT, **kw) == generate(model, tok, PROMPT, tree=False, **kw)
    finally:
        model.draft_head = None


def test_tree_rows_equal_their_paths_run_alone(pairs):
    model, tok = pairs("qwen3", "d2")
    ad, ids = model.adapter, tok.encode(PROMPT)
    assert ad.tree_ok
    anchor, path, sibs = 11, [12, 13, 14], [15, 16]
    got, feats = ad(mx.array([anchor] + path + sibs)[None], prefilled(model, ids), chain=4)
    want, wfeats = ad(mx.array([anchor] + path)[None], prefilled(model, ids))
    assert np.allclose(np.array(got[0, :4]), np.array(want[0]), atol=1e-5)
    assert np.allclose(np.array(feats[0, :4]), np.array(wfeats[0]), atol=1e-5)
    for j, s in enumerate(sibs):
        alone, _ = ad(mx.array([anchor, s])[None], prefilled(model, ids))
        assert np.allclose(np.array(got[0, 4 + j]), np.array(alone[0, 1]), atol=1e-5)


@pytest.mark.parametrize("rows", [[0, 4], [0, 5], [0, 1, 2]])
def test_keep_rows_leaves_the_caches_of_the_committed_path(pairs, rows):
    model, tok = pairs("qwen3", "d2")
    ad, ids = model.adapter, tok.encode(PROMPT)
    fed = [11, 12, 13, 14, 15, 16]  # anchor, path 12 13 14, siblings 15 16
    cache = prefilled(model, ids)
    mx.eval(ad(mx.array(fed)[None], cache, chain=4)[0])
    ad.keep_rows(cache, len(fed), rows)
    assert all(c.offset == len(ids) + len(rows) for c in cache)
    nxt, _ = ad(mx.array([20, 21])[None], cache)
    plain = prefilled(model, ids + [fed[r] for r in rows])
    want, _ = ad(mx.array([20, 21])[None], plain)
    assert np.allclose(np.array(nxt), np.array(want), atol=1e-5)


def test_keep_rows_moves_rows_in_place_without_copying_the_context(pairs):
    # A sibling taken at a long context once copied every layer's whole K/V buffer
    # (~45 ms a cycle at 7,000 tokens on the demo target): a buffer written in the graph
    # that also reads it is not updated in place.
    model, tok = pairs("qwen3", "d2")
    ad, ids = model.adapter, tok.encode(PROMPT) * 40  # a context worth copying
    fed = [11, 12, 13, 14, 15, 16]
    cache = prefilled(model, ids)
    mx.eval(ad(mx.array(fed)[None], cache, chain=4)[0])
    held = sum(c.keys.nbytes + c.values.nbytes for c in cache)
    mx.eval([c.keys for c in cache], [c.values for c in cache])
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    ad.keep_rows(cache, len(fed), [0, 4])
    mx.eval([c.keys for c in cache], [c.values for c in cache])
    assert mx.get_peak_memory() - before < held / 8  # the moved rows, not the buffers
    nxt, _ = ad(mx.array([20])[None], cache)
    want, _ = ad(mx.array([20])[None], prefilled(model, ids + [11, 15]))
    assert np.allclose(np.array(nxt), np.array(want), atol=1e-5)


def run(model, ids, n, block, selector=True, tree_on=True, drafter=None):
    real, out, taken, cycles = model.drafter, [], 0, 0
    model.drafter = drafter or real
    try:
        for c in decode(
            model,
            ids,
            model.make_cache(),
            SamplingParams(),
            DecodeOptions(
                max_tokens=n, block_size=block, use_selector=selector, lookup=False, tree=tree_on
            ),
        ):
            out += c.tokens
            taken += c.sibling > 0
            cycles += c.drafted > 0
    finally:
        model.drafter = real
    return out[:n], taken, cycles


@pytest.mark.parametrize("block", [4, 8])
@pytest.mark.parametrize("selector", [True, False])
def test_greedy_tree_commits_siblings_and_matches_mlx_lm(pairs, block, selector):
    model, tok = pairs("qwen3", "d2")
    ids = tok.encode(PROMPT)
    ref = [t for t, _ in generate_step(mx.array(ids), model.target, max_tokens=64)]
    # the first draft is wrong, the target's token ranks second: the first sibling
    oracle = OracleDrafter(model.drafter, ids + ref + [0] * 20, second_at=(1,))
    got, taken, cycles = run(model, ids, 48, block, selector, drafter=oracle)
    assert got == ref[:48]
    assert taken >= cycles - 1 > 10  # every cycle but perhaps the last commits it
    got, taken, _ = run(model, ids, 48, block, selector, tree_on=False, drafter=oracle)
    assert got == ref[:48] and taken == 0


def test_no_tree_with_logits_processors_or_on_a_hybrid(pairs):
    from mlx_lm.sample_utils import make_logits_processors

    model, tok = pairs("qwen3", "d2")
    ids = tok.encode(PROMPT)
    kw = {"max_tokens": 24, "block_size": 8, "key": mx.random.key(1), "lookup": False}
    for params, trees in (
        (SamplingParams(temperature=0.8), True),
        (SamplingParams(processors=make_logits_processors(repetition_penalty=1.2)), False),
        (
            SamplingParams(
                temperature=0.8, processors=make_logits_processors(presence_penalty=0.5)
            ),
            False,
        ),
    ):
        cycles = list(decode(model, ids, model.make_cache(), params, DecodeOptions(**kw)))
        assert any(c.siblings for c in cycles) == trees  # the last, short blocks have none
    hybrid, _ = pairs("qwen3_5", "d2")
    assert not hybrid.adapter.tree_ok


class FirstFixed(OracleDrafter):
    """Puts a fixed token far on top of the first draft's row: its proposal is nearly a
    point mass there, so a rejected first draft leaves a residual the real drafter's next
    choice (the sibling) often draws from."""

    def __init__(self, real, token):
        super().__init__(real, [])
        self.token = token

    def logits(self, hidden, lm_head):
        real = self.real.logits(hidden, lm_head)
        return real + mx.zeros(real.shape).at[0, 0, self.token].add(30.0)


@pytest.mark.parametrize("selector,temp,top_p", [(True, 1.0, 1.0), (False, 0.8, 0.9)])
def test_sampled_trees_keep_the_target_law(tmp_path_factory, selector, temp, top_p):
    """Sampling through trees: the first token is the path's rule's draw, a sibling only
    extends the cycle by a draw from its own row; the joint law stays the target's."""
    from laws import assert_law, exact_law
    from tiny_models import eight_token_pair

    model = eight_token_pair(tmp_path_factory.mktemp("v8tree"))
    prompt, n, trials = [2, 5, 1, 7], 4, 1000
    law = exact_law(model, prompt, n, temp, top_p, 0, 0.0)
    params = SamplingParams(temp, top_p, 0.0, 0)
    key, samples, taken = mx.random.key(5), [], 0
    real, model.drafter = model.drafter, FirstFixed(model.drafter, 3)
    try:
        for _ in range(trials):
            key, sub = mx.random.split(key)
            out = []
            kw = {"block_size": 4, "use_selector": selector, "key": sub, "lookup": False}
            for c in decode(
                model, prompt, model.make_cache(), params, DecodeOptions(max_tokens=n, **kw)
            ):
                out += c.tokens
                taken += c.sibling > 0
            samples.append(tuple(out[:n]))
    finally:
        model.drafter = real
    assert taken > trials // 10  # siblings really were committed
    assert_law(samples, law, n, first=0)


def test_scheduler_verifies_siblings_only_when_they_pay_and_the_loop_can():
    costs = CostTable(8)
    for b in range(1, 9):
        costs.observe(b, 1.0 + 0.05 * b)  # a nearly flat verify: wide blocks are cheap
    sched = Scheduler(costs, [0.3] * 7, catch_prior=[0.3, 0.2, 0.1])
    assert sched.choose().siblings == 0  # the loop did not say it can verify a tree
    sched.tree = True
    choice = sched.choose()
    assert choice.siblings > 0 and choice.block - choice.siblings >= 2
    sched = Scheduler(costs, [0.3] * 7, catch_prior=[0.0, 0.0, 0.0])
    sched.tree = True
    assert sched.choose().siblings == 0  # siblings that never catch cost rows for nothing


def test_scheduler_learns_sibling_catches_by_rank():
    sched = Scheduler(CostTable(8), [0.3] * 7, catch_prior=[0.1, 0.1, 0.1])
    for _ in range(40):
        sched.record(
            8, Cycle([], accepted=1, siblings=3, sibling=2), 0.1
        )  # the second sibling catches
    r = sched.catches.rates()
    assert r[1] > 0.7 and r[0] < 0.05 and r[2] == pytest.approx(0.1)
    assert sched.acc.rates()[0] < 0.1  # the path's own first draft missed each time
