"""Draft vocabulary: the drafter scores a subset of the target's vocabulary; output stays
exactly the target's (greedy parity, sampling law), including tokens outside the subset."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from laws import draw, exact_law, tv
from mlx import nn
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.utils import load_model
from oracle import OracleDrafter
from references import reference, run
from tiny_models import build_target, eight_token_pair

from dflash_mlx.decoding.acceptance import SamplingParams
from dflash_mlx.decoding.propose import propose
from dflash_mlx.errors import DFlashError
from dflash_mlx.loading.loader import set_draft_vocab
from dflash_mlx.model.checkpoint import load_drafter, save_drafter
from dflash_mlx.model.draft_vocab import DraftHead, ranked_vocab
from dflash_mlx.model.target import TargetAdapter


def subset(vocab: int, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(vocab, n, replace=False)).astype(np.int32)


@pytest.fixture
def with_vocab(pairs):
    """A loaded tiny pair with a random draft vocabulary, restored afterwards."""
    made = []

    def get(kind, drafter, n=96, seed=0):
        model, tok = pairs(kind, drafter)
        made.append(model)
        model.draft_head = DraftHead(model.adapter, subset(model.adapter.vocab_size, n, seed))
        return model, tok

    yield get
    for m in made:
        m.draft_head = None


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("drafter", ["d2", "d1"])
@pytest.mark.parametrize("block", [4, 16])
def test_greedy_with_a_draft_vocab_matches_mlx_lm(with_vocab, kind, drafter, block):
    model, tok = with_vocab(kind, drafter)
    ids = tok.encode("def parse_args(")
    for selector in (True, False):
        got, _ = run(model, ids, 48, block, selector)
        assert got == reference(model, ids, 48)


@pytest.mark.parametrize("selector", [True, False])
def test_greedy_with_a_draft_vocab_accepts_in_vocab_tokens_and_rejects_the_rest(
    with_vocab, selector
):
    model, tok = with_vocab("qwen3", "d2", n=64, seed=3)
    ids = tok.encode("import os\nfor i in")
    ref = reference(model, ids, 80)
    real = model.drafter
    model.drafter = OracleDrafter(real, ids + ref)
    try:
        got, stats = run(model, ids, 64, 8, selector)
    finally:
        model.drafter = real
    assert got == ref[:64]
    vocab = set(np.array(model.draft_head.ids).tolist())
    outside = sum(t not in vocab for t in ref[:64])
    assert 0 < outside < 64  # the continuation really leaves the draft vocabulary
    assert sum(a for a, _ in stats) > 0  # in-vocabulary drafts were accepted
    assert sum(a for a, _ in stats) < sum(d for _, d in stats)  # the others were not


def test_sampled_proposals_are_zero_outside_the_draft_vocab(with_vocab):
    model, _ = with_vocab("qwen3", "d2", n=40, seed=1)
    H = model.drafter.args.hidden_size
    hidden = mx.random.normal((1, 7, H))
    logits = model.draft_logits(hidden)
    assert logits.shape[-1] == 40
    vocab = np.array(model.draft_head.ids)
    outside = np.setdiff1d(np.arange(model.adapter.vocab_size), vocab)
    params = SamplingParams(temperature=0.8)
    for selector in (True, False):
        drafts, q = propose(
            model, logits, hidden, mx.array([5]), params, selector, mx.random.key(2)
        )
        q = np.array(q)
        assert q.shape == (7, model.adapter.vocab_size)
        assert np.allclose(q.sum(-1), 1.0, atol=1e-5)
        assert np.all(q[:, outside] == 0)
        d = np.array(drafts)
        assert np.isin(d, vocab).all()
        assert np.all(q[np.arange(7), d] > 0)  # each draft has its own proposal mass


def test_selector_codebooks_are_read_at_target_ids(pairs):
    """Subset logits mapped to target ids choose exactly what full-vocabulary logits that
    are -inf outside the subset choose: the codebook rows used are the target ids'."""
    model, _ = pairs("qwen3", "d2")
    sel = model.drafter.candidate_selector
    V, H = model.adapter.vocab_size, model.drafter.args.hidden_size
    ids = subset(V, 50, seed=4)
    head = DraftHead(model.adapter, ids)
    hidden = mx.random.normal((2, 7, H), key=mx.random.key(9))
    sub_logits = model.drafter.logits(hidden, head)  # [2, 7, 50]
    cols = mx.broadcast_to(mx.array(ids), sub_logits.shape)
    full = mx.put_along_axis(mx.full((2, 7, V), -1e9), cols, sub_logits, axis=-1)
    anchor = mx.array([7, 11])
    for T, u in ((0.0, None), (0.9, mx.random.uniform(shape=(2, 7), key=mx.random.key(3)))):
        t_sub, c_sub, q_sub, _ = sel(sub_logits, hidden, anchor, 16, T, u, head.ids)
        t_full, c_full, q_full, _ = sel(full, hidden, anchor, 16, T, u)
        assert np.array_equal(np.array(c_sub), np.array(c_full))
        assert np.array_equal(np.array(t_sub), np.array(t_full))
        assert np.isin(np.array(t_sub), ids).all()
        if q_sub is not None:
            assert np.allclose(np.array(q_sub), np.array(q_full), atol=1e-5)
    # and the codebooks do matter here: a different id map changes the lattice scores
    assert float(mx.abs(sel.predecessor_codebook).sum()) > 0


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    model = eight_token_pair(tmp_path_factory.mktemp("v8dv"))
    model.draft_head = DraftHead(model.adapter, np.array([0, 2, 3, 5, 6], np.int32))
    return model


