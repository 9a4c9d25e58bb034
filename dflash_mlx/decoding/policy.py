"""Which block each cycle verifies, and what the loop tells the chooser afterwards
(docs/algorithm.md §7).

A block policy has the loop's side of ``schedule.Scheduler``'s interface:

- ``choose(budget, match) -> Choice``: the next cycle's block (1: a plain step), whether to
  verify the context-lookup draft, and how many siblings of the first draft to verify;
- ``plain_run() -> int``: plain steps to pipeline back to back after a block of 1 (0: none,
  the plain step runs as a cycle);
- ``copy_pays(match) -> bool``: whether a lookup match ends a plain run early;
- ``record(block, cycle, seconds)`` and ``observe(block, seconds)``: a cycle's outcome and
  cost, as :class:`Pace` measures them;
- a ``tree`` attribute, set by the loop: whether greedy trees can be verified.

:class:`FixedBlock` is the policy of a fixed ``block_size``; ``schedule.Scheduler`` is
``"auto"``'s. Either way only the past steers a choice, so every schedule is lossless.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .lookup import FIXED_MIN_MATCH
from .tree import siblings_for


@dataclass
class Choice:
    """One decision: the block size and why.

    Attributes:
        block: tokens to verify (the anchor and block - 1 drafts); 1 is a plain step.
        speedup: expected tokens/s over plain decoding. probe: a re-probe of speculation.
        reason: why, for --verbose. lookup: verify the context-lookup draft instead of
            drafting. siblings: of the block's drafts, siblings of the first (``tree.py``).
    """

    block: int
    speedup: float = 1.0
    probe: bool = False
    reason: str = ""
    lookup: bool = False
    siblings: int = 0


class FixedBlock:
    """The same block every cycle (fewer at the end of the budget), the lookup draft when a
    match of at least ``FIXED_MIN_MATCH`` tokens rests under it, and the siblings that
    ``tree.siblings_for`` gives a block when trees can be verified.

    Args:
        block: tokens per verify (the anchor and block - 1 drafts).
    """

    def __init__(self, block: int):
        self.block = block
        self.tree = False

    def choose(self, budget: int, match: int = 0) -> Choice:
        b = max(1, min(self.block, budget))
        copy = match >= FIXED_MIN_MATCH and b > 1
        return Choice(b, lookup=copy, siblings=0 if copy or not self.tree else siblings_for(b))

    def plain_run(self) -> int:
        return 0  # a block of 1 (the last token of a budget) runs as a cycle

    def copy_pays(self, match: int) -> bool:
        return False

    def record(self, block: int, cycle, seconds: float | None) -> None:
        pass  # nothing to learn: the block is fixed

    def observe(self, block: int, seconds: float) -> None:
        pass


class Pace:
    """Times the loop's steps for a policy.

    A drafted cycle costs the wall time from the previous step's result to its own
    (consumer time included, as for every block), except right after plain steps: it then
    also catches the drafter up on them, a cost of switching, not of the block. Plain steps
    are timed as a whole run from its start to its last token over its length: the gaps
    between them are no step's cost (the first also fills the pipeline, the last is nearly
    free).

    Args:
        policy: the block policy to tell.
    """

    def __init__(self, policy):
        self.policy = policy
        self.last = time.perf_counter()
        self.switched = False

    def cycle(self, choice: Choice, step) -> None:
        """A cycle of ``choice`` committed ``step``."""
        now = time.perf_counter()
        sample = choice.lookup or not self.switched
        self.policy.record(choice.block, step, now - self.last if sample else None)
        self.last, self.switched = now, False

    def plain_step(self, step) -> None:
        """A plain step of a run committed ``step`` (its cost comes with the run's end)."""
        self.last = time.perf_counter()
        self.policy.record(1, step, None)

    def plain_run(self, ran: int, start: float) -> None:
        """A run of ``ran`` plain steps that began at ``start`` ended."""
        if ran > 1:  # one step is mostly the switch's pipeline fill
            self.policy.observe(1, (self.last - start) / ran)
        self.switched = ran > 0
