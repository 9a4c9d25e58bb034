"""Constrained decoding stays lossless: under a grammar, speculative greedy decoding equals the
target's own greedy loop under the same grammar, and sampling follows the masked law."""

import json
from typing import ClassVar

import llguidance
import mlx.core as mx
import numpy as np
import pytest
from laws import processed_law
from mlx_lm.generate import generate_step
from oracle import OracleDrafter

from dflash_mlx.decoding.acceptance import SamplingParams
from dflash_mlx.decoding.grammar import (
    GrammarError,
    GrammarProcessor,
    json_schema_grammar,
    lark_grammar,
    make_processor,
)
from dflash_mlx.decoding.loop import DecodeOptions, decode

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["name", "n"],
}
EOS = 3  # <|im_end|> of the tiny tokenizer


def upto_eos(ids):
    return ids[: ids.index(EOS) + 1] if EOS in ids else ids


def reference(model, tok, ids, n, grammar):
    """The target's own greedy loop (mlx-lm) under the grammar: no speculation at all."""
    proc = make_processor(tok, model.adapter.vocab_size, grammar, eos=[EOS])
    steps = generate_step(mx.array(ids), model.target, max_tokens=n, logits_processors=[proc])
    return [t for t, _ in steps]


def speculative(model, tok, ids, n, grammar, block, selector=True):
    proc = make_processor(tok, model.adapter.vocab_size, grammar, eos=[EOS])
    params = SamplingParams(processors=[proc])
    out, accepted = [], 0
    for c in decode(
        model,
        ids,
        model.make_cache(),
        params,
        DecodeOptions(max_tokens=n, block_size=block, use_selector=selector),
    ):
        out += c.tokens
        accepted += c.accepted
    return out[:n], accepted


GRAMMARS = {
    "json_schema": lambda: json_schema_grammar(SCHEMA),
    "lark": lambda: lark_grammar('start: "for " NAME " in " NAME ":" /[a-z ]+/\nNAME: /[a-z]+/'),
}


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("grammar", sorted(GRAMMARS))
@pytest.mark.parametrize("drafter", ["d2", "d1"])
def test_greedy_under_a_grammar_equals_the_targets_own_constrained_loop(
    pairs, kind, grammar, drafter
):
    model, tok = pairs(kind, drafter)
    ids = tok.encode("import os\nfor i in")
    g = GRAMMARS[grammar]()
    ref = reference(model, tok, ids, 40, g)
    for block, selector in [(4, True), (16, False)]:
        got, _ = speculative(model, tok, ids, 40, g, block, selector)
        assert upto_eos(got) == upto_eos(ref)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("wrong", [(), (3,), (1, 6)])
def test_greedy_under_a_grammar_with_accepted_and_rejected_drafts(pairs, kind, wrong):
    """An oracle drafter proposes the constrained continuation (wrong at chosen rows): drafts
    are accepted, so the matcher is rolled back and moved forward across cycles."""
    model, tok = pairs(kind, "d2")
    ids = tok.encode("def parse_args(")
    g = json_schema_grammar(SCHEMA)
    ref = reference(model, tok, ids, 48, g)
    real = model.drafter
    model.drafter = OracleDrafter(real, ids + ref + [0] * 20, wrong_at=wrong)
    try:
        got, accepted = speculative(model, tok, ids, 40, g, 8)
    finally:
        model.drafter = real
    assert upto_eos(got) == upto_eos(ref[:40])
    assert accepted > 10 or 1 in wrong  # drafts went through the verify rows (row 1 wrong: none)
    text = tok.decode([t for t in upto_eos(got) if t != EOS])
    if EOS in got:  # a finished answer is the JSON the schema asks for
        assert set(json.loads(text)) >= {"name", "n"}


def test_processor_masks_each_prefix_as_a_fresh_matcher_would(pairs):
    """Rows in any order (forward, rolled back, past a forbidden token) get the mask that a
    matcher built for exactly that prefix gives."""
    model, tok = pairs("qwen3", "d2")
    V = model.adapter.vocab_size
    g = json_schema_grammar(SCHEMA)
    answer = tok.encode('{"name": "ab", "n": 12}')
    proc = make_processor(tok, V, g, eos=[EOS])
    prompt, row = [5, 6, 7], mx.zeros((1, V))
    proc(mx.array(prompt), row)
    rng = np.random.default_rng(0)
    cuts = [1, 2, 5, 3, 3, 0, 9, len(answer), 4, 0, 7] + rng.integers(0, len(answer), 12).tolist()
    for i, cut in enumerate(cuts):
        prefix = answer[:cut]
        fresh = GrammarProcessor(proc.lltok, g)
        fresh(mx.array(prompt), row)
        want = np.isneginf(np.array(fresh(mx.array(prompt + prefix), row)))
        if i % 3 == 2:  # a forbidden token after the prefix: that row is left unmasked
            banned = int(np.flatnonzero(want[0])[0])
            got = proc(mx.array(prompt + prefix + [banned]), row)
            assert not np.isneginf(np.array(got)).any()
        else:
            got = proc(mx.array(prompt + prefix), row)
            assert np.array_equal(np.isneginf(np.array(got)), want), cut
            assert want.any() and not want.all()


