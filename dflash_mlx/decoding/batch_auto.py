"""``block_size="auto"`` for a batch: each cycle a verify width L for the batch and, per
row, whether it drafts (the drafter), copies from its context (``lookup.py``) or steps
plainly, from the batch's own measured costs and each row's live acceptance.

A batched cycle verifies B rows x L tokens in one forward (a row narrower than L is padded;
its extra positions are causally masked and discarded), so a row's own block inside L
costs the target nothing more; what a drafting row adds is its share of the drafter's head
(the drafter's main cost). ``BatchCosts`` models a cycle's seconds as linear in what it
computes, ``a + b*B + c*B*L + d*D*(L-1)`` (D: rows the drafter drafts for), fitted online
by least squares over decayed observations around a prior from the warm-up's single-row
tables; each (B, L, drafting) seen also keeps its own correction, since a CPU's cost is
not linear in B*L (BLAS splits by shape). Only past cycles are used: every plan is lossless.
"""

from __future__ import annotations

import numpy as np

from . import lookup
from .costs import EMA
from .estimates import expected_tokens
from .probe import PROBE_MAX, PROBE_START
from .schedule import GAIN_MARGIN

FORGET = 0.97  # per-cycle decay of the cost fit's observations (the machine drifts)
PRIOR_WEIGHT = 0.5  # weight of each warm-up point in the cost fit (observations weigh 1)


def _features(rows: int, width: int, drafting: int) -> np.ndarray:
    """[1, B, B*L, D*(L-1)]: what a batched cycle computes."""
    return np.array([1.0, rows, rows * width, drafting * (width - 1)])


class BatchCosts:
    """Seconds per batched cycle, predicted for any (rows, width, drafting rows).

    Args:
        drafted: single-row seconds by block width (the warm-up's drafted table; 1 = plain).
        copied: the same for cycles without a drafter pass (None: the drafted table minus
            nothing, i.e. drafting assumed free until measured).
    """

    def __init__(self, drafted: dict[int, float], copied: dict[int, float] | None = None):
        self.prior_a, self.prior_v = np.zeros((4, 4)), np.zeros(4)
        for b, s in drafted.items():
            self._add(self.prior_a, self.prior_v, _features(1, b, int(b > 1)), s, PRIOR_WEIGHT)
        for b, s in (copied or {}).items():
            self._add(self.prior_a, self.prior_v, _features(1, b, 0), s, PRIOR_WEIGHT)
        self.a, self.v = np.zeros((4, 4)), np.zeros(4)
        self.ratio: dict[tuple, float] = {}  # measured / linear, per (B, L, drafting > 0)
        self.theta = self._solve()

    @staticmethod
    def _add(a, v, x, y, w):
        a += w * np.outer(x, x)
        v += w * x * y

    def _solve(self) -> np.ndarray:
        a = self.prior_a + self.a
        ridge = 1e-6 * np.trace(a) * np.eye(4)
        return np.maximum(np.linalg.solve(a + ridge, self.prior_v + self.v), 0.0)

    def linear(self, rows: int, width: int, drafting: int) -> float:
        """The fitted model's seconds."""
        return max(float(_features(rows, width, drafting) @ self.theta), 1e-6)

    def __call__(self, rows: int, width: int, drafting: int) -> float:
        """Predicted seconds of a cycle: the fit, times this shape's measured correction."""
        key = (rows, width, drafting > 0)
        return self.linear(rows, width, drafting) * self.ratio.get(key, 1.0)

    def observe(self, rows: int, width: int, drafting: int, seconds: float) -> None:
        """Fold in one measured cycle."""
        if seconds <= 0:
            return
        self.a *= FORGET
        self.v *= FORGET
        self._add(self.a, self.v, _features(rows, width, drafting), seconds, 1.0)
        self.theta = self._solve()
        key, r = (rows, width, drafting > 0), seconds / self.linear(rows, width, drafting)
        old = self.ratio.get(key)
        self.ratio[key] = r if old is None else (1 - EMA) * old + EMA * r


class Option:
    """One row's part of a plan: its block (1: plain), whether its drafts are copied from
    its context, and the tokens it is expected to commit."""

    __slots__ = ("block", "copy", "tokens")

    def __init__(self, block: int, copy: bool, tokens: float):
        self.block, self.copy, self.tokens = block, copy, tokens

    @property
    def drafts(self) -> bool:
        """Whether the drafter drafts for this row."""
        return self.block > 1 and not self.copy


