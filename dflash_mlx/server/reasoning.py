"""Reasoning kept apart from the answer: a thinking model's template markers (Qwen3's
``<think>`` / ``</think>``), whether a prompt already opens a thinking section, and a splitter
of the answer's text (whole or streamed) into reasoning and content. No MLX.

The text between the markers is the reasoning; what follows the closing marker is the
content (tool calls are parsed from it alone). As Qwen3's template writes an earlier turn's
reasoning back, the newlines around the reasoning and those opening the content are dropped.
"""

from __future__ import annotations

import weakref

from .schema import bad
from .tools import partial_suffix, template_text

# (open, close) marker pairs a template may use (Qwen3 / DeepSeek's first, the others as
# mlx-lm knows them); each is one token of the vocabulary
PAIRS = (
    ("<think>", "</think>"),
    ("<longcat_think>", "</longcat_think>"),
    ("<|think:start|>", "<|think:end|>"),
)
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's reasoning_effort
# apply_chat_template's own parameters: a chat_template_kwargs key may not override them
RESERVED = {"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
            "add_generation_prompt", "continue_final_message", "padding", "truncation",
            "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
            "tokenizer_kwargs"}  # fmt: skip

Marks = tuple[str, str]
_found: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _vocab(tokenizer) -> dict:
    get = getattr(tokenizer, "get_vocab", None)
    try:
        return get() if callable(get) else dict(getattr(tokenizer, "vocab", {}) or {})
    except (TypeError, ValueError, AttributeError):
        return {}


def markers(tokenizer) -> Marks | None:
    """The (open, close) thinking markers of a tokenizer whose vocabulary holds both as
    tokens and whose chat template mentions them; None for models without thinking.
    Found once per tokenizer (reading a large vocabulary takes milliseconds).

    Args:
        tokenizer: mlx-lm TokenizerWrapper or a Hugging Face tokenizer.
    """
    return _lookup(tokenizer)[0]


def _lookup(tokenizer) -> tuple[Marks | None, tuple[int, int] | None]:
    """(markers, their ids), once per tokenizer."""
    try:
        if tokenizer in _found:
            return _found[tokenizer]
        _found[tokenizer] = found = _markers(tokenizer)
        return found
    except TypeError:  # not weakly referenceable: look each time
        return _markers(tokenizer)


def _markers(tokenizer) -> tuple[Marks | None, tuple[int, int] | None]:
    template = template_text(tokenizer)
    if not template:
        return None, None
    vocab = _vocab(tokenizer)
    for pair in PAIRS:
        if all(m in vocab for m in pair) and any(m in template for m in pair):
            return pair, (vocab[pair[0]], vocab[pair[1]])
    return None, None


def marker_ids(tokenizer, marks: Marks) -> tuple[int, int]:
    """The token ids of the (open, close) markers (``markers`` checked both are tokens).

    Args:
        tokenizer: the model's tokenizer. marks: from ``markers``.
    """
    found, ids = _lookup(tokenizer)
    if found == marks and ids is not None:
        return ids
    vocab = _vocab(tokenizer)
    return vocab[marks[0]], vocab[marks[1]]


def starts_open(tokenizer, prompt, marks: Marks | None = None) -> bool:
    """Whether a prompt ends inside a thinking section (a template that writes ``<think>\\n``
    into the generation prompt), so the answer begins as reasoning.

    Args:
        tokenizer: the model's tokenizer. prompt: the prompt's token ids or its text.
        marks: the markers (default: ``markers(tokenizer)``).
    """
    marks = marks or markers(tokenizer)
    if marks is None:
        return False
    if isinstance(prompt, str):
        return prompt.rfind(marks[0]) > prompt.rfind(marks[1])
    opened, closed = marker_ids(tokenizer, marks)
    for t in reversed(list(prompt)):  # the last marker decides
        if int(t) in (opened, closed):
            return int(t) == opened
    return False


def split(text: str, marks: Marks | None, started_open: bool) -> tuple[str | None, str]:
    """A whole answer as (its reasoning, or None when it has none; the content after the
    closing marker). An answer cut off while reasoning has content ''.

    Args:
        text: the answer's text. marks: from ``markers`` (None: no reasoning).
        started_open: from ``starts_open``: the answer begins inside the reasoning.
    """
    s = Splitter(marks, started_open)
    events = s.feed(text) + s.close()
    content = "".join(v for k, v in events if k == "content")
    return (s.reasoning_text if s.saw_reasoning else None), content


