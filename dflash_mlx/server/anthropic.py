"""Anthropic's Messages API on the same server: ``POST /v1/messages`` (whole or streamed) and
``POST /v1/messages/count_tokens``.

A Messages request is translated into the OpenAI chat request the rest of the server speaks
(system prompt first, ``tool_use`` blocks as assistant ``tool_calls``, ``tool_result`` blocks
as ``tool`` messages, ``tools`` with their ``input_schema``, ``tool_choice`` auto / any / tool /
none), so the template, the grammar that forces a call, and the queue are the same. The model
name a client asks for is not checked: agents send their own (e.g. a Claude model id), and
this server answers with the one model it serves. Errors have Anthropic's shape.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from .limits import ANTHROPIC, MAX_ARGUMENT_VALUES, InputError, check_body, check_json
from .schema import APIError, parse_body
from .structured import prepare
from .tools import CallStream

MESSAGES, COUNT = "/v1/messages", "/v1/messages/count_tokens"
ROUTES = {MESSAGES, COUNT}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    500: "api_error",
    503: "overloaded_error",
}
SKIPPED_BLOCKS = {"thinking", "redacted_thinking"}  # an agent's earlier reasoning: not replayed


class AnthropicError(APIError):
    """An APIError answered as ``{"type": "error", "error": {"type", "message"}}``."""

    @classmethod
    def of(cls, e: APIError) -> AnthropicError:
        return e if isinstance(e, cls) else cls(e.status, e.message, e.param, e.code)

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def bad(message: str) -> AnthropicError:
    return AnthropicError(400, message)


# ----------------------------------------------------------------------------- requests


def _text(content: Any, where: str) -> str:
    """A string, or a list of text blocks, as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or a list of text blocks")
    parts = []
    for j, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise bad(
                f"{where}.{j} must be a text block {{'type': 'text', 'text': ...}} (got {kind!r})"
            )
        parts.append(b["text"])
    return "".join(parts)


def _block(b: Any, where: str, role: str, texts: list, calls: list, results: list) -> None:
    kind = b.get("type") if isinstance(b, dict) else None
    if kind == "text":
        if not isinstance(b.get("text"), str):
            raise bad(f"{where}.text must be a string")
        texts.append(b["text"])
    elif kind == "tool_use" and role == "assistant":
        if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
            raise bad(f"{where}: a tool_use block needs a string 'id' and 'name'")
        value = b.get("input", {})
        if not isinstance(value, dict):
            raise bad(f"{where}.input must be an object")
        try:
            check_json(value, f"{where}.input", ANTHROPIC, max_values=MAX_ARGUMENT_VALUES)
        except InputError as e:
            raise bad(str(e)) from None
        fn = {"name": b["name"], "arguments": json.dumps(value)}
        calls.append({"id": b["id"], "type": "function", "function": fn})
    elif kind == "tool_result" and role == "user":
        if not isinstance(b.get("tool_use_id"), str):
            raise bad(f"{where}.tool_use_id must be a string")
        text = _text(b.get("content", ""), f"{where}.content")
        if b.get("is_error"):
            text = "error: " + text
        results.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text})
    elif kind not in SKIPPED_BLOCKS:
        allowed = "text, tool_use" if role == "assistant" else "text, tool_result"
        raise bad(f"{where}: unsupported content block {kind!r} in a {role} turn; use {allowed}")


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages: must be a non-empty list of {role, content} objects")
    out: list[dict] = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text(system, "system")})
    for i, m in enumerate(msgs):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise bad(f"messages.{i}.role must be 'user' or 'assistant'")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad(f"messages.{i}.content must be a string or a list of content blocks")
        texts, calls, results = [], [], []
        for j, b in enumerate(content):
            _block(b, f"messages.{i}.content.{j}", role, texts, calls, results)
        out += results  # tool results answer the previous turn's calls: they come first
        if texts or calls or not results:
            msg = {"role": role, "content": "".join(texts)}
            out.append({**msg, "tool_calls": calls} if calls else msg)
    return out