class BatchPlanner:
    """Per cycle, the plan of every row (``plan``) and what the cycle taught (``record``).

    Args:
        costs: the batch's cost model. max_block: the checkpoint's block.
    """

    def __init__(self, costs: BatchCosts, max_block: int):
        self.costs, self.max_block = costs, max_block
        self.since_spec, self.probe_after = 0, PROBE_START
        self._matches: list[int] = []  # each row's lookup match, this cycle

    def plan(self, rows: list) -> list[Option]:
        """Each row's Option for the next cycle.

        Args:
            rows: the decoding rows (``batch.Row``): ``sched`` (a ``Scheduler``, None for a
                row with a fixed block), ``block``, ``index`` and the budget left.
        """
        fixed = [r.block for r in rows if r.sched is None]
        low = max([1, *fixed])
        self._matches = [0 if r.index is None else r.index.match()[0] for r in rows]
        mean = self._best(rows, max(low, 2), optimistic=False)
        plain = self._evaluate(rows, 1, optimistic=False) if low == 1 else None
        spec = mean if any(o.block > 1 for o in mean[2]) else None
        if plain is not None and (spec is None or spec[1] <= GAIN_MARGIN * plain[1]):
            if self.since_spec < self.probe_after or self.max_block < 2:
                return plain[2]
            # a probe when speculation could win given the benefit of the doubt: every
            # auto row drafts (or copies), to learn its acceptance; probes back off
            hope = self._best(rows, 2, optimistic=True, every=True)
            if hope[1] <= GAIN_MARGIN * plain[1]:
                return plain[2]
            self.probe_after = min(2 * self.probe_after, PROBE_MAX)
            return hope[2]
        self.probe_after = PROBE_START
        return mean[2]

    def _best(self, rows, low: int, optimistic: bool, every: bool = False):
        """(width, tokens/s, options) of the best width >= low."""
        got = [self._evaluate(rows, w, optimistic, every) for w in range(low, self.max_block + 1)]
        return max(got, key=lambda g: g[1])

    def _evaluate(self, rows, width: int, optimistic: bool, every: bool = False):
        """(width, expected tokens/s, options) at verify width ``width``: copies where they
        beat drafting, then drafting rows added while they raise the batch's rate (``every``:
        all of them)."""
        opts, gains = [], []
        for i, r in enumerate(rows):
            b = max(1, min(width, r.max_tokens - r.generated))
            if r.sched is None:  # a fixed block: the row drafts (or copies) it every cycle
                opts.append(Option(min(r.block, b), False, 1.0 + (b > 1)))
                continue
            drafted = expected_tokens(r.sched.acc.rates(optimistic), b)
            copied = _copied(r, self._matches[i], b, optimistic)
            if b > 1 and copied >= drafted:
                opts.append(Option(b, True, copied))
            else:
                opts.append(Option(1, False, 1.0))
                if b > 1:
                    gains.append((drafted - 1.0, i, b))
        n = len(rows)
        tokens = sum(o.tokens for o in opts)
        drafting = sum(o.drafts for o in opts)
        for gain, i, b in sorted(gains, reverse=True):
            now = tokens / self.costs(n, width, drafting)
            if not every and (tokens + gain) / self.costs(n, width, drafting + 1) <= now:
                break
            opts[i], tokens, drafting = Option(b, False, gain + 1.0), tokens + gain, drafting + 1
        return width, tokens / self.costs(n, width, drafting), opts

    def record(self, rows: list, opts: list[Option], cycles: list, seconds: float) -> None:
        """Fold in a finished cycle: its cost, and each auto row's acceptance.

        Args:
            rows, opts: the rows and their plan. cycles: (row, ``steps.Cycle``) per row.
            seconds: the cycle's wall time.
        """
        width = max(o.block for o in opts)
        self.costs.observe(len(rows), width, sum(o.drafts for o in opts), seconds)
        self.since_spec = 0 if width > 1 else self.since_spec + 1
        for (row, cyc), o in zip(cycles, opts, strict=True):
            if row.sched is not None:
                row.sched.record(o.block, cyc, None)

    def describe(self, rows: list, opts: list[Option]) -> str:
        """The plan in one line (for the rows' ``schedule`` notes)."""
        width = max(o.block for o in opts)
        kinds = "".join("c" if o.copy else "d" if o.drafts else "p" for o in opts)
        return f"batch of {len(rows)}: width {width}, rows {kinds} (d drafted, c copied, p plain)"


def _copied(row, match: int, b: int, optimistic: bool) -> float:
    """Expected tokens of the row's context-lookup draft of block b after a match of
    ``match`` tokens (0: none)."""
    acc = row.sched.lookup_acc.get(lookup.match_class(match))
    return 0.0 if acc is None else expected_tokens(acc.rates(optimistic), b)
