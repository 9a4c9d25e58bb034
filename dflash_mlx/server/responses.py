"""OpenAI's Responses API on the same server: ``POST /v1/responses`` (whole or streamed) and
``GET /v1/responses/{id}``.

A Responses request is translated into the OpenAI chat request the rest of the server speaks
(``instructions`` as the system message, ``message`` items as messages, ``function_call``
items as assistant ``tool_calls``, ``function_call_output`` items as ``tool`` messages,
flat function ``tools``, ``text.format`` as ``response_format``), so the template, the
grammar that forces a call, and the queue are the same. ``reasoning`` input items are
dropped, as chat templates drop earlier turns' thinking. The answer and its events are
``responses_stream``'s. Finished responses are held in memory (``responses_store``) for
``previous_response_id`` and the GET route.
Errors have OpenAI's shape and name the Responses API's fields.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .images import Gather
from .limits import InputError, Names, check_body, load_json
from .responses_store import MAX_HELD, Store, store_of
from .responses_stream import Answer, new_id
from .schema import SETTINGS, APIError, bad, parse_body

RESPONSES = "/v1/responses"
ROUTES = {RESPONSES}
# chat fields passed as they are: decoding settings and the reasoning options (extensions)
PASSED = {k for k in SETTINGS if k not in ("max_tokens", "max_completion_tokens")} | {
    "chat_template_kwargs",
    "thinking_budget",
}
TEXT_PARTS = {"input_text", "output_text", "text", "summary_text", "reasoning_text"}
REFUSED = {  # request fields this server cannot honour: a 400 rather than a silent ignore
    "background": "background responses are not supported; leave 'background' unset",
    "conversation": "conversations are not stored here; use 'previous_response_id'",
}
# the chat request's field names, as this API writes them in errors
RESPELL = (
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format", "text.format"),
    ("'max_tokens'", "'max_output_tokens'"),
    ("'reasoning_effort'", "'reasoning.effort'"),
)
PARAMS = {
    "messages": "input",
    "response_format": "text",
    "max_tokens": "max_output_tokens",
    "reasoning_effort": "reasoning",
}


@dataclass(frozen=True)
class _Spelling(Names):
    """Tools as the Responses API writes them: flat, ``tools[0].parameters``."""

    def tool(self, i: int, field: str = "") -> str:
        return f"tools[{i}]" + (f".{field}" if field else "")

    @property
    def choice_name(self) -> str:
        return "tool_choice.name"


SPELLING = _Spelling("openai")


def respell(e: APIError) -> APIError:
    """The chat request's error in this API's field names.

    Args:
        e: an error of the chat request's parsing or checks (``param`` a chat field).
    """
    msg = e.message
    for old, new in RESPELL:
        msg = msg.replace(old, new)
    return APIError(e.status, msg, PARAMS.get(e.param, e.param), e.code)


# ----------------------------------------------------------------------------- input items


def _text(content: Any, where: str, images=None) -> str | list:
    """Text parts as one string; with ``images``, input_image parts too (then parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or a list of text parts", "input")
    parts = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else type(p).__name__
        kind = kind if isinstance(kind, str) else None  # a list or object is no type
        if kind == "refusal" and isinstance(p.get("refusal"), str):
            parts.append(p["refusal"])
        elif kind in TEXT_PARTS and isinstance(p.get("text"), str):
            parts.append(p["text"])
        elif kind == "input_image" and images is not None:
            parts.append(images.responses(p, f"{where}[{j}]"))
        else:
            taken = "text and image parts" if images else "text parts"
            raise bad(f"{where}[{j}]: only {taken} are supported (got {kind!r})", "input")
    return images.content(parts) if images is not None else "".join(parts)


def _message(item: dict, where: str, images) -> dict:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise bad(f"{where}.role must be 'user', 'assistant', 'system' or 'developer'", "input")
    return {"role": role, "content": _text(item.get("content"), f"{where}.content", images)}


def _string(item: dict, key: str, where: str) -> str:
    v = item.get(key)
    if not isinstance(v, str) or not v:
        raise bad(f"{where}.{key} must be a non-empty string", "input")
    return v


def _call(item: dict, where: str, out: list) -> None:
    """A ``function_call`` item: a tool call of the assistant turn it ends (or a new one)."""
    args = item.get("arguments", "")
    if not isinstance(args, str):
        raise bad(f"{where}.arguments must be a string of JSON", "input")
    try:
        value = load_json(args, f"{where}.arguments", SPELLING) if args.strip() else {}
    except InputError as e:
        raise bad(str(e), "input") from None
    if not isinstance(value, dict):
        raise bad(f"{where}.arguments must be a JSON object", "input")
    fn = {"name": _string(item, "name", where), "arguments": json.dumps(value)}
    call = {"id": _string(item, "call_id", where), "type": "function", "function": fn}
    last = out[-1] if out else None
    if last is None or last["role"] != "assistant":
        last = {"role": "assistant", "content": ""}
        out.append(last)
    last.setdefault("tool_calls", []).append(call)


def _item(item: Any, where: str, out: list, images) -> None:
    """Append the chat messages of one input item to ``out``."""
    if not isinstance(item, dict):
        raise bad(f"{where} must be an object (a message or an item)", "input")
    kind = item.get("type", "message")
    if kind == "message":
        msg = _message(item, where, images)
        last = out[-1] if out else None
        joined = last and isinstance(last["content"], str) and isinstance(msg["content"], str)
        if joined and msg["role"] == "assistant" == last["role"] and not last.get("tool_calls"):
            last["content"] += msg["content"]  # one turn written as several items
        else:
            out.append(msg)
    elif kind == "function_call":
        _call(item, where, out)
    elif kind == "function_call_output":
        text = _text(item.get("output"), f"{where}.output")
        out.append(
            {"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": text}
        )
    elif kind == "reasoning":
        if not isinstance(item.get("summary", []), list):
            raise bad(f"{where}.summary must be a list", "input")
    elif kind == "item_reference":
        raise bad(f"{where}: item_reference is not supported; send the item itself", "input")
    else:
        raise bad(
            f"{where}.type {kind!r} is not supported; use message, function_call, "
            "function_call_output or reasoning",
            "input",
        )


def input_items(body: dict) -> list:
    """The request's ``input`` as a list of items (a string is one user message).

    Args:
        body: the Responses request.

    Raises:
        APIError: 400 when ``input`` is neither a string nor a list.
    """
    inp = body.get("input")
    if isinstance(inp, str):
        return [{"type": "message", "role": "user", "content": inp}]
    if not isinstance(inp, list):
        raise bad("'input' must be a string or a list of items", "input")
    return inp


def messages(items: list, where: str = "input", images=None) -> list[dict]:
    """The chat messages of Responses items.

    Args:
        items: input items (and held output items). where: the field errors name.
        images: a ``server.images.Gather`` for ``input_image`` parts (None: the defaults).

    Raises:
        APIError: 400 naming the item at fault.
    """
    out: list[dict] = []
    images = images or Gather(param="input")
    for i, item in enumerate(items):
        _item(item, f"{where}[{i}]", out, images)
    return out


# ----------------------------------------------------------------------------- the request


def _tools(body: dict) -> list | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("'tools' must be a list of function tools", "tools")
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise bad(
                f"tools[{i}].type is {kind!r}; only function tools "
                "({'type': 'function', 'name': ..., 'parameters': {...}}) are supported",
                "tools",
            )
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(tc: Any) -> Any:
    if tc is None or isinstance(tc, str):
        return tc  # "auto" / "none" / "required", checked with the tools
    if isinstance(tc, dict) and tc.get("type") == "function" and isinstance(tc.get("name"), str):
        return {"type": "function", "function": {"name": tc["name"]}}
    raise bad(
        "'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
        "tool_choice",
    )


def _format(text: Any) -> dict | None:
    """``text.format`` as a chat ``response_format``."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(text, dict) or (fmt is not None and not isinstance(fmt, dict)):
        raise bad("'text' must be {'format': {'type': 'text' | 'json_object' | ...}}", "text")
    if fmt is None or fmt.get("type") in ("text", "json_object"):
        return fmt
    if fmt.get("type") != "json_schema":
        raise bad("'text.format.type' must be 'text', 'json_object' or 'json_schema'", "text")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise bad("'text.format.schema' must be a JSON schema object", "text")
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": schema}}


def _effort(body: dict) -> str | None:
    """``reasoning.effort`` (the chat request's ``reasoning_effort``: "none" turns a thinking
    template's reasoning off)."""
    r = body.get("reasoning")
    if r is None:
        return None
    if not isinstance(r, dict):
        raise bad("'reasoning' must be an object, e.g. {'effort': 'low'}", "reasoning")
    return r.get("effort")


def _history(body: dict, store: Store) -> list:
    """The items of the conversation ``previous_response_id`` names ([] without one)."""
    prev = body.get("previous_response_id")
    if prev is None:
        return []
    if not isinstance(prev, str):
        raise bad("'previous_response_id' must be a string", "previous_response_id")
    held = store.get(prev)
    if held is None:
        raise APIError(
            404,
            f"previous response '{prev}' is not held here (the server keeps its last "
            f"{store.max_held} responses); send the whole conversation as 'input'",
            "previous_response_id",
            "previous_response_not_found",
        )
    return held[1]


def to_chat(body: Any, store: Store, images=None) -> tuple[dict, list]:
    """(the OpenAI chat body of a Responses request, the conversation items it continues
    plus its own input: what a later ``previous_response_id`` resumes).

    Args:
        body: the parsed request body. store: the responses held (``previous_response_id``).
        images: a ``server.images.Gather`` for ``input_image`` parts (None: the defaults).

    Raises:
        APIError: 400 naming the field, 404 for a ``previous_response_id`` not held.
    """
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", code="invalid_json")
    if body.get("store") is not None and not isinstance(body["store"], bool):
        raise bad("'store' must be a boolean (null: the default, true)", "store")
    for key, why in REFUSED.items():
        if body.get(key):
            raise bad(why, key)
    items = _history(body, store) + input_items(body)
    msgs = messages(items, images=images)
    ins = body.get("instructions")
    if ins is not None:
        if not isinstance(ins, str):
            raise bad("'instructions' must be a string", "instructions")
        msgs.insert(0, {"role": "system", "content": ins})
    if not msgs:
        raise bad("'input' is empty; send a string or at least one message", "input")
    chat: dict[str, Any] = {"messages": msgs, "stream": body.get("stream", False)}
    for k in ("model", "parallel_tool_calls", *PASSED):
        if body.get(k) is not None:
            chat[k] = body[k]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    chat["tools"] = _tools(body)
    chat["tool_choice"] = _tool_choice(body.get("tool_choice"))
    chat["response_format"] = _format(body.get("text"))
    if _effort(body) is not None:
        chat["reasoning_effort"] = _effort(body)
    return chat, items


# ----------------------------------------------------------------------------- routes


def _load(raw: bytes) -> Any:
    """The request body, parsed and within ``limits.MAX_BODY_DEPTH``."""
    try:
        body = json.loads(raw.decode("utf-8") if raw else "")
    except RecursionError:
        raise bad(
            "the request body is nested too deeply; flatten it", code="invalid_json"
        ) from None
    except ValueError as e:
        raise bad(f"the request body is not valid JSON ({e})", code="invalid_json") from None
    if isinstance(body, dict):
        try:
            check_body(body, SPELLING)
        except InputError as e:
            raise bad(str(e), e.field, "invalid_json") from None
    return body


def handle(h, path: str) -> None:
    """Answer ``POST /v1/responses``, holding the finished response (unless ``store`` is
    false) before its answer is sent, so a continuation sent at once finds it.

    Args:
        h: the ``http.Handler``. path: the route.

    Raises:
        APIError: the request's 4xx (in this API's field names), before any answer is sent.
    """
    if not h._authorized():
        raise h._unauthorized()
    srv, store = h.server, store_of(h.server)
    body = _load(h.body())
    images, block = srv.gather("input"), srv.engine.model.block_size
    try:
        chat, items = to_chat(body, store, images)
        req = parse_body(chat, "chat", srv.defaults, block, SPELLING, images)
        job = h.submit(req)
    except APIError as e:
        raise respell(e) from None

    def hold(done: dict) -> None:
        if body.get("store") is not False:
            store.put(done, items + done["output"])

    try:
        Answer(h, req, job, body, new_id(), hold).run()
    finally:
        job.cancel.set()  # no-op when finished; stops the generation otherwise


def get(h, path: str) -> None:
    """Answer ``GET /v1/responses/{id}`` with a held response.

    Args:
        h: the ``http.Handler``. path: ``/v1/responses/{id}``.

    Raises:
        APIError: 404 when the id is not held.
    """
    rid = path[len(RESPONSES) + 1 :]
    held = store_of(h.server).get(rid)
    if held is None:
        raise APIError(
            404,
            f"response '{rid}' is not held here (the server keeps its last {MAX_HELD})",
            None,
            "response_not_found",
        )
    h._send_json(200, held[0])
