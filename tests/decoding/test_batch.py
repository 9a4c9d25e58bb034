"""Batched decoding is lossless per row: each row's greedy tokens equal its tokens alone."""

import mlx.core as mx
import pytest
from oracle import BatchOracle
from references import reference

from dflash_mlx.decoding.acceptance import SamplingParams
from dflash_mlx.decoding.batch import BatchDecoder, Row

PROMPTS = ["def parse_args(", "import os\nfor i in", "x", "class Foo:\n    def __init__(self"]


def drive(
    model, prompts, n, block, *, joins=None, blocks=None, params=None, log=None, setup=None,
    lookup=True, cycles=None,
):  # fmt: skip
    """Decode prompts in one batch; row i joins before cycle joins[i]; returns tokens per row.
    ``log`` collects each cycle's accepted counts, row by row; ``setup(decoder)`` runs first;
    ``cycles`` collects each batch cycle's [(row, Cycle)]."""
    dec = BatchDecoder(model, block)
    if setup:
        setup(dec)
    joins = joins or [0] * len(prompts)
    out = {i: [] for i in range(len(prompts))}
    cycle, pending = 0, list(range(len(prompts)))
    while pending or len(dec) or dec.joining:
        for i in [i for i in pending if joins[i] <= cycle]:
            pending.remove(i)
            p = params[i] if params else SamplingParams()
            b = blocks[i] if blocks else None
            dec.join(Row(i, prompts[i], p, n, b, True, mx.random.key(i), lookup))
        got = dec.prefill_step()
        if got:
            out[got[0].uid] += got[1].tokens
        step = dec.step()
        if cycles is not None and step:
            cycles.append(step)
        if log is not None and step:
            log.append([c.accepted for _, c in step])
        for row, cyc in step:
            out[row.uid] += cyc.tokens
            if row.generated >= n:
                dec.remove(row.uid)
        cycle += 1
    return {i: t[:n] for i, t in out.items()}


@pytest.mark.parametrize(
    "kind, block", [("qwen3", 1), ("qwen3", 4), ("qwen3", 16), ("qwen3_5", 4), ("qwen3_5", 16)]
)
def test_batch_greedy_equals_mlx_lm_per_row(pairs, kind, block):
    """qwen3_5 is a hybrid: its rows' recurrent states are rewound each by its own count."""
    model, tok = pairs(kind, "d2")
    ids = [tok.encode(p) for p in PROMPTS]
    got = drive(model, ids, 40, block, joins=[0, 0, 3, 7])
    for i, p in enumerate(ids):
        assert got[i] == reference(model, p, 40)


@pytest.mark.parametrize("block", [4, 8])
def test_batch_rows_verify_copied_drafts_and_stay_exact(pairs, block, monkeypatch):
    """Rows whose context has a match verify drafts copied from it (the random target
    loops); each row's tokens still equal mlx-lm's, with copies on or off. A cycle in which
    every drafting row copies runs no drafter pass."""
    model, tok = pairs("qwen3", "d2")
    ids = [tok.encode(p) for p in PROMPTS]
    real, passes = type(model.drafter).__call__, []

    def counted(self, *a, **k):
        passes.append(1)
        return real(self, *a, **k)

    monkeypatch.setattr(type(model.drafter), "__call__", counted)
    for lookup in (True, False):
        steps, passes[:] = [], []
        got = drive(model, ids, 48, block, joins=[0, 0, 2, 5], lookup=lookup, cycles=steps)
        for i, p in enumerate(ids):
            assert got[i] == reference(model, p, 48)
        copied = sum(c.lookup > 0 for st in steps for _, c in st)
        assert (copied > 0) == lookup
        drafting = sum(any(c.drafted and not c.lookup for _, c in st) for st in steps)
        assert len(passes) == drafting
        if lookup:
            assert drafting < len(steps)  # some cycles copied in every row: no drafter pass


@pytest.mark.parametrize("block", [4, 8, 16])
def test_rows_rolled_back_by_their_own_counts_stay_exact(pairs, block):
    """Rows accept different counts in the same cycle (an oracle drafter, wrong at a
    different block row per request); every row still commits exactly mlx-lm's tokens."""
    model, tok = pairs("qwen3", "d2")
    ids = [tok.encode(p) for p in PROMPTS]
    refs = [reference(model, p, 80) for p in ids]
    wrong = {0: (), 1: (2,), 2: (3, 5), 3: (1,)}
    real, log = model.drafter, []
    seqs = [p + r for p, r in zip(ids, refs)]

    def setup(dec):
        model.drafter = BatchOracle(real, dec, seqs, wrong)

    try:
        got = drive(model, ids, 64, block, joins=[0, 1, 1, 5], log=log, setup=setup)
    finally:
        model.drafter = real
    for i in range(len(ids)):
        assert got[i] == refs[i][:64]
    assert any(len(set(acc)) > 1 for acc in log)  # rows did roll back by different counts
    assert max(max(acc) for acc in log) == block - 1  # row 0 had full blocks accepted