def test_a_bad_schema_is_a_grammar_error_naming_the_problem(pairs):
    _, tok = pairs("qwen3", "d2")
    with pytest.raises(GrammarError, match="foo"):
        make_processor(tok, 320, json_schema_grammar({"type": "foo"}))


def test_schemas_llguidance_cannot_read_are_grammar_errors_not_value_errors():
    deep = {"type": "string"}
    for _ in range(70):  # past the 128 levels of its JSON reader
        deep = {"type": "array", "items": {"type": "array", "items": deep}}
    for schema in ({"type": "number", "minimum": float("nan")}, deep):
        with pytest.raises(GrammarError, match="cannot be read"):
            json_schema_grammar(schema)


@pytest.mark.parametrize(
    "schema,words",
    [
        ({"$ref": "#"}, "from its start"),  # no output at all: was an empty answer
        ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "forces"),
        ({"type": "string", "pattern": "^a{1000}{1000}$"}, "forces"),  # was a lone quote
    ],
)
def test_a_grammar_that_cannot_be_followed_from_its_start_is_refused(pairs, schema, words):
    _, tok = pairs("qwen3", "d2")
    with pytest.raises(GrammarError, match=words):
        make_processor(tok, 320, json_schema_grammar(schema), eos=[EOS])
    proc = make_processor(tok, 320, json_schema_grammar(SCHEMA), eos=[EOS])
    assert not proc.consumed and not proc.done  # the check ran on a copy


# ----------------------------------------------------------------------------- sampling law


class Eight:
    """A tokenizer of 8 one-byte tokens for the 8-token tiny target (7 ends the answer)."""

    eos_token_id, bos_token_id = 7, None
    tokens = [bytes([c]) for c in b"abcdefg"] + [b"</s>"]
    special_token_ids: ClassVar[list[int]] = [7]

    def __call__(self, s):
        return [b"abcdefg".index(c) for c in s]


EIGHT_GRAMMAR = "start: /[abc][cdef][abef][a-g]*/"


def eight_processor():
    lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Eight()))
    return GrammarProcessor(lltok, lark_grammar(EIGHT_GRAMMAR))


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    from tiny_models import eight_token_pair

    return eight_token_pair(tmp_path_factory.mktemp("v8g"))


def constrained_law(model, prompt, n, params):
    """Joint law of the first n tokens under the grammar, by enumeration."""
    return processed_law(model, prompt, n, params, eight_processor)


def test_sampling_under_a_grammar_follows_the_masked_target_law(small_vocab_pair):
    model, temp, top_k = small_vocab_pair, 0.9, 4
    prompt, n, trials = [2, 5, 1, 7], 4, 800
    law = constrained_law(model, prompt, n, SamplingParams(temp, top_k=top_k))
    samples, accepted = [], 0
    key = mx.random.key(3)
    for _ in range(trials):
        key, sub = mx.random.split(key)
        params = SamplingParams(temp, top_k=top_k, processors=[eight_processor()])
        out = []
        for c in decode(
            model,
            prompt,
            model.make_cache(),
            params,
            DecodeOptions(max_tokens=n, block_size=4, key=sub),
        ):
            out += c.tokens
            accepted += c.accepted
        samples.append(tuple(out[:n]))
    assert accepted > trials // 4  # drafts were accepted, not only bonus tokens drawn
    assert all(s in law for s in samples)  # nothing the grammar forbids was ever drawn
    for pos in range(n):
        exact = np.zeros(8)
        for seq, pr in law.items():
            exact[seq[pos]] += pr
        emp = np.bincount([s[pos] for s in samples], minlength=8) / trials
        assert 0.5 * np.abs(emp - exact).sum() < 0.08, (pos, emp, exact)


def test_schemas_are_read_closed_unless_they_allow_more_keys():
    from dflash_mlx.decoding.grammar import closed

    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"a": {"type": "integer"}}},
            "tags": {"type": "array", "items": {"type": "object", "properties": {}}},
            "free": {"type": "object", "additionalProperties": True, "properties": {}},
        },
        "enum": [{"properties": 1}],
    }
    out = closed(schema)
    assert out["additionalProperties"] is False
    inner = out["properties"]
    assert "additionalProperties" not in inner  # the name -> schema mapping is not a schema
    assert inner["properties"]["additionalProperties"] is False
    assert inner["tags"]["items"]["additionalProperties"] is False
    assert inner["free"]["additionalProperties"] is True
    assert out["enum"] == [{"properties": 1}]
    assert "additionalProperties" not in schema  # the caller's schema is left as it was
