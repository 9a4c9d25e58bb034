"""A thinking model's reasoning in ``dflash run`` and ``dflash chat``: the ``--no-think`` and
``--thinking-budget`` options, the template variable and the logits processor they become,
and the reasoning shown apart from the answer (dim, on its own lines)."""

from __future__ import annotations

import typer

from ..errors import DFlashError

NO_THINK = typer.Option(
    False,
    "--no-think",
    help="Thinking models (<think> in the template): answer without reasoning "
    "(enable_thinking=false).",
)
THINKING_BUDGET = typer.Option(
    None,
    "--thinking-budget",
    help="Thinking models: close the reasoning after this many tokens (the template's "
    "</think> is forced there).",
    show_default=False,
)


def template_kwargs(think: bool | None) -> dict | None:
    """The chat template's variables for a thinking switch.

    Args:
        think: reasoning on or off (None: the template's default, no variable).
    """
    return None if think is None else {"enable_thinking": think}


def check_budget(budget: int | None) -> int | None:
    """A ``--thinking-budget`` value: None or >= 0.

    Args:
        budget: the option's value.

    Raises:
        DFlashError: a negative budget.
    """
    if budget is not None and budget < 0:
        raise DFlashError(f"--thinking-budget must be 0 or more tokens (got {budget})")
    return budget


def processors(tok, ids: list[int], budget: int | None) -> list:
    """The logits processor that closes the reasoning at ``budget`` tokens (none without a
    budget or thinking markers).

    Args:
        tok: the model's tokenizer. ids: the prompt. budget: reasoning tokens, or None.
    """
    from ..server.reasoning import marker_ids, markers, starts_open

    marks = markers(tok)
    if budget is None or marks is None:
        return []
    from ..decoding.thinking import ThinkingGate

    opened, closed = marker_ids(tok, marks)
    return [ThinkingGate(opened, closed, starts_open(tok, ids, marks), budget=budget)]


class Shown:
    """Streamed answer text split into reasoning and content for a terminal.

    Args:
        tok: the model's tokenizer. ids: the prompt (it may open the reasoning).
        write: writes content. think: writes reasoning (None: reasoning is dropped).
    """

    def __init__(self, tok, ids: list[int], write, think=None):
        from ..server.reasoning import Splitter, markers, starts_open

        marks = markers(tok)
        self.split = Splitter(marks, starts_open(tok, ids, marks)) if marks else None
        self.write, self.think = write, think
        self.reasoning, self.content = [], []
        self.thought = False  # reasoning was shown: the answer starts on a new line

    def feed(self, text: str, final: bool = False) -> None:
        """Show a piece of the answer (``final``: the answer ends with it)."""
        if self.split is None:
            pieces = [("content", text)] if text else []
        else:
            pieces = self.split.feed(text) + (self.split.close() if final else [])
        for kind, val in pieces:
            if kind == "reasoning":
                self.reasoning.append(val)
                if self.think is not None:
                    self.think(val)
                    self.thought = True
                continue
            if self.thought:  # the reasoning's own line(s), then a blank one
                self.think("\n\n")
                self.thought = False
            self.content.append(val)
            self.write(val)

    def close(self) -> None:
        """End the answer (text held back at a possible marker is shown)."""
        self.feed("", final=True)
        if self.thought:
            self.think("\n")
            self.thought = False
