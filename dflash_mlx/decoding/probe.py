"""``auto``'s probes: a speculative cycle run while plain decoding looks best, to learn what
the drafter accepts, at a bounded cost (docs/algorithm.md §7).

A probe of block b costs ``C(b)`` and commits at least one token (the target's own), so it
loses at most ``C(b) / C(1) - 1`` plain steps against plain decoding. Probes draw on an
account: every committed token pays ``LOSS`` of a plain step in, a probe runs only when the
account covers its worst case, and its outcome (tokens committed minus its cost in plain
steps) is settled in it. The account never goes below zero, so over any stretch probes lose
at most ``LOSS`` of the plain time of the tokens decoded plus what the account held at its
start (at most ``CREDIT_MAX`` plain steps, won by earlier probes; zero on a fresh model).
Probes that win refill it, so a good drafter is probed (that is, speculates) every cycle;
one that loses waits ``PROBE_START`` plain steps, doubling to ``PROBE_MAX`` while probes keep
losing, so a drafter that never pays costs less the longer it runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .policy import Choice

PROBE_START, PROBE_MAX = 8, 256  # plain steps after a losing probe, doubling up to the max
LOSS = 0.03  # of a plain step per committed token that probes may lose
CREDIT_MAX = 8.0  # plain steps of winnings the account keeps (what a request may spend)


@dataclass
class Probes:
    """The probes' account and backoff, carried across a model's requests.

    Attributes:
        wait: plain steps after a speculative cycle before a probe may run.
        since: plain steps since the last speculative cycle.
        balance: plain steps probes may still lose.
        pending: the running probe's cost in plain steps (None: none runs).
    """

    wait: int = PROBE_START
    since: int = 0
    balance: float = 0.0
    pending: float | None = None
    hopeless: bool = False  # the running probe was chosen where no block is expected to pay
    due_in: int = 0  # plain steps until a probe could run (0: none could)

    def state(self) -> tuple[int, int, float]:
        """What the next request on the model starts from."""
        return self.wait, self.since, self.balance

    def choose(self, hopeful: dict, cost, best: tuple[int, float], margin: float) -> Choice:
        """A probe, or a plain step (decoding plainly is expected to win).

        Args:
            hopeful: (block, siblings) -> speedup over plain under ``Acceptance.upper``.
            cost: block -> its cycle's cost in plain steps.
            best: the block expected best on the point estimates, and its speedup.
            margin: the speedup a candidate must plausibly clear.

        Returns:
            the candidate with the highest hope that the account covers, once the backoff
            allows, else a plain step (``due_in``: plain steps until a probe could run).
        """
        could = {k: v for k, v in hopeful.items() if v > margin}
        covered = {k: v for k, v in could.items() if cost(k[0]) - 1.0 <= self.balance}
        due = max(self.wait - self.since, 0)
        if could and due == 0 and covered:
            pick = max(covered, key=covered.get)
            self.pending, self.hopeless, self.due_in = cost(pick[0]), best[1] < 1.0, 0
            why = f"probe block {pick[0]}: plausibly {could[pick]:.2f}x"
            return Choice(pick[0], could[pick], probe=True, reason=why, siblings=pick[1])
        why = f"plain: best block {best[0]} expected {best[1]:.2f}x plain"
        if not could:
            self.due_in = 0
            why = f"plain: no block beats plain decoding (best, block {best[0]}: "
            return Choice(
                1, reason=why + f"{best[1]:.2f}x; plausibly {max(hopeful.values()):.2f}x)"
            )
        short = min(cost(k[0]) - 1.0 for k in could) - self.balance
        self.due_in = max(due, math.ceil(short / LOSS) if short > 0 else 0, 1)
        return Choice(1, reason=why + f"; a probe within {self.due_in} steps")

    def earn(self, tokens: int) -> None:
        """``tokens`` were committed: the account grows by ``LOSS`` plain steps each."""
        self.balance = min(CREDIT_MAX, self.balance + LOSS * tokens)

    def committed(self, tokens: int, speculative: bool) -> None:
        """A drafted cycle or a plain step committed ``tokens``; a probe's is settled."""
        self.earn(tokens)
        self.since = 0 if speculative else self.since + 1
        if self.pending is not None and speculative:
            gain = tokens - self.pending
            self.balance = min(CREDIT_MAX, self.balance + gain)
            if gain >= 0 or not self.hopeless:  # won, or lost by chance: probe on
                self.wait = 0
            else:
                self.wait = min(max(2 * self.wait, PROBE_START), PROBE_MAX)
        self.pending = None
