"""A thinking model's reasoning in the logits: a processor that leaves the reasoning free,
applies a grammar (JSON schema, forced tool call) only after the closing marker, and ends
the reasoning with that marker when a thinking budget runs out.

Exact under speculation as ``grammar.py``'s processor is: each verify row is processed from
the prefix it follows, so a row's law depends on that prefix alone. Rows inside the
reasoning and under the budget are the target's (untouched logits); the row at which the
reasoning holds ``budget`` tokens allows only the closing marker; rows after the marker are
the grammar's (or untouched without one).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


class ThinkingGate:
    """An mlx-lm style logits processor ``(tokens, logits) -> logits`` for one generation;
    its first call (the prompt) fixes where the answer starts.

    Args:
        open_id, close_id: the thinking markers' token ids.
        started_open: the prompt opens the reasoning (``server.reasoning.starts_open``);
            otherwise the answer may open it with its first token.
        inner: a processor that applies after the reasoning (a ``GrammarProcessor`` with a
            ``base``), or None.
        budget: reasoning tokens before the closing marker is forced (None: no limit).
    """

    def __init__(self, open_id: int, close_id: int, started_open: bool, inner=None, budget=None):
        self.open_id, self.close_id, self.started_open = open_id, close_id, started_open
        self.inner, self.budget = inner, budget
        self.base: int | None = None

    def _reasoning_start(self, answer: np.ndarray) -> int | None:
        """Where the reasoning starts in the answer (None: the answer has none)."""
        if self.started_open:
            return 0
        return 1 if answer.size and answer[0] == self.open_id else None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        """Process one row: tokens [T] (prompt + answer so far), logits [1, V]."""
        if self.base is None:
            self.base = int(tokens.size)
        # numpy, not a list: a long reasoning is read at every verify row
        answer = np.asarray(tokens)[self.base :]  # [T - base]
        if not answer.size and not self.started_open:
            return self._first(tokens, logits)
        start = self._reasoning_start(answer)
        if start is None:
            return self._after(tokens, logits, self.base)
        closes = np.flatnonzero(answer[start:] == self.close_id)
        if closes.size:
            return self._after(tokens, logits, self.base + start + int(closes[0]) + 1)
        if self.budget is not None and answer.size - start >= self.budget:
            only = mx.arange(logits.shape[-1]) == self.close_id  # [V]
            return mx.where(only[None], logits, mx.array(-mx.inf, logits.dtype))
        return logits

    def _first(self, tokens: mx.array, logits: mx.array) -> mx.array:
        """The answer's first row: the grammar's choices and the opening marker."""
        if self.inner is None:
            return logits
        masked = self._after(tokens, logits, self.base)
        keep = mx.arange(logits.shape[-1]) == self.open_id  # [V]
        return mx.where(keep[None], logits, masked)

    def _after(self, tokens: mx.array, logits: mx.array, start: int) -> mx.array:
        """A row after the reasoning: the inner processor's, its answer starting at start."""
        if self.inner is None:
            return logits
        self.inner.base = start  # the grammar's answer begins after the marker
        return self.inner(tokens, logits)
