"""No input reaches a 500 (issue 34): JSON the server parses itself is bounded in depth and
size, schemas are checked before a grammar is built, errors come in each API's shape and
field names, /v1/completions refuses tools and takes response_format, early 401 / 413 answers
reach a client still sending its body, and half-closed requests are answered. Then a bounded
fuzz of malformed bodies against both chat routes: never a 5xx, always the API's error shape.

One server on the tiny qwen3 pair (its template has no tool support: the fallback prompt)."""

from __future__ import annotations

import http.client
import json
import math
import re
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import KEY, _http, serve_tiny

CHAT, MESSAGES, COMPLETIONS = "/v1/chat/completions", "/v1/messages", "/v1/completions"
ASK = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served(tiny_dir, tmp_path_factory):
    yield from serve_tiny(tiny_dir, tmp_path_factory, "limits")


def _nest(n: int, leaf, wrap):
    for _ in range(n):
        leaf = wrap(leaf)
    return leaf


def _connect(url: str, timeout: float = 60) -> http.client.HTTPConnection:
    host, port = url.rsplit("/", 1)[1].split(":")
    return http.client.HTTPConnection(host, int(port), timeout=timeout)


def _send(url, path, body=None, raw=None, key=KEY):
    """(status, content type, body bytes) of a POST through Python's http.client."""
    conn = _connect(url)
    data = raw if raw is not None else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {key}", "x-api-key": key}
    try:
        conn.request("POST", path, data, {"Content-Type": "application/json", **headers})
        r = conn.getresponse()
        return r.status, r.getheader("Content-Type"), r.read()
    finally:
        conn.close()


def _error(path: str, status, data: bytes) -> tuple[str, str | None]:
    """(message, OpenAI param) of a 4xx in the route's API shape."""
    assert isinstance(status, int) and 400 <= status < 500, (status, data[:300])
    obj = json.loads(data)
    if path.startswith(MESSAGES):
        assert obj["type"] == "error" and set(obj["error"]) == {"type", "message"}, obj
        assert obj["error"]["type"] != "api_error", obj
        return obj["error"]["message"], None
    assert set(obj["error"]) == {"message", "type", "param", "code"}, obj
    return obj["error"]["message"], obj["error"]["param"]


def _refused(url, path, body=None, raw=None) -> tuple[str, str | None]:
    status, _, data = _send(url, path, body, raw)
    assert status == 400, (status, data[:300])
    return _error(path, status, data)


def _chat(**extra) -> dict:
    return {"messages": ASK, "max_tokens": 4, **extra}


def _schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _tool(params, name="f") -> dict:
    return {"type": "function", "function": {"name": name, "parameters": params}}


def test_tool_call_arguments_nested_deeply_are_400_naming_the_field(served):
    def history(arguments):
        call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
        return ASK + [{"role": "assistant", "content": None, "tool_calls": [call]}]

    where = "messages[1].tool_calls[0].function.arguments"
    for args in ("[" * 5000 + "]" * 5000, _nest(70, {}, lambda s: {"a": s}), '{"x": NaN}'):
        msg, param = _refused(served, CHAT, _chat(messages=history(args)))
        assert param == "messages" and msg.startswith(where), msg
    use = {"type": "tool_use", "id": "t", "name": "f", "input": _nest(70, {}, lambda s: {"a": s})}
    body = _chat(messages=[*ASK, {"role": "assistant", "content": [use]}])
    msg, _ = _refused(served, MESSAGES, body)
    assert msg.startswith("messages.1.content.0.input is nested too deeply"), msg


def test_deep_schemas_are_400_naming_the_field_in_each_api(served):
    items = _nest(130, {"type": "string"}, lambda s: {"type": "array", "items": s})
    any330 = _nest(330, {"type": "string"}, lambda s: {"anyOf": [s]})
    any40 = _nest(40, {"type": "string"}, lambda s: {"anyOf": [s]})
    rf, tools = "response_format", "tools"
    cases = [
        (_chat(response_format=_schema_format(items)), rf, "the request body is nested"),
        (_chat(response_format=_schema_format(any40)), rf, f"{rf}.json_schema.schema is nested"),
        (_chat(tools=[_tool({"properties": {"a": any330}})]), tools, "(at tools[0].function"),
        (_chat(tools=[_tool(any40)]), tools, "tools[0].function.parameters is nested"),
    ]
    for body, param, words in cases:
        msg, got = _refused(served, CHAT, body)
        assert "nested too deeply" in msg and words in msg and got == param, msg
    for schema in ({"type": "object", "properties": {"a": any330}}, any40):
        tools = [{"name": "f", "input_schema": schema}]
        msg, _ = _refused(served, MESSAGES, _chat(tools=tools))
        assert "tools.0.input_schema" in msg and "function" not in msg, msg


