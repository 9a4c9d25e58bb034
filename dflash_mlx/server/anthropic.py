"""Anthropic's Messages API on the same server: ``POST /v1/messages`` (whole or streamed) and
``POST /v1/messages/count_tokens``.

A Messages request is translated into the OpenAI chat request the rest of the server speaks
(system prompt first, ``tool_use`` blocks as assistant ``tool_calls``, ``tool_result`` blocks
as ``tool`` messages, ``tools`` with their ``input_schema``, ``tool_choice`` auto / any / tool /
none), so the template, the grammar that forces a call, and the queue are the same. The model
name a client asks for is not checked: agents send their own (e.g. a Claude model id), and
this server answers with the one model it serves. Errors have Anthropic's shape. A thinking
model's reasoning is a ``thinking`` block when the request enables thinking (none otherwise).
The translation of requests is ``anthropic_request.py``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from .anthropic_request import AnthropicError, bad, to_chat
from .limits import ANTHROPIC, InputError, check_body
from .reasoning import ReasoningTokens, Splitter, split
from .schema import APIError, ended, parse_body
from .structured import prepare
from .tools import CallStream

MESSAGES, COUNT = "/v1/messages", "/v1/messages/count_tokens"
ROUTES = {MESSAGES, COUNT}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


# ----------------------------------------------------------------------------- answers


def handle(h, path: str) -> None:
    """Answer one Messages API request on the handler ``h`` (``http.Handler``)."""
    try:
        if not h._authorized():
            raise AnthropicError(401, "invalid or missing API key; send 'x-api-key: <key>'")
        raw = h.body()
        body = _load(raw)
        srv = h.server
        images = srv.gather("messages")
        chat = to_chat(body, count=path == COUNT, images=images)
        req = parse_body(chat, "chat", srv.defaults, None, ANTHROPIC, images)
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
        self.show = bool((req.template_kwargs or {}).get("enable_thinking"))  # thinking blocks
        self.thinking = Splitter(req.marks, req.started_open) if req.marks else None
        tok = h.server.engine.tokenizer
        self.thought = ReasoningTokens(tok, req.marks, req.started_open)  # counted as chat's

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
                tag, val = "error", ended(last)  # unfinished: the server stopped it
                if val is None:
                    break
            if tag == "error":
                if not started:
                    raise AnthropicError.of(val)
                return self.send("error", AnthropicError.of(val).body())
            last = val
            self.text.append(val.text)
            self.tokens += val.tokens
            self.thought.feed(val.tokens)
            if self.req.stream:
                if not started:
                    started = True
                    self.h.start_events()
                    start = {"type": "message_start", "message": self._message(last, [], None)}
                    self.send("message_start", start)
                self._stream(val.text, bool(val.finish_reason))
        if not self.req.stream:
            thought, whole = split("".join(self.text), self.req.marks, self.req.started_open)
            events = (
                self.split.feed(whole) + self.split.close() if self.tools else [("text", whole)]
            )
            content = self._events(events)
            if self.show and thought is not None:
                content.insert(0, {"type": "thinking", "thinking": thought, "signature": ""})
            reason = self._reason(last.finish_reason, content)
            return self.h._send_json(200, self._message(last, content, reason))
        self._close_block()
        reason, seq = self._reason(last.finish_reason, self.blocks)
        delta = {"stop_reason": reason, "stop_sequence": seq}
        usage = {"output_tokens": last.generation_tokens, **self._reasoning()}
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
        if self.thinking is not None:
            pieces = self.thinking.feed(text) + (self.thinking.close() if final else [])
            for kind, val in pieces:
                if kind == "reasoning" and self.show:
                    self._think(val)
            text = "".join(val for kind, val in pieces if kind == "content")
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

    def _think(self, text: str) -> None:
        """Stream reasoning into the thinking block (opened first)."""
        if self.open is None or self.open["type"] != "thinking":
            self._start_block({"type": "thinking", "thinking": "", "signature": ""})
        self._delta({"type": "thinking_delta", "thinking": text})
        self.open["thinking"] += text

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

    def _reasoning(self) -> dict:
        """The reasoning tokens (a dflash extension, as chat's and Responses' count them);
        nothing for a model that does not think."""
        n = self.thought.count
        return {} if n is None else {"output_tokens_details": {"reasoning_tokens": n}}

    def _message(self, last, content, reason) -> dict:
        """The message object; ``input_tokens`` is the uncached part of the prompt (as
        Anthropic defines it), ``cache_read_input_tokens`` the part taken from the cache."""
        stop_reason, seq = reason if reason else (None, None)
        cached = max(0, last.prompt_tokens - last.prompt_processed)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": seq,
            "usage": {
                "input_tokens": last.prompt_tokens - cached,
                "output_tokens": last.generation_tokens if reason else 0,
                "cache_read_input_tokens": cached,
                **(self._reasoning() if reason else {}),
            },
        }


def _tool_use(call) -> dict:
    return {
        "type": "tool_use",
        "id": "toolu_" + call.id[len("call_") :],
        "name": call.name,
        "input": json.loads(call.arguments),
    }
