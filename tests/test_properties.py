"""Property tests (hypothesis): whatever a client or a user sends, the only outcomes are a
valid request / config / prompt or our own error type, never another exception.

- the server's parser (``server.schema.parse_request``) on raw bytes, arbitrary JSON and
  request-shaped objects with arbitrary field values;
- ``GenerationConfig.validate`` on arbitrary values (as the Python API and the server see
  them), and ``stream_generate`` on whatever it accepts;
- ``dflash run`` on arbitrary option strings: one ``error:`` line and exit 2;
- ``encode_prompt`` on arbitrary text, lone surrogates included.
"""

from __future__ import annotations

import json
from dataclasses import fields, replace

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from dflash_mlx.errors import DFlashError
from dflash_mlx.server.schema import SETTINGS, APIError, CompletionRequest, parse_request
from dflash_mlx.settings import GenerationConfig, SettingError

FAST = settings(max_examples=150, deadline=None)
SLOW = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

CHARS = st.characters(exclude_categories=()) | st.sampled_from(["\udcff", "\ud800", "\x00"])
TEXT = st.text(CHARS, max_size=12)
NUMBERS = (
    st.integers()
    | st.floats()
    | st.sampled_from([10**400, -(10**30), 2**32, 2**64, 1e-320, 1e308, 0, 1, -1])
)
SCALARS = st.none() | st.booleans() | NUMBERS | TEXT
JSON = st.recursive(
    SCALARS,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(TEXT, kids, max_size=4),
    max_leaves=12,
)
ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool", "bot", ""]) | JSON
MESSAGE = st.fixed_dictionaries(
    {"role": ROLES},
    optional={
        "content": TEXT | JSON | st.lists(st.fixed_dictionaries({"type": JSON, "text": JSON}))
    },
)
GOOD_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": TEXT}
)
UNIT = st.floats(0, 1)
# Values in range (often) or anything (sometimes): requests that pass the parser reach the
# engine with every setting near its limits.
PLAUSIBLE = {
    "max_tokens": st.integers(1, 10),
    "max_completion_tokens": st.integers(1, 10),
    "temperature": st.floats(0, 2) | st.sampled_from([1e-6, 1e-30]),
    "top_p": UNIT,
    "top_k": st.integers(0, 10**6),
    "min_p": UNIT,
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.1, 3),
    "logit_bias": st.dictionaries(st.integers(0, 400).map(str), st.floats(-100, 100), max_size=3),
    "block_size": st.integers(2, 16),
    "use_selector": st.booleans(),
    "seed": st.integers(0, 2**32 - 1),
    "stop": TEXT | st.lists(TEXT, max_size=3),
    "stream": st.booleans(),
    "n": st.just(1),
}
FIELDS = sorted(set(SETTINGS) | {"model", "stream", "stream_options", "n", "prompt", "messages"})
REQUEST = st.fixed_dictionaries(
    {},
    optional={
        "messages": st.lists(GOOD_MESSAGE, min_size=1, max_size=3)
        | st.lists(MESSAGE, max_size=3)
        | JSON,
        "prompt": TEXT | st.lists(st.integers(-5, 400), max_size=5) | JSON,
        **{
            f: PLAUSIBLE[f] | JSON if f in PLAUSIBLE else JSON
            for f in FIELDS
            if f not in ("messages", "prompt")
        },
    },
)

NEAR_VALID = st.fixed_dictionaries(
    {
        "messages": st.lists(GOOD_MESSAGE, min_size=1, max_size=3),
        "prompt": TEXT.filter(bool) | st.lists(st.integers(0, 400), min_size=1, max_size=5),
    },
    optional={f: PLAUSIBLE[f] for f in sorted(PLAUSIBLE) if f != "stream"},
)


def _body(value) -> bytes:
    return json.dumps(value).encode("utf-8", "surrogatepass")  # NaN, Infinity: Python's json


def _parse(raw: bytes, kind: str):
    try:
        req = parse_request(raw, kind, max_block_size=16)
    except APIError as e:
        err = e.body()["error"]
        assert e.status == 400 and err["message"] and "\n" not in err["message"]
        json.dumps(e.body())  # answerable as it is
        return None
    assert isinstance(req, CompletionRequest) and req.kind == kind
    assert req.gen.validate(16) is req.gen
    return req


