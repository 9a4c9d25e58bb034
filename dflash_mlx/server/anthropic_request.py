"""Anthropic's Messages requests translated into the OpenAI chat request the rest of the
server speaks (see ``anthropic.py``), and Anthropic's error shape. No MLX."""

from __future__ import annotations

import json
from typing import Any

from .images import Gather
from .limits import ANTHROPIC, MAX_ARGUMENT_VALUES, InputError, check_json
from .schema import APIError

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    500: "api_error",
    503: "overloaded_error",
}
# an agent's earlier reasoning: a thinking block's text goes to the template (which keeps or
# drops it), a redacted one is skipped
SKIPPED_BLOCKS = {"thinking", "redacted_thinking"}


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


def _block(b: Any, where: str, role: str, texts: list, calls: list, results: list, images) -> None:
    kind = b.get("type") if isinstance(b, dict) else None
    if kind == "image" and role == "user":
        texts.append(images.anthropic(b, where))  # text and images, in order
    elif kind == "text":
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
        allowed = "text, tool_use" if role == "assistant" else "text, image, tool_result"
        raise bad(f"{where}: unsupported content block {kind!r} in a {role} turn; use {allowed}")


def _messages(body: dict, images) -> list[dict]:
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
        thoughts = [b["thinking"] for b in content if _thought(b, role)]
        for j, b in enumerate(content):
            _block(b, f"messages.{i}.content.{j}", role, texts, calls, results, images)
        out += results  # tool results answer the previous turn's calls: they come first
        if texts or calls or not results:
            msg = {"role": role, "content": images.content(texts)}
            if thoughts:
                msg["reasoning_content"] = "".join(thoughts)
            out.append({**msg, "tool_calls": calls} if calls else msg)
    return out


def _thought(b: Any, role: str) -> bool:
    """Whether b is an earlier assistant turn's thinking block with its text."""
    return (
        role == "assistant"
        and isinstance(b, dict)
        and b.get("type") == "thinking"
        and isinstance(b.get("thinking"), str)
    )


def _thinking(body: dict, chat: dict) -> None:
    """``thinking`` as the template's ``enable_thinking`` (off unless enabled, as Anthropic's
    API has it) and the budget in tokens after which the reasoning is closed."""
    t = body.get("thinking")
    kind = t.get("type") if isinstance(t, dict) else None
    if t is not None and kind not in ("enabled", "disabled", "adaptive"):
        raise bad("thinking.type: must be 'enabled' (with budget_tokens), 'disabled' or 'adaptive'")
    chat["chat_template_kwargs"] = {"enable_thinking": kind in ("enabled", "adaptive")}
    if kind != "enabled":
        return
    n = t.get("budget_tokens")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise bad(f"thinking.budget_tokens: must be a whole number of tokens >= 0 (got {n!r})")
    chat["thinking_budget"] = n


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


def to_chat(body: Any, count: bool = False, images=None) -> dict:
    """The OpenAI chat body of a Messages request.

    Args:
        body: the parsed request. count: count_tokens (no max_tokens needed).
        images: a ``server.images.Gather`` for the ``image`` blocks (None: the defaults,
            no URLs); their pictures go in the messages as picture parts.
    """
    images = images or Gather()
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    mt = body.get("max_tokens")
    if not count and (mt is None or isinstance(mt, bool) or not isinstance(mt, int) or mt < 1):
        raise bad("max_tokens: a positive integer is required")
    chat = {"messages": _messages(body, images), "stream": body.get("stream", False)}
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
    _thinking(body, chat)
    return chat
