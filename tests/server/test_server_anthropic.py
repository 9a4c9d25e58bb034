"""Anthropic's Messages API on the same server, driven by the official ``anthropic`` client:
whole and streamed answers equal the in-process generation of the same chat, tools and tool
results, count_tokens, x-api-key, and errors in Anthropic's shape."""

import json
import urllib.error
import urllib.request

import pytest
from test_server import KEY, _start, _stop

from dflash_mlx import generate

anthropic = pytest.importorskip("anthropic")

SYSTEM = "You are terse."
ASK = [{"role": "user", "content": "import os\nfor i in"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def served(tiny_dir, tmp_path_factory):
    proc, url, _ = _start(
        tmp_path_factory.mktemp("anth"), tiny_dir / "qwen3", tiny_dir / "d2_qwen3", "--api-key", KEY
    )
    yield url
    _stop(proc)


@pytest.fixture(scope="module")
def client(served):
    return anthropic.Anthropic(base_url=served, api_key=KEY, timeout=120, max_retries=0)


def _expected(pairs, n, **kw):
    model, tok = pairs("qwen3", "d2")
    msgs = [{"role": "system", "content": SYSTEM}] + ASK
    return generate(model, tok, msgs, max_tokens=n, temperature=0, **kw)


def _post(url, body, headers=None):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    for k, v in (headers if headers is not None else {"x-api-key": KEY}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_create_with_a_system_prompt_answers_what_the_model_generates(client, pairs):
    m = client.messages.create(
        model="claude-any",
        system=SYSTEM,
        messages=ASK,
        max_tokens=12,
        extra_body={"temperature": 0},
    )
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == _expected(pairs, 12)
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert m.usage.input_tokens > 0 and 0 < m.usage.output_tokens <= 12


def test_stream_gives_the_same_text_and_the_events_in_order(client, pairs):
    events = []
    with client.messages.stream(
        model="claude-any",
        system=SYSTEM,
        messages=ASK,
        max_tokens=12,
        extra_body={"temperature": 0},
    ) as s:
        for ev in s:
            events.append(ev.type)
        final = s.get_final_message()
    assert final.content[0].text == _expected(pairs, 12)
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "content_block_stop" in events
    assert events[-2] == "message_delta" and final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.output_tokens > 0


def test_a_stop_sequence_is_reported(client, pairs):
    text = _expected(pairs, 16)
    stop = text[4:7]
    assert stop and stop not in text[:6]
    m = client.messages.create(
        model="m", system=SYSTEM, messages=ASK, max_tokens=16, stop_sequences=[stop]
    )
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[: text.index(stop)]


def test_a_forced_tool_gives_tool_use_and_a_result_continues(client):
    kw = {"model": "m", "messages": ASK, "max_tokens": 200, "tools": [WEATHER]}
    m = client.messages.create(tool_choice={"type": "tool", "name": "get_weather"}, **kw)
    assert m.stop_reason == "tool_use"
    use = [b for b in m.content if b.type == "tool_use"]
    assert len(use) == 1 and use[0].name == "get_weather" and use[0].id.startswith("toolu_")
    assert use[0].input["city"] in ("Paris", "Rome")
    result = {"type": "tool_result", "tool_use_id": use[0].id, "content": "sunny, 18 C"}
    history = ASK + [
        {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": [result]},
    ]
    m2 = client.messages.create(**{**kw, "messages": history, "max_tokens": 8})
    assert m2.stop_reason in ("end_turn", "max_tokens", "tool_use")
    whole = m2.usage.input_tokens + (m2.usage.cache_read_input_tokens or 0)
    assert whole > m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)


def test_a_streamed_tool_use_sends_input_json_deltas(client):
    deltas = []
    with client.messages.stream(
        model="m",
        messages=ASK,
        max_tokens=200,
        tools=[WEATHER],
        tool_choice={"type": "any"},
    ) as s:
        for ev in s:
            if ev.type == "content_block_delta" and ev.delta.type == "input_json_delta":
                deltas.append(ev.delta.partial_json)
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    use = next(b for b in final.content if b.type == "tool_use")
    assert json.loads("".join(deltas)) == use.input and use.input["city"] in ("Paris", "Rome")


def test_count_tokens_is_the_prompt_length(client):
    n = client.messages.count_tokens(model="m", system=SYSTEM, messages=ASK).input_tokens
    m = client.messages.create(model="m", system=SYSTEM, messages=ASK, max_tokens=1)
    assert n == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 0


def test_no_max_tokens_is_a_400_in_anthropic_shape(served):
    status, out = _post(served + "/v1/messages", {"model": "m", "messages": ASK})
    assert status == 400
    assert out["type"] == "error" and out["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in out["error"]["message"]


def test_the_client_raises_bad_request_for_a_malformed_block(client):
    msgs = [{"role": "user", "content": [{"type": "image", "source": {}}]}]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="m", messages=msgs, max_tokens=4)
    assert "messages.0.content.0" in e.value.body["error"]["message"]


@pytest.mark.parametrize(
    "extra,words",
    [
        ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
        ({"tools": [{"name": "f", "input_schema": {"type": "foo"}}]}, "foo"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "tool_use_id"),
        ({"messages": [{"role": "bot", "content": "hi"}]}, "messages.0.role"),
        ({"system": [{"type": "image"}]}, "system"),
        ({"stop_sequences": "x"}, "stop_sequences"),
        ({"temperature": "hot"}, "temperature"),
    ],
)
def test_malformed_requests_are_400_naming_the_field(served, extra, words):
    body = {"model": "m", "messages": ASK, "max_tokens": 4, **extra}
    status, out = _post(served + "/v1/messages", body)
    assert status == 400, out
    assert out["type"] == "error" and words in out["error"]["message"], out


def test_x_api_key_and_bearer_both_authenticate(served):
    body = {"model": "m", "messages": ASK, "max_tokens": 1}
    assert _post(served + "/v1/messages", body)[0] == 200
    assert _post(served + "/v1/messages", body, {"Authorization": f"Bearer {KEY}"})[0] == 200
    status, out = _post(served + "/v1/messages", body, {"x-api-key": "wrong"})
    assert status == 401 and out["error"]["type"] == "authentication_error"