@FAST
@given(
    st.binary(max_size=64) | JSON.map(_body) | REQUEST.map(_body),
    st.sampled_from(["chat", "completion"]),
)
def test_the_request_parser_answers_a_request_or_a_400(raw, kind):
    _parse(raw, kind)


@FAST
@given(
    st.dictionaries(
        st.sampled_from([f.name for f in fields(GenerationConfig)]), SCALARS | JSON, max_size=6
    ),
    st.booleans(),
    st.none() | st.integers(-3, 20),
)
def test_generation_config_is_valid_or_a_setting_error(values, flags, max_block):
    try:
        cfg = GenerationConfig(**values).validate(max_block, flags=flags)
    except SettingError as e:
        assert "\n" not in str(e) and e.field in values
    else:
        assert isinstance(cfg, GenerationConfig)


OPTIONS = {
    "--temp": NUMBERS,
    "--top-p": NUMBERS,
    "--top-k": NUMBERS,
    "--min-p": NUMBERS,
    "--presence-penalty": NUMBERS,
    "--seed": NUMBERS,
    "--block-size": NUMBERS,
    "--max-tokens": NUMBERS,
}


@FAST
@given(
    st.dictionaries(
        st.sampled_from(sorted(OPTIONS)),
        NUMBERS.map(str) | TEXT.filter(lambda t: "\x00" not in t),
        max_size=4,
    )
)
def test_dflash_run_options_end_in_one_error_line(tmp_path_factory, opts):
    missing = tmp_path_factory.getbasetemp() / "no-such-model"
    args = ["run", "--model", str(missing), "hi"]
    for flag, value in opts.items():
        args += [flag, value]
    r = CliRunner().invoke(_app(), args)
    assert r.exit_code == 2, (args, r.stderr, r.exception)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (args, r.stderr)
    assert "Traceback" not in r.stderr


def _app():
    from dflash_mlx.cli import app

    return app


@SLOW
@given(NEAR_VALID | REQUEST, st.sampled_from(["chat", "completion"]))
def test_what_the_parser_accepts_generates_or_is_a_dflash_error(pairs, body, kind):
    from dflash_mlx import stream_generate
    from dflash_mlx.generation import encode_prompt

    req = _parse(_body(body), kind)
    event("parsed" if req is not None else "400")
    if req is None:
        return
    model, tok = pairs("qwen3", "d2")
    try:
        ids = encode_prompt(tok, req.prompt, raw=kind == "completion", context=4096)
        gen = replace(req.gen, max_tokens=min(req.gen.max_tokens, 3))
        rs = list(stream_generate(model, tok, ids, config=gen))
    except DFlashError as e:
        assert "\n" not in str(e)
        event("DFlashError")
        return
    event("generated")
    assert rs and rs[-1].finish_reason in ("stop", "length")


@FAST
@given(st.text(CHARS, max_size=40), st.booleans(), st.none() | TEXT)
def test_encode_prompt_gives_ids_or_a_dflash_error(pairs, text, raw, system):
    from dflash_mlx.generation import encode_prompt

    _, tok = pairs("qwen3", "d2")
    try:
        ids = encode_prompt(tok, text, raw=raw, system=system, context=64)
    except DFlashError as e:
        assert "\n" not in str(e)
        return
    assert ids and all(isinstance(t, int) for t in ids) and len(ids) < 64


@pytest.mark.parametrize("value", [10**400, 1e400, float("nan"), "1", [1], {"a": 1}, True])
def test_numbers_beyond_floats_are_setting_errors(value):
    with pytest.raises(SettingError):
        GenerationConfig(temperature=value).validate()


def test_extreme_sampling_settings_still_give_a_distribution():
    import mlx.core as mx

    from dflash_mlx.decoding.acceptance import SamplingParams, target_probs

    logits = mx.array([[2.0, 1.0, 0.5, -1.0]])
    for params in [
        SamplingParams(temperature=1e-320),  # 1 / T overflows: greedy
        SamplingParams(temperature=1e-39, top_k=3),
        SamplingParams(temperature=0.7, top_k=4),  # top_k = the vocabulary: off
        SamplingParams(temperature=0.7, top_k=10**6),
        SamplingParams(temperature=1e308),
    ]:
        if params.greedy:
            assert params.temperature == 0
            continue
        p = target_probs(logits, params)
        assert bool(mx.all(mx.isfinite(p))) and abs(float(p.sum()) - 1) < 1e-5, params
