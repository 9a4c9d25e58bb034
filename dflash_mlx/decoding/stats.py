"""What a stream of decode cycles says about drafting: tau, acceptance by position, the block
sizes used, copied and sibling cycles (``CycleStats``), and about one request: prefill and
generation speed (``RequestStats``). The one place these numbers are computed; the API's
responses, the batch generator and ``dflash bench`` read them from here.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .steps import Cycle


class CycleStats:
    """Counts of the cycles after the prefill (plain steps included), and what they give.

    Args:
        block_size: the largest block of the decode (the checkpoint's, or the fixed one);
            acceptance is kept for its block_size - 1 draft positions.
    """

    def __init__(self, block_size: int):
        self.positions = max(block_size - 1, 0)
        self.cycles = self.committed = self.copied = self.siblings = 0
        self.reached = [0] * self.positions  # cycles whose path reached each draft position
        self.accepted = [0] * self.positions  # ... and whose draft there was accepted
        self.blocks: dict[int, int] = {}  # block size (anchor + drafts) -> cycles; 1: plain

    def add(self, cyc: Cycle) -> None:
        """Count one verify cycle or plain step (not the prefill, which drafts nothing)."""
        self.cycles += 1
        self.committed += len(cyc.tokens)
        self.copied += cyc.lookup > 0
        self.siblings += cyc.sibling > 0
        self.blocks[cyc.drafted + 1] = self.blocks.get(cyc.drafted + 1, 0) + 1
        for k in range(min(cyc.reached, self.positions)):
            self.reached[k] += 1
            self.accepted[k] += k < cyc.accepted

    def merge(self, other: CycleStats) -> CycleStats:
        """Add another decode's counts to these (the same block size); return self."""
        self.cycles += other.cycles
        self.committed += other.committed
        self.copied += other.copied
        self.siblings += other.siblings
        for b, n in other.blocks.items():
            self.blocks[b] = self.blocks.get(b, 0) + n
        for k in range(min(self.positions, other.positions)):
            self.reached[k] += other.reached[k]
            self.accepted[k] += other.accepted[k]
        return self

    @property
    def tau(self) -> float:
        """Mean tokens committed per cycle (0 before any)."""
        return self.committed / self.cycles if self.cycles else 0.0

    @property
    def acceptance(self) -> list[float]:
        """Conditional acceptance per draft position: accepted / reached (0 where unreached)."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted, self.reached)]

    @property
    def plain_share(self) -> float:
        """The share of cycles that were plain target steps."""
        return self.blocks.get(1, 0) / self.cycles if self.cycles else 0.0

    @property
    def copied_share(self) -> float:
        """The share of cycles that verified drafts copied from the context."""
        return self.copied / self.cycles if self.cycles else 0.0

    def histogram(self) -> dict[int, int]:
        """Cycles per block size, smallest first."""
        return dict(sorted(self.blocks.items()))


class RequestStats:
    """One request's statistics: its prefill, its cycles, the tokens it has generated, the
    seconds per stage (profiled cycles), the ``auto`` scheduler's notes and the fallbacks the
    request runs under (``vision/notes.py``).

    Args:
        prompt_tokens: the prompt's length. block_size: as for ``CycleStats``.
    """

    def __init__(self, prompt_tokens: int, block_size: int):
        self.prompt_tokens = prompt_tokens
        self.cycles = CycleStats(block_size)
        self.generated = self.processed = 0  # tokens emitted; prompt tokens prefilled
        self.notes: list[str] = []
        self.fallbacks: list[str] = []  # what the request runs without, and why
        self.timings: dict[str, float] = {}
        # the prefill is timed from here (a batch restarts it when the request joins)
        self.tic, self.prompt_time = time.perf_counter(), 0.0

    def add(self, cyc: Cycle) -> None:
        """Count a cycle (the first is the prefill, which drafts nothing)."""
        if cyc.drafted == 0 and self.cycles.cycles == 0 and self.generated == 0:
            self.prompt_time, self.processed = time.perf_counter() - self.tic, cyc.prompt_tokens
            self.tic = time.perf_counter()
        else:
            self.cycles.add(cyc)
        for name, t in cyc.timings.items():
            self.timings[name] = self.timings.get(name, 0.0) + t

    @property
    def prompt_tps(self) -> float:
        """Prompt tokens prefilled per second."""
        return self.processed / max(self.prompt_time, 1e-9)

    @property
    def generation_tps(self) -> float:
        """Tokens generated per second since the prefill."""
        return self.generated / max(time.perf_counter() - self.tic, 1e-9)
