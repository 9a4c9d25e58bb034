"""No input to ``/v1/responses`` reaches a 500: a bounded fuzz of malformed bodies (random
JSON in one or two fields: NaN, deep nesting, hostile schemas and call arguments, cut-short
text) against a server on the tiny qwen3 pair; every answer is a 2xx or a 4xx in OpenAI's
error shape, and the server keeps serving. The strategies are test_server_limits'."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import serve_tiny
from test_server_limits import ARGUMENTS, NAMES, SCHEMAS, VALUES, _deep, _error, _send

RESPONSES = "/v1/responses"


@pytest.fixture(scope="module")
def served(tiny_dir, tmp_path_factory):
    yield from serve_tiny(tiny_dir, tmp_path_factory, "responses_fuzz")


def _call(arguments, name) -> list:
    call = {"type": "function_call", "call_id": "c", "name": name, "arguments": arguments}
    out = {"type": "function_call_output", "call_id": "c", "output": "ok"}
    return [{"role": "user", "content": "hi"}, call, out]


def _tool(params, name) -> dict:
    return {"type": "function", "name": name, "parameters": params}


def _message(content) -> list:
    return [{"type": "message", "role": "user", "content": content}]


FIELDS = {
    "input": st.just("hi")
    | VALUES
    | st.builds(_call, ARGUMENTS, NAMES)
    | st.builds(_message, VALUES),
    "tools": st.lists(st.builds(_tool, SCHEMAS | VALUES, NAMES), max_size=2) | VALUES,
    "tool_choice": st.sampled_from(["auto", "required", "none", {"type": "function", "name": "f"}])
    | VALUES,
    "text": SCHEMAS.map(lambda s: {"format": {"type": "json_schema", "name": "x", "schema": s}})
    | VALUES,
    "instructions": VALUES,
    "previous_response_id": VALUES,
    "reasoning": VALUES,
    "max_output_tokens": VALUES,
    "stream": st.booleans() | VALUES,
}


@st.composite
def malformed(draw) -> bytes:
    """A small valid request with one or two fields set to random JSON, maybe cut short."""
    body = {"input": "hi", "max_output_tokens": 1}
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), min_size=1, max_size=2)):
        body[name] = draw(FIELDS[name])
    text = re.sub(r'"__deep(\d+)__"', _deep, json.dumps(body))
    if draw(st.integers(0, 9)) == 0:
        text = text[: draw(st.integers(0, len(text)))]
    return text.encode()


@settings(
    max_examples=50,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(raw=malformed())
def test_fuzzed_responses_bodies_never_get_a_5xx_and_errors_keep_openais_shape(served, raw):
    status, kind, data = _send(served, RESPONSES, raw=raw)
    assert isinstance(status, int) and status < 500, (status, raw[:300], data[:300])
    if status >= 400:
        _error(RESPONSES, status, data)
    elif "json" in (kind or ""):
        assert json.loads(data)["object"] == "response"
    else:
        assert kind == "text/event-stream" and b"event: response.created" in data


def test_the_server_still_answers_after_the_fuzz(served):
    status, _, data = _send(served, RESPONSES, {"input": "hi", "max_output_tokens": 2})
    assert status == 200 and json.loads(data)["status"] in ("completed", "incomplete")
