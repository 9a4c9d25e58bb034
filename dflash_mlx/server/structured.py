"""Agent features of a chat request shared by the OpenAI and Anthropic routes: tools and
``response_format`` become a grammar (``dflash_mlx.decoding.grammar``) that constrains the target at
every verify row (after a thinking model's reasoning, ``decoding.thinking``), and the answer's
reasoning (``reasoning.py``) and tool calls become OpenAI ``reasoning_content`` and
``tool_calls``.

``prepare`` runs in the HTTP thread before the job is queued, so a bad schema is a 400.
"""

from __future__ import annotations

from typing import Any

from ..decoding.grammar import GrammarError, check_grammar, json_schema_grammar, make_processor
from ..decoding.prompt import end_of_turn_ids
from .limits import InputError, check_schema
from .reasoning import Splitter, marker_ids, request_options, split
from .schema import APIError, bad
from .tool_request import ToolSpec, call_grammar, history_fields, parse_tools, render
from .tools import CallStream, parse_calls

SCHEMA = "response_format.json_schema.schema"


def response_format_grammar(rf: Any) -> str | None:
    """The grammar of OpenAI's ``response_format`` (None for text).

    Raises:
        APIError: 400 naming ``response_format``.
    """
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar(True)
    if kind != "json_schema":
        raise bad(
            "'response_format.type' must be 'text', 'json_object' or 'json_schema'",
            "response_format",
        )
    js = rf.get("json_schema")
    schema = js.get("schema", True) if isinstance(js, dict) else None
    if not isinstance(schema, dict) and schema is not True:
        raise bad(
            "'response_format.json_schema' must be {'name': ..., 'schema': {...}}",
            "response_format",
        )
    try:
        check_schema(schema, SCHEMA)
        grammar = json_schema_grammar(schema)
        check_grammar(grammar)
    except InputError as e:
        raise bad(str(e), "response_format") from None
    except GrammarError as e:
        raise bad(f"'{SCHEMA}' is not usable: {e}", "response_format") from None
    return grammar


def prepare(req, body: dict, tokenizer) -> None:
    """Set ``req.tools`` and ``req.grammar`` from the body, and turn the messages (with
    their tool calls and results) into what the chat template takes (``req.prompt``,
    ``req.template_tools``, ``req.template_kwargs``); ``req.thinking_budget``.

    Raises:
        APIError: 400 naming the field at fault.
    """
    spec = parse_tools(body, tokenizer, req.names)
    msgs = []
    for i, m in enumerate(req.prompt):
        m = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id", "name")}
        msgs.append({**m, **history_fields(body["messages"][i], i)})
    req.prompt, req.template_tools = render(msgs, spec)
    req.tools = spec
    req.grammar = call_grammar(spec) or response_format_grammar(body.get("response_format"))
    req.template_kwargs, req.thinking_budget = request_options(body)


def prepare_completion(req, body: dict) -> None:
    """Set ``req.grammar`` of a /v1/completions request from its ``response_format`` (the
    raw continuation is constrained as a chat answer is); ``tools`` have no chat template
    to go through there and are refused.

    Raises:
        APIError: 400 naming ``tools`` / ``tool_choice`` / ``response_format``.
    """
    for field in ("tools", "tool_choice"):
        if body.get(field) is not None:
            raise bad(f"'{field}' needs /v1/chat/completions; /v1/completions takes none", field)
    req.grammar = response_format_grammar(body.get("response_format"))