@pytest.mark.parametrize(
    "selector,temp,top_k,presence",
    [(True, 1.0, 0, 0.0), (True, 0.8, 5, 1.0), (False, 0.9, 0, 0.0)],
)
def test_sampling_law_is_exact_with_a_draft_vocab(
    small_vocab_pair, selector, temp, top_k, presence
):
    model = small_vocab_pair
    prompt = [2, 5, 1, 7]
    n, trials = 4, 1000
    law = exact_law(model, prompt, n, temp, 1.0, top_k, presence)
    procs = make_logits_processors(presence_penalty=presence or None)
    params = SamplingParams(temp, 1.0, 0.0, top_k, procs)
    samples, accepted = draw(model, prompt, params, n, trials, selector, 13)
    assert accepted > trials // 4
    outside = {1, 4, 7}
    for pos in range(1, n):
        exact = np.zeros(8)
        for seq, pr in law.items():
            exact[seq[pos]] += pr
        emp = np.bincount([s[pos] for s in samples], minlength=8) / trials
        assert tv(emp, exact) < 0.07, (pos, emp, exact)
    # the target's own tokens outside the draft vocabulary are drawn at their rate too
    p_out = sum(pr for seq, pr in law.items() if seq[2] in outside)
    emp_out = sum(s[2] in outside for s in samples) / trials
    assert p_out > 0.05 and abs(emp_out - p_out) < 0.05


def test_checkpoint_round_trips_its_draft_vocab(tmp_path, pairs):
    model, _ = pairs("qwen3", "d2")
    src = model.drafter_path
    config = json.loads((Path(src) / "config.json").read_text())
    ids = subset(config["vocab_size"], 77, seed=6)
    save_drafter(tmp_path / "d", model.drafter, config, draft_vocab=ids)
    saved = json.loads((tmp_path / "d" / "config.json").read_text())
    assert saved["dflash_config"]["draft_vocab_size"] == 77
    back = load_drafter(tmp_path / "d")
    assert np.array_equal(back.draft_vocab, ids)
    assert "draft_vocab_size" not in config["dflash_config"]  # the caller's dict is untouched
    plain = load_drafter(src)
    assert plain.draft_vocab is None  # a checkpoint without one loads as before


@pytest.mark.parametrize(
    "ids,size,msg",
    [
        ([5, 3, 9], None, "sorted"),
        ([1, 2, 10**6], None, "outside the vocabulary"),
        ([1, 2, 3], 4, "disagree"),
        (None, 4, "no draft_vocab tensor"),
    ],
)
def test_a_bad_draft_vocab_is_one_clear_error(tmp_path, pairs, ids, size, msg):
    model, _ = pairs("qwen3", "d2")
    config = json.loads((Path(model.drafter_path) / "config.json").read_text())
    save_drafter(tmp_path, model.drafter, config)
    w = dict(mx.load(str(tmp_path / "model.safetensors")))
    if ids is not None:
        w["draft_vocab"] = mx.array(np.array(ids, np.int32))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), w)
    if size is not None:
        config["dflash_config"]["draft_vocab_size"] = size
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(DFlashError, match=msg):
        load_drafter(tmp_path)


def test_ranked_vocab_keeps_the_lowest_ids_and_every_special_token(pairs):
    model, tok = pairs("qwen3", "d2")
    V = model.adapter.vocab_size
    ids = ranked_vocab(tok, 64, V)
    assert len(ids) == 64 and np.all(np.diff(ids) > 0)
    specials = set(tok.all_special_ids) | set(tok.eos_token_ids)
    assert specials <= set(ids.tolist())
    assert set(range(64 - len(specials))) <= set(ids.tolist())
    with pytest.raises(DFlashError, match="too small"):
        ranked_vocab(tok, 4, V)


def test_load_option_sets_replaces_and_clears_the_draft_head(pairs):
    model, tok = pairs("qwen3", "d2")
    try:
        set_draft_vocab(model, tok, 64)
        assert model.draft_head.size == 64
        set_draft_vocab(model, tok, 0)
        assert model.draft_head is None  # 0: the full vocabulary
        with pytest.raises(DFlashError, match="draft_vocab"):
            set_draft_vocab(model, tok, -3)
    finally:
        model.draft_head = None


def test_quantized_head_rows_equal_the_full_head_columns(tmp_path):
    build_target(tmp_path / "t", "qwen3", vocab_size=320)
    target = load_model(tmp_path / "t")[0]
    nn.quantize(target, group_size=32, bits=4)
    adapter = TargetAdapter(target, [1])
    ids = subset(adapter.vocab_size, 33, seed=2)
    head = DraftHead(adapter, ids)
    assert head._quant is not None  # the quantized path, not the fallback
    h = mx.random.normal((2, 3, adapter.hidden_size))
    want = adapter.lm_head(h)[..., mx.array(ids)]
    assert mx.allclose(head(h), want, atol=1e-4).item()


def test_calibrated_vocab_ranks_answer_tokens_before_merge_ranks(pairs):
    from dflash_mlx.model.draft_vocab import calibrated_vocab

    model, tok = pairs("qwen3", "d2")
    V = model.adapter.vocab_size
    counts = np.zeros(V, np.int64)
    counts[[300, 250, 200]] = [5, 9, 1]  # high ids the merge ranks would leave out
    ids = calibrated_vocab(counts, 40, tok, V)
    assert len(ids) == 40 and np.all(np.diff(ids) > 0)
    assert {200, 250, 300} <= set(ids.tolist())
    assert set(tok.eos_token_ids) <= set(ids.tolist())
    assert set(calibrated_vocab(counts, 2, tok, V).tolist()) <= set(tok.all_special_ids) | {250}
