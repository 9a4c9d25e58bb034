"""The thinking gate (decoding/thinking.py): the reasoning left free, its closing marker forced
when the budget runs out, a grammar only after it; exact under speculation (the sampling law
by enumeration on the 8-token pair, greedy parity with mlx-lm on a tiny thinking pair)."""

import mlx.core as mx
import numpy as np
import pytest
from laws import processed_law
from test_grammar import eight_processor

from dflash_mlx.decoding.acceptance import SamplingParams
from dflash_mlx.decoding.loop import DecodeOptions, decode
from dflash_mlx.decoding.thinking import ThinkingGate

OPEN, CLOSE = 5, 6  # 'f' and 'g' of the 8-token vocabulary; 7 ends the answer
PROMPT = [2, 5, 1, 7]


def _gate(started_open=True, budget=2, grammar=True):
    return ThinkingGate(OPEN, CLOSE, started_open, eight_processor() if grammar else None, budget)


def _row(gate, answer):
    """The processed row after PROMPT + answer (the gate's first call fixes the prompt)."""
    gate(mx.array(PROMPT), mx.zeros((1, 8)))
    out = gate(mx.array(PROMPT + answer), mx.zeros((1, 8)))
    return np.isfinite(np.array(out[0]))


def test_the_reasoning_is_free_until_the_budget_then_only_the_marker():
    assert _row(_gate(budget=3), [0, 7]).all()  # inside the reasoning: untouched
    assert list(np.flatnonzero(_row(_gate(budget=2), [0, 7]))) == [CLOSE]
    assert list(np.flatnonzero(_row(_gate(budget=0), []))) == [CLOSE]


def test_the_grammar_applies_after_the_marker_from_its_start():
    allowed = list(np.flatnonzero(_row(_gate(), [4, CLOSE])))
    assert allowed == [0, 1, 2]  # the grammar's first character: [abc]
    allowed = list(np.flatnonzero(_row(_gate(), [4, CLOSE, 0])))
    assert allowed == [2, 3, 4, 5]  # then [cdef]


def test_an_answer_that_may_open_the_reasoning_gets_the_grammar_or_the_marker():
    assert list(np.flatnonzero(_row(_gate(started_open=False), []))) == [0, 1, 2, OPEN]
    # no marker first: the grammar from the answer's start, and no reasoning budget
    assert list(np.flatnonzero(_row(_gate(started_open=False), [1]))) == [2, 3, 4, 5]
    assert _row(_gate(started_open=False, budget=1), [OPEN]).all()
    assert list(np.flatnonzero(_row(_gate(started_open=False, budget=1), [OPEN, 3]))) == [CLOSE]


def test_without_a_grammar_the_answer_after_the_marker_is_untouched():
    assert _row(_gate(grammar=False), [4, CLOSE, 0, 0, 0]).all()


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    from tiny_models import eight_token_pair

    return eight_token_pair(tmp_path_factory.mktemp("v8t"))


def gated_law(model, n, params, **kw):
    """Joint law of the first n tokens under a fresh gate per prefix, by enumeration."""
    return processed_law(model, PROMPT, n, params, lambda: _gate(**kw))


def test_sampling_through_the_gate_follows_the_gated_target_law(small_vocab_pair):
    started_open = False  # the first row: the grammar or the marker; then the budget
    model, temp, n, trials = small_vocab_pair, 1.0, 4, 600
    law = gated_law(model, n, SamplingParams(temp), started_open=started_open)
    samples, accepted, closed = [], 0, 0
    key = mx.random.key(11)
    for _ in range(trials):
        key, sub = mx.random.split(key)
        params = SamplingParams(temp, processors=[_gate(started_open=started_open)])
        out = []
        opts = DecodeOptions(max_tokens=n, block_size=4, key=sub)
        for c in decode(model, PROMPT, model.make_cache(), params, opts):
            out += c.tokens
            accepted += c.accepted
        samples.append(tuple(out[:n]))
        closed += CLOSE in out[:n]
    assert accepted > trials // 4 and closed > trials // 4  # drafts accepted, budgets hit
    assert all(s in law for s in samples)  # nothing the gate forbids was ever drawn
    for pos in range(n):
        exact = np.zeros(8)
        for seq, pr in law.items():
            exact[seq[pos]] += pr
        emp = np.bincount([s[pos] for s in samples], minlength=8) / trials
        assert 0.5 * np.abs(emp - exact).sum() < 0.08, (pos, emp, exact)