def processors(req, tokenizer, vocab_size: int) -> list:
    """The logits processors that enforce ``req.grammar`` (none without one) and the
    thinking budget; with a thinking model's markers (``req.marks``) the grammar applies
    after the reasoning.

    Raises:
        APIError: 400 naming the schema the tokenizer's grammar cannot follow.
    """
    grammar = None
    if getattr(req, "grammar", None):
        eos = set(getattr(tokenizer, "eos_token_ids", None) or []) | end_of_turn_ids(tokenizer)
        eos = sorted(eos) or None
        try:
            grammar = make_processor(tokenizer, vocab_size, req.grammar, eos)
        except GrammarError as e:
            raise _unusable(req, tokenizer, vocab_size, eos, e) from None
    budget = getattr(req, "thinking_budget", None)
    marks = getattr(req, "marks", None)
    if marks is None or (grammar is None and budget is None):
        return [grammar] if grammar is not None else []
    from ..decoding.thinking import ThinkingGate

    opened, closed = marker_ids(tokenizer, marks)
    return [ThinkingGate(opened, closed, req.started_open, grammar, budget)]


def _unusable(req, tokenizer, vocab_size: int, eos, err: GrammarError) -> APIError:
    """The 400 of a grammar that compiled but cannot be followed (``grammar.check_start``),
    naming the forced tool whose parameters fail alone, or ``response_format``."""
    spec, names = req.tools, req.names
    if spec is None or not spec.forced:
        return bad(f"'{SCHEMA}' cannot be followed: {err}", "response_format")
    for i, t in enumerate(spec.tools):
        fn = t["function"]
        if spec.choice not in ("required", fn["name"]):
            continue
        try:
            make_processor(tokenizer, vocab_size, json_schema_grammar(fn["parameters"]), eos)
        except GrammarError as e:
            where = names.tool(i, "parameters")
            return bad(f"{where} cannot be followed: {e}", "tools")
    return bad(f"the forced tool call cannot be followed: {err}", "tool_choice")


def message(text: str, spec: ToolSpec | None, finish: str | None, marks=None, opened=False):
    """(the assistant message, the finish reason) of a whole answer: its reasoning (with a
    thinking model's ``marks``; ``opened``: the prompt opened it) as ``reasoning_content``,
    tool calls parsed from the text after the reasoning."""
    reasoning, text = split(text, marks, opened)
    thought = {} if reasoning is None else {"reasoning_content": reasoning}
    if spec is None or not spec.active:
        return {"role": "assistant", "content": text, **thought}, finish
    content, calls = parse_calls(text, spec.fmt)
    msg = {"role": "assistant", "content": content, **thought}
    if calls:
        msg["tool_calls"] = [c.openai() for c in calls]
    return msg, "tool_calls" if calls and finish == "stop" else finish


class DeltaStream:
    """Streamed text as OpenAI chat deltas: ``reasoning_content`` (with a thinking model's
    ``marks``; ``opened``: the prompt opened the reasoning), content, or ``tool_calls``
    entries once a call is whole (its id, name and arguments in one delta)."""

    def __init__(self, spec: ToolSpec | None, marks=None, opened: bool = False):
        self.calls = 0
        self.split = CallStream(spec.fmt) if spec is not None and spec.active else None
        self.thinking = Splitter(marks, opened) if marks is not None else None

    def deltas(self, text: str, final: bool) -> list[dict]:
        """Deltas for a piece of text (``final``: the answer ends with it)."""
        if self.thinking is None:
            return self._content(text, final)
        pieces = self.thinking.feed(text) + (self.thinking.close() if final else [])
        out = [{"reasoning_content": v} for k, v in pieces if k == "reasoning"]
        return out + self._content("".join(v for k, v in pieces if k == "content"), final)

    def _content(self, text: str, final: bool) -> list[dict]:
        """Deltas of the text after the reasoning: content and whole tool calls."""
        if self.split is None:
            return [{"content": text}] if text else []
        events = self.split.feed(text) + (self.split.close() if final else [])
        out = []
        for kind, val in events:
            if kind == "text":
                out.append({"content": val})
            else:
                out.append({"tool_calls": [val.openai(self.calls)]})
                self.calls += 1
        return out

    def finish(self, finish: str | None) -> str | None:
        """OpenAI's reason: "tool_calls" when the answer ended with calls."""
        return "tool_calls" if self.calls and finish == "stop" else finish