def test_non_finite_schema_bounds_are_400_naming_the_field(served):
    nan = b'{"type": "number", "minimum": NaN}'
    raw = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
    bodies = [
        (CHAT, b'"response_format": {"type": "json_schema", "json_schema": {"schema": %s}}}'),
        (CHAT, b'"tools": [{"type": "function", "function": {"name": "f", "parameters": %s}}]}'),
        (MESSAGES, b'"tools": [{"name": "f", "input_schema": %s}]}'),
    ]
    wheres = ["response_format.json_schema.schema", "tools[0].function.parameters"]
    for (path, tail), where in zip(bodies, [*wheres, "tools.0.input_schema"], strict=True):
        msg, _ = _refused(served, path, raw=raw + tail % nan)
        assert msg == f"{where}.minimum is NaN; numbers must be finite", msg


def test_schemas_no_grammar_can_follow_are_400_before_any_decoding(served):
    huge = {"type": "string", "pattern": "^a{1000}{1000}$"}  # a million a's: the lexer gives up
    big = {"type": "object", "properties": {"s": huge}, "required": ["s"]}
    cases = [
        (_chat(response_format=_schema_format({"$ref": "#"})), "no finite JSON value"),
        (_chat(response_format=_schema_format(big)), "cannot be followed"),
        (_chat(response_format=_schema_format({"pattern": "(?!a)b"})), "look-around"),
        (_chat(tools=[_tool(big)], tool_choice="required"), "tools[0].function.parameters"),
    ]
    for body, words in cases:
        msg, _ = _refused(served, CHAT, body)
        assert words in msg, msg
    choice = {"type": "tool", "name": "f"}
    body = _chat(tools=[{"name": "f", "input_schema": big}], tool_choice=choice)
    msg, _ = _refused(served, MESSAGES, body)
    assert msg.startswith("tools.0.input_schema cannot be followed"), msg
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}
    status, out = _http(served + CHAT, _chat(response_format=_schema_format(tree)))
    assert status == 200, out  # a self-reference with a way out is fine


def test_anthropic_errors_name_anthropic_fields(served):
    ok = {"name": "f", "input_schema": {"type": "object"}}
    cases = [
        ({"tools": [{"name": "a b", "input_schema": {"type": "object"}}]}, "tools.0.name"),
        ({"tools": [ok, {"name": "g", "input_schema": {"type": "foo"}}]}, "tools.1.input_schema"),
        ({"tools": [ok], "tool_choice": {"type": "tool", "name": "g"}}, "'tool_choice.name'"),
        ({"tools": [ok, ok]}, "same name"),
    ]
    for extra, words in cases:
        msg, _ = _refused(served, MESSAGES, _chat(**extra))
        assert words in msg and "function" not in msg and "tools[" not in msg, msg


