"""Tool calls in a model's answer: which format a chat template speaks, and a parser that
turns the answer (whole or streamed) into text and calls.

Formats: ``HERMES`` is Qwen3 / Hermes ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`` blocks (also the fallback for templates without tool support); ``LLAMA3`` is
Llama 3's bare JSON ``{"name": ..., "parameters": {...}}`` (optionally after
``<|python_tag|>``, several separated by ';'). No MLX here.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from .limits import MAX_ARGUMENT_VALUES, check_json

HERMES, LLAMA3 = "hermes", "llama3"
OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass
class ToolCall:
    """One parsed call. ``arguments`` is JSON text (an object), as OpenAI sends it."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self):
        self.id = self.id or "call_" + uuid.uuid4().hex[:24]

    def openai(self, index: int | None = None) -> dict:
        """The OpenAI ``tool_calls`` entry (with ``index`` in a streamed delta)."""
        out = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return out if index is None else {"index": index, **out}


def template_text(tokenizer) -> str:
    """The chat template's source ('' without one; a dict of named templates joined)."""
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        return "\n".join(str(v) for v in t.values())
    if isinstance(t, list):
        return "\n".join(str(d.get("template", "")) for d in t if isinstance(d, dict))
    return t or ""


def tool_format(template: str) -> str:
    """The call format a template's text speaks (Hermes tags unless it is Llama 3's)."""
    if OPEN in template:
        return HERMES
    if PYTHON_TAG in template or ("ipython" in template and '"parameters"' in template):
        return LLAMA3
    return HERMES


def _call(obj) -> ToolCall | None:
    """A call from a decoded JSON object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    try:
        if isinstance(args, str):  # some models write the arguments as a JSON string
            args = json.loads(args)
        check_json(args, "arguments", max_values=MAX_ARGUMENT_VALUES)
    except (ValueError, RecursionError):  # InputError is a ValueError
        return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args))


def _json_call(text: str) -> ToolCall | None:
    try:
        return _call(json.loads(text))
    except (ValueError, RecursionError):  # not JSON, or nested past the reader's limit
        return None


def _llama_calls(text: str) -> list[ToolCall] | None:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :].strip()
    if not body.startswith("{"):
        return None
    parts = [p for p in body.split(";") if p.strip()]
    calls = [_json_call(p) for p in parts]
    if calls and all(calls):
        return calls
    one = _json_call(body)
    return [one] if one else None


def parse_calls(text: str, fmt: str = HERMES) -> tuple[str | None, list[ToolCall]]:
    """(the text outside calls, or None when only calls; the calls) of a whole answer."""
    if fmt == LLAMA3:
        calls = _llama_calls(text)
        return (None, calls) if calls else (text, [])
    s = CallStream(fmt)
    events = s.feed(text) + s.close()
    content = "".join(v for k, v in events if k == "text")
    calls = [v for k, v in events if k == "call"]
    return (content if content.strip() or not calls else None), calls


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class CallStream:
    """Split streamed text into ("text", str) and ("call", ToolCall) events as soon as each is
    certain: text that may be the start of a call is held back, a call is emitted whole.
    Whitespace between calls is dropped."""

    def __init__(self, fmt: str = HERMES):
        self.fmt, self.buf, self.inside, self.ws, self.started = fmt, "", False, "", False
        self.llama: bool | None = None  # LLAMA3: the answer is a call (decided at its start)

    def _text(self, s: str) -> list[tuple]:
        if not s:
            return []
        if not s.strip():  # whitespace waits for what follows it
            self.ws += s
            return []
        s, self.ws, self.started = self.ws + s, "", True
        return [("text", s)]

    def feed(self, text: str) -> list[tuple]:
        """Events that ``text`` completes."""
        self.buf += text
        if self.fmt == LLAMA3:
            return self._feed_llama()
        out: list[tuple] = []
        while True:
            if not self.inside:
                i = self.buf.find(OPEN)
                if i < 0:
                    keep = partial_suffix(self.buf, OPEN)
                    out += self._text(self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep :]
                    return out
                out += self._text(self.buf[:i])
                self.buf, self.inside = self.buf[i + len(OPEN) :], True
            j = self.buf.find(CLOSE)
            if j < 0:
                return out
            body, self.buf, self.inside = self.buf[:j], self.buf[j + len(CLOSE) :], False
            call = _json_call(body.strip())
            if call:
                self.ws = "" if not self.started else self.ws
                out.append(("call", call))
            else:
                out += self._text(OPEN + body + CLOSE)

    def _feed_llama(self) -> list[tuple]:
        if self.llama is None:
            head = self.buf.lstrip()
            if not head or (PYTHON_TAG.startswith(head) and len(head) < len(PYTHON_TAG)):
                return []
            self.llama = head.startswith(("{", PYTHON_TAG))
        if self.llama:
            return []  # parsed whole at the end
        out, self.buf = self._text(self.buf), ""
        return out

    def close(self) -> list[tuple]:
        """The events left at the end of the answer."""
        rest, self.buf = self.buf, ""
        if self.fmt == LLAMA3:
            if not self.llama:
                return self._text(rest)
            calls = _llama_calls(rest)
            return [("call", c) for c in calls] if calls else self._text(rest)
        if self.inside:  # an unterminated call: accept it if its JSON is whole
            self.inside = False
            call = _json_call(rest.strip())
            return [("call", call)] if call else self._text(OPEN + rest)
        return self._text(rest)