def test_rows_with_their_own_blocks_and_penalties_match_their_solo_decode(pairs):
    """Per-row block sizes (1, 2, 8, auto) and a repetition penalty on one row: each row
    equals the single-row loop's output with the same settings."""
    from mlx_lm.sample_utils import make_logits_processors

    from dflash_mlx.decoding.loop import DecodeOptions, decode

    model, tok = pairs("qwen3", "d1")
    ids = [tok.encode(p) for p in PROMPTS]
    params = [SamplingParams() for _ in ids]
    params[2] = SamplingParams(processors=make_logits_processors(repetition_penalty=1.3))
    blocks = [1, 2, 8, None]
    got = drive(model, ids, 48, 16, blocks=blocks, params=params, joins=[0, 2, 2, 4])
    for i, p in enumerate(ids):
        solo = []
        for c in decode(
            model,
            p,
            model.make_cache(),
            params[i],
            DecodeOptions(max_tokens=48, block_size=blocks[i] or 16),
        ):
            solo += c.tokens
        assert got[i] == solo[:48]


def test_a_joining_prompt_is_prefilled_one_chunk_per_cycle(pairs):
    """A long prompt joins a running row: each step runs at most one prefill chunk, the
    running row commits every step meanwhile, and both stay exact."""
    model, tok = pairs("qwen3", "d2")
    short, long = tok.encode(PROMPTS[0]), tok.encode(PROMPTS[3] * 6)
    dec = BatchDecoder(model, 4, prefill_step_size=8)
    dec.join(Row(0, short, SamplingParams(), 40, None, True, mx.random.key(0)))
    out = {0: [], 1: []}
    while not dec.rows:
        got = dec.prefill_step()
        out[0] += got[1].tokens if got else []
    dec.join(Row(1, long, SamplingParams(), 20, None, True, mx.random.key(1)))
    seen = []
    while dec.joining:
        got = dec.prefill_step()
        seen.append(dec.joining[0][0].prefilled if dec.joining else len(long))
        if got:
            out[1] += got[1].tokens
        for row, cyc in dec.step():
            out[row.uid] += cyc.tokens
    assert len(seen) == -(-len(long) // 8) > 2  # one chunk of 8 per cycle
    assert all(b - a <= 8 for a, b in zip([0] + seen, seen))
    while dec.rows:
        for row, cyc in dec.step():
            out[row.uid] += cyc.tokens
            if row.generated >= row.max_tokens:
                dec.remove(row.uid)
    assert out[0][:40] == reference(model, short, 40)
    assert out[1][:20] == reference(model, long, 20)


def test_batch_with_a_draft_vocab_equals_mlx_lm_per_row(pairs):
    import numpy as np

    from dflash_mlx.model.draft_vocab import DraftHead

    model, tok = pairs("qwen3", "d2")
    V = model.adapter.vocab_size
    ids_v = np.sort(np.random.default_rng(5).choice(V, 96, replace=False)).astype(np.int32)
    model.draft_head = DraftHead(model.adapter, ids_v)
    try:
        ids = [tok.encode(p) for p in PROMPTS]
        got = drive(model, ids, 32, 8, joins=[0, 1, 3, 4])
    finally:
        model.draft_head = None
    for i, p in enumerate(ids):
        assert got[i] == reference(model, p, 32)


def test_a_chunked_join_shows_its_processors_the_whole_prompt_first(pairs):
    """Stateful processors (a grammar) take the first call's tokens as the prompt: the
    earlier chunks of a chunked prefill must not reach them."""
    model, tok = pairs("qwen3", "d2")
    seen = []

    def proc(tokens, logits):
        seen.append(int(tokens.size))
        return logits

    ids = tok.encode("import os\nfor i in range(10):\n    print(i)")
    dec = BatchDecoder(model, 4, prefill_step_size=4)
    dec.join(Row(0, ids, SamplingParams(processors=[proc]), 6, None, True, mx.random.key(0)))
    while dec.joining:
        dec.prefill_step()
    assert len(ids) > 8 and seen[0] == len(ids)
