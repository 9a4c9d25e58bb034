"""The tools side of a chat request: validate ``tools`` / ``tool_choice``, put the tools and
the tool-call history through the chat template, and the grammar that forces a call.

Templates with their own tool support (they use the ``tools`` variable) get the tools and the
history as they are (OpenAI's shape, arguments as objects). Templates without it (the demo's
SmolLM2 ChatML) get the documented fallback: a system message listing the tools and asking
for Hermes-style ``<tool_call>`` lines (``FALLBACK_PROMPT``), earlier calls written back as
those lines, and tool results as user turns in ``<tool_response>`` tags; a forced
``"required"`` choice then allows one call unless ``parallel_tool_calls`` is true.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..decoding.grammar import JSON_STYLE, GrammarError, check_grammar, closed, json_schema_grammar
from .limits import (
    MAX_ARGUMENT_VALUES,
    OPENAI,
    InputError,
    Names,
    check_json,
    check_schema,
    load_json,
)
from .schema import bad
from .tools import HERMES, LLAMA3, template_text, tool_format

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
CHOICES = ("auto", "none", "required")
MAX_TOOLS = 128  # as OpenAI's API; each tool's schema is compiled once per request

FALLBACK_PROMPT = (
    "You can call functions. These are their JSON schemas:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with one block per call and nothing else:\n"
    '<tool_call>\n{{"name": "<function name>", "arguments": <arguments as a JSON object>}}\n'
    "</tool_call>\nA function's result comes back in <tool_response> tags."
)


@dataclass
class ToolSpec:
    """The validated tools of a request.

    Attributes:
        tools: OpenAI tool objects ({"type": "function", "function": {...}}).
        choice: "auto", "none", "required" or a function name. parallel: more than one
            call allowed. fmt: the call format the template speaks (``tools.HERMES`` /
            ``tools.LLAMA3``). native: the template renders tools itself.
    """

    tools: list[dict] = field(default_factory=list)
    choice: str = "auto"
    parallel: bool = True
    fmt: str = HERMES
    native: bool = False

    @property
    def active(self) -> bool:
        """Whether the answer is parsed for tool calls."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        """Whether a call is enforced by a grammar (required or a named function)."""
        return self.active and self.choice != "auto"


def _function(t: Any, i: int, names: Names) -> dict:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type", "function") != "function":
        raise bad(f"{where} must be {{'type': 'function', 'function': {{...}}}}", "tools")
    fn = t.get("function")
    if not isinstance(fn, dict):
        raise bad(f"{where}.function must be an object with a 'name'", "tools")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        shown = name if isinstance(name, str) else type(name).__name__
        raise bad(
            f"{names.tool(i, 'name')} must match [A-Za-z0-9_.-]{{1,64}} (got {shown!r})", "tools"
        )
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise bad(f"{names.tool(i, 'description')} must be a string", "tools")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    where = names.tool(i, "parameters")
    if not isinstance(params, dict):
        raise bad(f"{where} must be a JSON schema object", "tools")
    try:
        check_schema(params, where, names)
        check_grammar(json_schema_grammar(params))
    except InputError as e:
        raise bad(str(e), "tools") from None
    except GrammarError as e:
        raise bad(f"{where} is not a usable JSON schema: {e}", "tools") from None
    out = {"name": name, "parameters": params}
    if fn.get("description"):
        out["description"] = fn["description"]
    return {"type": "function", "function": out}


def _choice(raw: Any, names: list[str], spelling: Names) -> str:
    if raw is None:
        return "auto" if names else "none"
    if isinstance(raw, str):
        if raw not in CHOICES:
            raise bad(f"'tool_choice' must be one of {list(CHOICES)} or a function", "tool_choice")
        if raw == "required" and not names:
            raise bad("'tool_choice' is 'required' but no 'tools' were given", "tool_choice")
        return raw
    fn = raw.get("function") if isinstance(raw, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad(
            "'tool_choice' must be a string or {'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )
    if name not in names:
        where = spelling.choice_name
        raise bad(f"'{where}' is '{name}', which is not among 'tools'", "tool_choice")
    return name


def parse_tools(body: dict, tokenizer, spelling: Names = OPENAI) -> ToolSpec:
    """Validate ``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request.

    Args:
        body: the request. tokenizer: the model's (its template decides the call format).
        spelling: how errors write fields (``limits.ANTHROPIC`` for the Messages API).

    Raises:
        APIError: 400 naming the field.
    """
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise bad("'tools' must be a list of function tools", "tools")
    if len(raw or []) > MAX_TOOLS:
        raise bad(f"'tools' has {len(raw)} tools; at most {MAX_TOOLS} are supported", "tools")
    tools = [_function(t, i, spelling) for i, t in enumerate(raw or [])]
    names = [t["function"]["name"] for t in tools]
    twice = [n for n, k in Counter(names).items() if k > 1]
    if twice:
        raise bad(f"'tools' has two tools of the same name ({twice[0]!r})", "tools")
    par = body.get("parallel_tool_calls")
    if par is not None and not isinstance(par, bool):
        raise bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    text = template_text(tokenizer)
    native = "tools" in text
    # Unset: OpenAI's default (several calls) where the template knows tools; with the
    # fallback prompt one call, since a model untrained for tools repeats its call until the
    # budget runs out when more are allowed.
    parallel = par if par is not None else native
    return ToolSpec(tools, _choice(body.get("tool_choice"), names, spelling), parallel,
                    tool_format(text), native)  # fmt: skip


def history_fields(m: dict, i: int) -> dict[str, Any]:
    """The tool fields of a history message (assistant ``tool_calls``, a tool's
    ``tool_call_id``), validated; arguments come back as objects where they parse."""
    out: dict[str, Any] = {}
    calls = m.get("tool_calls")
    if calls is not None and m.get("role") == "assistant":
        if not isinstance(calls, list):
            raise bad(f"messages[{i}].tool_calls must be a list", "messages")
        out["tool_calls"] = [_history_call(c, i, j) for j, c in enumerate(calls)]
    if m.get("role") == "tool":
        cid = m.get("tool_call_id")
        if cid is not None and not isinstance(cid, str):
            raise bad(f"messages[{i}].tool_call_id must be a string", "messages")
        out["tool_call_id"] = cid or ""
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
    return out


def _history_call(c: Any, i: int, j: int) -> dict:
    where = f"messages[{i}].tool_calls[{j}]"
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad(f"{where} must be {{'id', 'type': 'function', 'function': {{name, arguments}}}}",
                  "messages")  # fmt: skip
    args = fn.get("arguments", "{}")
    try:
        if not isinstance(args, str):  # an object already (some clients send one)
            check_json(args, f"{where}.function.arguments", max_values=MAX_ARGUMENT_VALUES)
        elif args.strip():
            args = load_json(args, f"{where}.function.arguments")
        else:
            args = {}
    except InputError as e:
        raise bad(str(e), "messages") from None
    if not isinstance(args, dict):
        raise bad(f"{where}.function.arguments must be a JSON object", "messages")
    return {
        "id": str(c.get("id") or f"call_{i}_{j}"),
        "type": "function",
        "function": {"name": fn["name"], "arguments": args},
    }


def render(messages: list[dict], spec: ToolSpec):
    """(messages for the template, the ``tools`` to pass it or None).

    Native templates get both as they are; otherwise the fallback format (module doc)."""
    if spec.native:
        return messages, (spec.tools or None) if spec.choice != "none" else None
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            lines = [_call_text(c["function"]["name"], c["function"]["arguments"], spec.fmt)
                     for c in m.pop("tool_calls")]  # fmt: skip
            m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + lines)
        if m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        m.pop("tool_call_id", None), m.pop("name", None)
        out.append(m)
    if spec.active:
        listing = "\n".join(json.dumps(t) for t in spec.tools)
        system = FALLBACK_PROMPT.format(tools=listing)
        if spec.forced and spec.choice != "required":
            system += f"\nCall the function {spec.choice} now."
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out, None


def _call_text(name: str, args: dict, fmt: str) -> str:
    if fmt == LLAMA3:
        return json.dumps({"name": name, "parameters": args})
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def call_grammar(spec: ToolSpec) -> str | None:
    """The llguidance grammar forcing a call (``required``: any tool, several when parallel;
    a named function: that one), or None when nothing is forced."""
    from ..decoding.grammar import lark_grammar

    if not spec.forced:
        return None
    key = "parameters" if spec.fmt == LLAMA3 else "arguments"
    fns = [t["function"] for t in spec.tools]
    if spec.choice != "required":
        fns = [f for f in fns if f["name"] == spec.choice]
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, key: closed(f["parameters"])},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for f in fns
    ]
    schema = dict(
        options[0] if len(options) == 1 else {"anyOf": options}, **{"x-guidance": JSON_STYLE}
    )
    call = "%json " + json.dumps(schema)
    if spec.fmt != LLAMA3:
        call = '"<tool_call>\\n" ' + call + ' "\\n</tool_call>"'
    many = spec.parallel and spec.choice == "required"
    sep = '"; "' if spec.fmt == LLAMA3 else '"\\n"'
    return lark_grammar(f"start: call ({sep} call)*\ncall: {call}" if many else f"start: {call}")