class Splitter:
    """Streamed answer text as ("reasoning", str) and ("content", str) pieces, each given as
    soon as it is certain: a partial marker at the end, the newlines that may end the
    reasoning, and the start of an answer that may open with the marker are held back.

    Args:
        marks: from ``markers`` (None: all of the text is content).
        started_open: the answer begins inside the reasoning (``starts_open``).
    """

    def __init__(self, marks: Marks | None, started_open: bool):
        self.marks = marks
        self.state = "content" if marks is None else ("reasoning" if started_open else "start")
        self.buf = ""
        self.lead = started_open  # newlines opening the reasoning or the content are dropped
        self.saw_reasoning = marks is not None and started_open
        self.reasoning_text = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        """The pieces ``text`` completes (adjacent pieces of one kind merged)."""
        self.buf += text
        out: list[tuple[str, str]] = []
        while self.buf:
            before = (self.state, self.buf)
            getattr(self, "_" + self.state)(out)
            if (self.state, self.buf) == before:
                break  # waiting for more text
        return _merged(out)

    def close(self) -> list[tuple[str, str]]:
        """The pieces left at the end of the answer (an unclosed marker's text as it is)."""
        rest, self.buf = self.buf, ""
        out: list[tuple[str, str]] = []
        if self.state == "reasoning":
            self._emit(out, "reasoning", rest.rstrip("\n"))
        elif self.state == "start":
            self._emit(out, "content", rest)
        else:
            self._emit(out, "content", rest.lstrip("\n") if self.lead else rest)
        return _merged(out)

    def _emit(self, out: list, kind: str, s: str) -> None:
        if s:
            out.append((kind, s))
            if kind == "reasoning":
                self.reasoning_text += s

    def _start(self, out: list) -> None:
        """Before the first visible text: the answer may open the reasoning itself."""
        head = self.buf.lstrip()
        opened = self.marks[0]
        if head.startswith(opened):
            self.buf, self.state = head[len(opened) :], "reasoning"
            self.lead = self.saw_reasoning = True
        elif head and not opened.startswith(head):
            self.state, self.lead = "content", False

    def _reasoning(self, out: list) -> None:
        if self.lead:  # the newline(s) after the opening marker
            self.buf = self.buf.lstrip("\n")
            if not self.buf:
                return
            self.lead = False
        closing = self.marks[1]
        i = self.buf.find(closing)
        if i >= 0:
            self._emit(out, "reasoning", self.buf[:i].rstrip("\n"))
            self.buf, self.state, self.lead = self.buf[i + len(closing) :], "content", True
            return
        keep = partial_suffix(self.buf, closing)
        body = self.buf[: len(self.buf) - keep]
        sure = body.rstrip("\n")  # newlines right before the marker are not reasoning
        self._emit(out, "reasoning", sure)
        self.buf = self.buf[len(sure) :]

    def _content(self, out: list) -> None:
        if self.lead:
            self.buf = self.buf.lstrip("\n")
            if not self.buf:
                return
            self.lead = False
        self._emit(out, "content", self.buf)
        self.buf = ""


class ReasoningTokens:
    """Counts an answer's reasoning tokens as they stream: its thinking section, with the
    markers the model wrote (so the rest of ``completion_tokens`` is the content's). The
    one count of every API: chat's ``completion_tokens_details``, Responses'
    ``output_tokens_details`` and Anthropic's ``usage.output_tokens_details``.

    Args:
        tokenizer: the model's. marks: from ``markers`` (None: nothing is counted).
        started_open: the prompt opens the reasoning (``starts_open``).
    """

    def __init__(self, tokenizer, marks: Marks | None, started_open: bool):
        self.ids = marker_ids(tokenizer, marks) if marks is not None else None
        self.state = "reasoning" if started_open else "start"
        self.n = 0

    def feed(self, tokens) -> None:
        """Count the reasoning among the next answer tokens."""
        if self.ids is None:
            return
        opened, closed = self.ids
        for t in tokens:
            if self.state == "start":  # the answer may open the reasoning itself
                self.state = "reasoning" if t == opened else "done"
                self.n += t == opened
            elif self.state == "reasoning":
                self.n += 1
                if t == closed:
                    self.state = "done"

    @property
    def count(self) -> int | None:
        """Reasoning tokens so far (None: not a thinking model)."""
        return None if self.ids is None else self.n


def _merged(pieces: list[tuple[str, str]]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for kind, s in pieces:
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + s)
        else:
            out.append((kind, s))
    return out


def request_options(body: dict) -> tuple[dict | None, int | None]:
    """(the chat template's extra variables, the thinking budget in tokens) of an OpenAI chat
    request: ``chat_template_kwargs`` (e.g. ``{"enable_thinking": false}``),
    ``reasoning_effort`` ("none" turns thinking off; the others keep the template's
    default) and ``thinking_budget`` (reasoning tokens before the closing marker is forced).

    Args:
        body: the request object (checked by ``limits.check_body``).

    Raises:
        APIError: 400 naming the field.
    """
    kw = body.get("chat_template_kwargs")
    if kw is not None:
        if not isinstance(kw, dict):
            raise bad("'chat_template_kwargs' must be an object, e.g. {\"enable_thinking\": false}",
                      "chat_template_kwargs")  # fmt: skip
        for k in kw:
            if not k.isidentifier() or k in RESERVED:
                raise bad(f"'chat_template_kwargs' cannot set {k!r}; give template variables "
                          "such as 'enable_thinking'", "chat_template_kwargs")  # fmt: skip
        if not isinstance(kw.get("enable_thinking", True), bool):
            raise bad("'chat_template_kwargs.enable_thinking' must be true or false",
                      "chat_template_kwargs")  # fmt: skip
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in EFFORTS:
        raise bad(f"'reasoning_effort' must be one of {list(EFFORTS)}", "reasoning_effort")
    if effort == "none":  # the explicit template variable wins
        kw = {"enable_thinking": False, **(kw or {})}
    return kw or None, budget(body.get("thinking_budget"), "thinking_budget")


def budget(value, field: str) -> int | None:
    """A thinking budget: None, or a whole number of tokens >= 0.

    Args:
        value: the request's value. field: its name in the error.

    Raises:
        APIError: 400 naming ``field``.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise bad(f"'{field}' must be a whole number of tokens >= 0 (got {value!r})", field)
    return value