def _tools(body: dict) -> list | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("tools: must be a list of {name, description, input_schema}")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise bad(f"tools.{i}.name: a tool needs a string 'name'")
        if t.get("type") not in (None, "custom"):
            raise bad(f"tools.{i}.type: server tools ({t['type']!r}) are not supported here")
        if not isinstance(t.get("input_schema"), dict):
            raise bad(f"tools.{i}.input_schema: must be a JSON schema object")
        fn = {"name": t["name"], "parameters": t["input_schema"]}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(body: dict, chat: dict) -> None:
    tc = body.get("tool_choice")
    if tc is None:
        return
    kind = tc.get("type") if isinstance(tc, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise bad("tool_choice.type: must be 'auto', 'any', 'tool' or 'none'")
    if kind == "tool":
        if not isinstance(tc.get("name"), str):
            raise bad("tool_choice.name: a string is required with type 'tool'")
        chat["tool_choice"] = {"type": "function", "function": {"name": tc["name"]}}
    else:
        chat["tool_choice"] = {"any": "required"}.get(kind, kind)
    if tc.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False


def to_chat(body: Any, count: bool = False) -> dict:
    """The OpenAI chat body of a Messages request (``count``: no max_tokens needed)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    mt = body.get("max_tokens")
    if not count and (mt is None or isinstance(mt, bool) or not isinstance(mt, int) or mt < 1):
        raise bad("max_tokens: a positive integer is required")
    chat = {"messages": _messages(body), "stream": body.get("stream", False)}
    if not count:
        chat["max_tokens"] = mt
    for k in ("temperature", "top_p", "top_k"):
        if body.get(k) is not None:
            chat[k] = body[k]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad("stop_sequences: must be a list of strings")
        chat["stop"] = stops
    chat["tools"] = _tools(body)
    _tool_choice(body, chat)
    return chat


# ----------------------------------------------------------------------------- answers


def handle(h, path: str) -> None:
    """Answer one Messages API request on the handler ``h`` (``http.Handler``)."""
    try:
        if not h._authorized():
            raise AnthropicError(401, "invalid or missing API key; send 'x-api-key: <key>'")
        raw = h.body()
        body = _load(raw)
        chat = to_chat(body, count=path == COUNT)
        srv = h.server
        req = parse_body(chat, "chat", srv.defaults, None, ANTHROPIC)
        if path == COUNT:
            prepare(req, req.body, srv.engine.tokenizer)
            return h._send_json(200, {"input_tokens": len(srv.tokenize(req))})
        job = h.submit(req)
    except APIError as e:
        raise AnthropicError.of(e) from None
    model = body.get("model") if isinstance(body.get("model"), str) else h.server.model_name
    try:
        Answer(h, req, job, model, chat.get("stop") or []).run()
    finally:
        job.cancel.set()


def _load(raw: bytes) -> Any:
    """The request body, parsed and within ``limits.MAX_BODY_DEPTH``."""
    try:
        body = json.loads(raw.decode("utf-8") if raw else "")
    except RecursionError:
        raise bad("the request body is nested too deeply; send a flat JSON object") from None
    except ValueError as e:
        raise bad(f"the request body is not valid JSON ({e})") from None
    try:
        if isinstance(body, dict):
            check_body(body, ANTHROPIC)
    except InputError as e:
        raise bad(str(e)) from None
    return body


class Answer:
    """One Messages answer, whole or as Anthropic's server-sent events."""

    def __init__(self, h, req, job, model: str, stops: list[str]):
        self.h, self.req, self.job, self.model, self.stops = h, req, job, model, stops
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.text, self.tokens, self.blocks, self.open = [], [], [], None
        spec = req.tools
        self.split = CallStream(spec.fmt if spec is not None else "hermes")
        self.tools = spec is not None and spec.active

    def send(self, event: str, data: dict) -> None:
        self.h.wfile.write(f"event: {event}\ndata: {json.dumps(data)}\n\n".encode())
        self.h.wfile.flush()

    def run(self) -> None:
        started, last = False, None
        while True:
            item = self.h._next(self.job)
            if item is None:
                return
            tag, val = item
            if tag == "end":
                break
            if tag == "error":
                if not started:
                    raise AnthropicError.of(val)
                return self.send("error", AnthropicError.of(val).body())
            last = val
            self.text.append(val.text)
            self.tokens += val.tokens
            if self.req.stream:
                if not started:
                    started = True
                    self.h.start_events()
                    start = {"type": "message_start", "message": self._message(last, [], None)}
                    self.send("message_start", start)
                self._stream(val.text, bool(val.finish_reason))
        if last is None:
            raise AnthropicError(500, "the generation produced nothing")
        if not self.req.stream:
            whole = "".join(self.text)
            events = (
                self.split.feed(whole) + self.split.close() if self.tools else [("text", whole)]
            )
            content = self._events(events)
            reason = self._reason(last.finish_reason, content)
            return self.h._send_json(200, self._message(last, content, reason))
        self._close_block()
        reason, seq = self._reason(last.finish_reason, self.blocks)
        delta = {"stop_reason": reason, "stop_sequence": seq}
        usage = {"output_tokens": last.generation_tokens}
        self.send("message_delta", {"type": "message_delta", "delta": delta, "usage": usage})
        self.send("message_stop", {"type": "message_stop"})

    def _events(self, events) -> list[dict]:
        """Content blocks of split events (consecutive text joined)."""
        out: list[dict] = []
        for kind, val in events:
            if kind == "text":
                if out and out[-1]["type"] == "text":
                    out[-1]["text"] += val
                else:
                    out.append({"type": "text", "text": val})
            else:
                out.append(_tool_use(val))
        return out

    def _stream(self, text: str, final: bool) -> None:
        events = (
            self.split.feed(text) + (self.split.close() if final else [])
            if self.tools
            else ([("text", text)] if text else [])
        )
        for kind, val in events:
            if kind == "text":
                if self.open is None or self.open["type"] != "text":
                    self._start_block({"type": "text", "text": ""})
                self._delta({"type": "text_delta", "text": val})
                self.open["text"] += val
            else:
                block = _tool_use(val)
                self._start_block({**block, "input": {}})
                self._delta({"type": "input_json_delta", "partial_json": val.arguments})
                self.open["input"] = block["input"]
                self._close_block()

    def _delta(self, delta: dict) -> None:
        i = len(self.blocks) - 1
        self.send(
            "content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta}
        )

    def _start_block(self, block: dict) -> None:
        self._close_block()
        self.blocks.append(block)
        self.open = block
        start = {"type": "content_block_start", "index": len(self.blocks) - 1}
        self.send("content_block_start", {**start, "content_block": dict(block)})

    def _close_block(self) -> None:
        if self.open is not None:
            i = len(self.blocks) - 1
            self.send("content_block_stop", {"type": "content_block_stop", "index": i})
            self.open = None

    def _reason(self, finish: str | None, content: list[dict]):
        """(stop_reason, stop_sequence): which stop sequence ended the answer, if one did."""
        if any(b["type"] == "tool_use" for b in content) and finish == "stop":
            return "tool_use", None
        if finish == "stop" and self.stops:
            full = self.h.server.engine.tokenizer.decode(self.tokens)
            rest = full[len("".join(self.text)) :]
            for s in self.stops:
                if s and rest.startswith(s):
                    return "stop_sequence", s
        return STOP_REASONS.get(finish, "end_turn"), None

    def _message(self, last, content, reason) -> dict:
        stop_reason, seq = reason if reason else (None, None)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": seq,
            "usage": {
                "input_tokens": last.prompt_tokens,
                "output_tokens": last.generation_tokens if reason else 0,
                "cache_read_input_tokens": max(0, last.prompt_tokens - last.prompt_processed),
            },
        }


def _tool_use(call) -> dict:
    return {
        "type": "tool_use",
        "id": "toolu_" + call.id[len("call_") :],
        "name": call.name,
        "input": json.loads(call.arguments),
    }
