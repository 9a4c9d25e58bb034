"""OpenAI tools and structured output end to end: the official client against a server on the
tiny pair (its ChatML template has no tool support: the fallback prompt applies). Forced calls
and schemas are finite here (enums, booleans, no extra keys), so a random model completes them.
"""

import json

import pytest
from test_server import KEY, _http, serve_tiny

from dflash_mlx import generate
from dflash_mlx.decoding.grammar import json_schema_grammar, make_processor

openai = pytest.importorskip("openai")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}, "metric": {"type": "boolean"}},
            "required": ["city", "metric"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["s", "m", "l"]}},
    "required": ["ok", "size"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(tiny_dir, tmp_path_factory):
    yield from serve_tiny(tiny_dir, tmp_path_factory, "agents")


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served + "/v1", api_key=KEY, timeout=120, max_retries=0)


def _call(client, **kw):
    kw.setdefault("max_tokens", 200)
    return client.chat.completions.create(model="qwen3", messages=ASK, temperature=0, **kw)


def test_a_forced_call_returns_tool_calls_with_the_schemas_keys(client):
    r = _call(
        client,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content is None and len(ch.message.tool_calls) == 1
    call = ch.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "metric"} and args["city"] in ("Paris", "Rome")


def test_required_picks_one_of_the_tools_and_parallel_off_means_one_call(client):
    r = _call(client, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name in ("get_weather", "get_time")


def test_a_tool_result_continues_the_chat(client):
    r = _call(client, tools=[WEATHER], tool_choice="required")
    msg = r.choices[0].message
    history = ASK + [
        msg.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": '{"temp_c": 18}'},
    ]
    r2 = client.chat.completions.create(
        model="qwen3", messages=history, tools=[WEATHER], max_tokens=12, temperature=0
    )
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens  # the call and its result were sent


def test_streamed_tool_calls_arrive_as_deltas_and_match_the_whole_answer(client):
    kw = {
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    whole = _call(client, **kw).choices[0].message.tool_calls[0]
    deltas, reasons = [], []
    for ch in _call(client, stream=True, **kw):
        if ch.choices:
            deltas += ch.choices[0].delta.tool_calls or []
            reasons.append(ch.choices[0].finish_reason)
    assert len(deltas) == 1 and deltas[0].index == 0 and deltas[0].id
    assert deltas[0].function.name == "get_weather"
    assert deltas[0].function.arguments == whole.function.arguments
    assert reasons[-1] == "tool_calls"


def test_tool_choice_none_answers_in_text(client):
    r = _call(client, tools=[WEATHER], tool_choice="none", max_tokens=8)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason in ("stop", "length")


def test_json_schema_output_parses_and_equals_the_in_process_constrained_answer(client, pairs):
    rf = {"type": "json_schema", "json_schema": {"name": "shirt", "schema": SCHEMA}}
    r = _call(client, response_format=rf)
    out = json.loads(r.choices[0].message.content)
    assert set(out) == {"ok", "size"} and r.choices[0].finish_reason == "stop"
    model, tok = pairs("qwen3", "d2")
    proc = make_processor(tok, model.adapter.vocab_size, json_schema_grammar(SCHEMA))
    want = generate(model, tok, ASK, max_tokens=200, temperature=0, logits_processors=[proc])
    assert r.choices[0].message.content == want


@pytest.mark.parametrize(
    "extra,words",
    [
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
            "parameters",
        ),
        ({"tools": "get_weather"}, "tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "nope",
        ),
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "foo"}},
                }
            },
            "foo",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": "x"}}, "json_schema"),
        (
            {
                "messages": ASK
                + [
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}],
                    }
                ]
            },
            "tool_calls[0]",
        ),
        ({"messages": ASK + [{"role": "assistant", "tool_calls": "f"}]}, "tool_calls"),
    ],
)
def test_malformed_tools_schemas_and_history_are_400_naming_the_field(served, extra, words):
    body = {"model": "qwen3", "messages": ASK, "max_tokens": 4, **extra}
    status, out = _http(served + "/v1/chat/completions", body)
    assert status == 400, out
    assert words in out["error"]["message"] and out["error"]["type"] == "invalid_request_error"