def test_completions_take_response_format_and_refuse_tools(served):
    fmt = _schema_format({"enum": ["yes", "no"]})
    status, out = _http(
        served + COMPLETIONS, {"prompt": "Answer:", "max_tokens": 8, "response_format": fmt}
    )
    assert status == 200 and json.loads(out["choices"][0]["text"]) in ("yes", "no"), out
    for extra, param in (
        ({"tools": 5}, "tools"),
        ({"tools": [_tool({"type": "object"})]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": _schema_format({"$ref": "#"})}, "response_format"),
    ):
        msg, got = _refused(served, COMPLETIONS, {"prompt": "x", "max_tokens": 2, **extra})
        assert got == param, msg


def test_early_401_and_413_reach_a_client_still_sending_its_body(served):
    status, _, data = _send(served, CHAT, raw=b"x" * 8_000_000, key="wrong")
    assert status == 401 and _error(CHAT, 400, data)  # (the shape of any 4xx)
    status, _, data = _send(served, MESSAGES, raw=b"x" * 8_000_000, key="wrong")
    assert status == 401 and json.loads(data)["error"]["type"] == "authentication_error"
    status, _, data = _send(served, CHAT, raw=b"x" * (33 * 1024 * 1024))
    assert status == 413 and "over" in _error(CHAT, 400, data)[0]
    assert _http(served + "/health", key=None)[1]["status"] == "ok"


def test_half_closed_requests_are_answered(served):
    for path, body in ((COMPLETIONS, {"prompt": "hi", "max_tokens": 3}), (MESSAGES, _chat())):
        conn = _connect(served)
        headers = {"x-api-key": KEY, "Content-Type": "application/json"}
        conn.request("POST", path, json.dumps(body).encode(), headers)
        conn.sock.shutdown(socket.SHUT_WR)  # the request is whole: no more to send
        r = conn.getresponse()  # http.client skips the interim 100 the server probes with
        assert r.status == 200 and json.loads(r.read()), path
        conn.close()
    data = json.dumps({**_chat(), "stream": True}).encode()
    head = f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
    head += "Content-Type: application/json\r\n"
    head += f"Content-Length: {len(data)}\r\n\r\n"
    host, port = served.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(head.encode() + data)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while piece := s.recv(65536):
            out += piece
    assert b" 200 OK" in out and out.rstrip().endswith(b"data: [DONE]"), out[-300:]


# ------------------------------------------------------------------------------- fuzz

# "__deep<n>__" in a body's text becomes n nested arrays (odd n) or anyOf schemas (even n)
DEEP = st.integers(40, 1500).map(lambda n: f"__deep{n}__")
FLOATS = st.sampled_from([math.nan, math.inf, -math.inf, 1e308]) | st.floats()
LEAF = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | FLOATS | st.text(max_size=8)
VALUES = st.recursive(
    LEAF | DEEP,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
    max_leaves=8,
)
PATTERNS = st.sampled_from(["^a{1000}{1000}$", "(?!a)b", "[z-a]", "^[a-z]+$", "\\bx", "("])
SCHEMAS = st.recursive(
    st.sampled_from(["string", "integer", "number", "object", "array", "foo"]).map(
        lambda t: {"type": t}
    )
    | st.just({"$ref": "#"})
    | PATTERNS.map(lambda p: {"type": "string", "pattern": p})
    | FLOATS.map(lambda x: {"type": "number", "minimum": x})
    | DEEP,
    lambda c: (
        st.lists(c, min_size=1, max_size=3).map(lambda xs: {"anyOf": xs})
        | st.dictionaries(st.sampled_from("abc"), c, min_size=1, max_size=3).map(
            lambda d: {"type": "object", "properties": d, "required": sorted(d)}
        )
        | c.map(lambda i: {"type": "array", "items": i, "minItems": 1})
    ),
    max_leaves=6,
)
NAMES = st.sampled_from(["f", "g", "a b", "", "x" * 70])
ARGUMENTS = (
    st.integers(40, 5000).map(lambda n: "[" * n + "]" * n)
    | st.just('{"x": NaN}')
    | VALUES.map(json.dumps)
    | VALUES
)


def _history(arguments, name):
    call = {"id": "c", "type": "function", "function": {"name": name, "arguments": arguments}}
    return [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]}]


def _tool_use(value, name):
    block = {"type": "tool_use", "id": "t", "name": name, "input": value}
    return [*ASK, {"role": "assistant", "content": [block]}]


OPENAI_FIELDS = {
    "messages": st.just(ASK) | VALUES | st.builds(_history, ARGUMENTS, NAMES),
    "tools": st.lists(st.builds(_tool, SCHEMAS | VALUES, NAMES), max_size=2) | VALUES,
    "tool_choice": st.sampled_from(["auto", "required", "none"]) | VALUES,
    "response_format": SCHEMAS.map(_schema_format) | VALUES,
    "temperature": VALUES,
    "stop": VALUES,
    "stream": st.booleans() | VALUES,
}
ANTHROPIC_FIELDS = {
    "messages": st.just(ASK) | VALUES | st.builds(_tool_use, VALUES, NAMES),
    "tools": st.lists(
        st.fixed_dictionaries({"name": NAMES, "input_schema": SCHEMAS | VALUES}), max_size=2
    )
    | VALUES,
    "tool_choice": st.sampled_from([{"type": "any"}, {"type": "tool", "name": "f"}]) | VALUES,
    "system": VALUES,
    "stop_sequences": VALUES,
    "stream": st.booleans() | VALUES,
}


def _deep(m: re.Match) -> str:
    n = int(m.group(1))
    if n % 2:
        return "[" * n + "1" + "]" * n
    return '{"anyOf": [' * (n // 2) + '{"type": "string"}' + "]}" * (n // 2)


@st.composite
def malformed(draw):
    """(route, body bytes): a small valid request with one or two fields set to random JSON
    (NaN, deep nesting, hostile schemas and arguments among it), maybe cut short."""
    path = draw(st.sampled_from([CHAT, MESSAGES]))
    fields = OPENAI_FIELDS if path == CHAT else ANTHROPIC_FIELDS
    body = {"messages": ASK, "max_tokens": 1}
    for name in draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=2)):
        body[name] = draw(fields[name])
    text = re.sub(r'"__deep(\d+)__"', _deep, json.dumps(body))
    if draw(st.integers(0, 9)) == 0:
        text = text[: draw(st.integers(0, len(text)))]
    return path, text.encode()


@settings(
    max_examples=50,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=malformed())
def test_fuzzed_bodies_never_get_a_5xx_and_errors_keep_the_api_shape(served, case):
    path, raw = case
    status, kind, data = _send(served, path, raw=raw)
    assert isinstance(status, int) and status < 500, (status, raw[:300], data[:300])
    if status >= 400:
        _error(path, status, data)
    elif "json" in (kind or ""):
        assert json.loads(data)
    else:
        assert kind == "text/event-stream"
