"""OpenAI's Responses API end to end: the official client's ``responses`` against a server on
the tiny pair (ChatML without tool support: the fallback prompt applies). Expected texts
come from the chat route or ``dflash_mlx.generate`` in this process; forced calls and
schemas are finite, so a random model completes them."""

import json
import urllib.request

import pytest
from test_server import KEY, NO_EOS, _http, serve_tiny

from dflash_mlx import generate

openai = pytest.importorskip("openai")

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}, "metric": {"type": "boolean"}},
        "required": ["city", "metric"],
        "additionalProperties": False,
    },
}
FORCE = {"type": "function", "name": "get_weather"}
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["s", "m", "l"]}},
    "required": ["ok", "size"],
    "additionalProperties": False,
}
JSON_FORMAT = {"format": {"type": "json_schema", "name": "shirt", "schema": SCHEMA}}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def served(tiny_dir, tmp_path_factory):
    yield from serve_tiny(tiny_dir, tmp_path_factory, "responses")


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served + "/v1", api_key=KEY, timeout=120, max_retries=0)


def _create(client, **kw):
    kw.setdefault("input", ASK)
    kw.setdefault("max_output_tokens", 200)
    return client.responses.create(model="qwen3", temperature=0, **kw)


def _events(client, **kw):
    """The raw events of a streamed response (bounded)."""
    kw.setdefault("input", ASK)
    kw.setdefault("max_output_tokens", 200)
    out = []
    for ev in client.responses.create(model="qwen3", temperature=0, stream=True, **kw):
        out.append(ev)
        assert len(out) < 5_000
    return out


def test_create_returns_output_text_equal_to_the_in_process_greedy_answer(client, pairs):
    r = _create(client, input="Hello there", max_output_tokens=9, extra_body={"logit_bias": NO_EOS})
    model, tok = pairs("qwen3", "d2")
    want = generate(
        model,
        tok,
        [{"role": "user", "content": "Hello there"}],
        max_tokens=9,
        temperature=0,
        logit_bias={3: -100},
    )
    assert r.output_text == want and r.object == "response" and r.id.startswith("resp_")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 9 and r.usage.total_tokens == r.usage.input_tokens + 9
    assert r.usage.input_tokens_details.cached_tokens >= 0
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"


def test_instructions_and_items_read_as_the_same_chat_request(client):
    chat = client.chat.completions.create(
        model="qwen3",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}],
        max_tokens=6,
        temperature=0,
    )
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]}]
    r = _create(client, instructions="Be brief.", input=items, max_output_tokens=6)
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == chat.choices[0].message.content


def test_stream_yields_numbered_text_deltas_and_a_completed_event_matching_the_whole(client):
    whole = _create(client, text=JSON_FORMAT)
    with client.responses.stream(
        model="qwen3", input=ASK, temperature=0, text=JSON_FORMAT, max_output_tokens=200
    ) as s:
        events = list(s)
        final = s.get_final_response()
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert set(json.loads(final.output_text)) == {"ok", "size"} and final.status == "completed"


def test_a_forced_function_tool_returns_a_function_call_with_the_schemas_keys(client):
    r = _create(client, tools=[WEATHER], tool_choice=FORCE)
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    args = json.loads(call.arguments)
    assert set(args) == {"city", "metric"} and args["city"] in ("Paris", "Rome")


def test_a_function_call_output_continues_by_previous_response_id_as_by_history(client):
    r = _create(client, tools=[WEATHER], tool_choice="required")
    call = r.output[0]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"t": 18}'}
    kw = {"tools": [WEATHER], "max_output_tokens": 6}
    by_id = _create(client, previous_response_id=r.id, input=[result], **kw)
    history = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True), result]
    by_items = _create(client, input=history, **kw)
    assert by_id.usage.input_tokens == by_items.usage.input_tokens > r.usage.input_tokens
    assert by_id.output_text == by_items.output_text
    assert by_id.previous_response_id == r.id
    assert by_items.usage.input_tokens_details.cached_tokens > 0  # the same prompt again


def test_a_streamed_function_call_has_argument_events_and_equals_the_whole_call(client):
    whole = _create(client, tools=[WEATHER], tool_choice=FORCE).output[0]
    events = _events(client, tools=[WEATHER], tool_choice=FORCE)
    types = [e.type for e in events]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = events[-2].item
    assert done.type == "function_call" and done.arguments == whole.arguments
    assert events[3].delta == events[4].arguments == whole.arguments
    assert events[-1].response.output[0].call_id == done.call_id
    held = client.responses.retrieve(events[-1].response.id)  # a streamed response is held too
    assert held.output[0].arguments == whole.arguments


def test_a_held_response_is_retrieved_by_id_and_an_unknown_one_is_a_404(client, served):
    r = _create(client, max_output_tokens=3)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    status, body = _http(served + "/v1/responses/resp_nope")
    assert status == 404 and body["error"]["code"] == "response_not_found"


def test_a_response_not_stored_cannot_be_continued(client):
    r = _create(client, max_output_tokens=3, store=False)
    with pytest.raises(openai.NotFoundError) as e:
        _create(client, previous_response_id=r.id, input="more")
    assert e.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"input": [{"type": "web_search_call", "id": "x"}]}, 400, "input"),
        ({"input": "a", "previous_response_id": "resp_gone"}, 404, "previous_response_id"),
        (
            {"input": "a", "tools": [{"type": "function", "name": "f", "parameters": []}]},
            400,
            "tools",
        ),
        ({"input": "a", "tools": [{"type": "function", "name": "bad name"}]}, 400, "tools"),
        (
            {"input": "a", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "g"}},
            400,
            "tool_choice",
        ),
        ({"input": "a", "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"input": "a", "temperature": "hot"}, 400, "temperature"),
        ({"input": "a", "stream": "yes"}, 400, "stream"),
        (
            {"input": "a", "text": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}},
            400,
            "text",
        ),
        ({"input": "a", "model": "other"}, 404, "model"),
    ],
)
def test_bad_requests_answer_in_openais_error_shape_and_the_server_keeps_serving(
    served, body, status, param
):
    got, out = _http(served + "/v1/responses", body)
    err = out["error"]
    assert got == status and err["param"] == param, out
    assert set(err) == {"message", "type", "param", "code"} and "\n" not in err["message"]
    ok, out = _http(served + "/v1/responses", {"input": "a", "max_output_tokens": 2})
    assert ok == 200 and out["status"] in ("completed", "incomplete")


def test_malformed_json_and_a_missing_key_are_refused(served):
    status, out = _http(served + "/v1/responses", raw=b"{nope")
    assert status == 400 and out["error"]["code"] == "invalid_json"
    status, out = _http(served + "/v1/responses", {"input": "a"}, key=None)
    assert status == 401 and out["error"]["code"] == "invalid_api_key"
    req = urllib.request.Request(served + "/v1/responses/resp_x")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 401


def test_responses_parse_returns_the_clients_pydantic_object(client):
    from typing import Literal

    from pydantic import BaseModel

    class Shirt(BaseModel):
        ok: bool
        size: Literal["s", "m", "l"]

    r = client.responses.parse(
        model="qwen3", input=ASK, text_format=Shirt, temperature=0, max_output_tokens=200
    )
    assert isinstance(r.output_parsed, Shirt) and r.status == "completed"
