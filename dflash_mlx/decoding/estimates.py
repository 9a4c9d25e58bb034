"""What the block-size scheduler (``schedule.py``) estimates from the cycles it has seen:
the conditional acceptance of each draft position, and how often each sibling of the first
draft (``tree.py``) catches a miss."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PRIOR_WEIGHT = 8.0  # pseudo-observations behind the prior acceptance of each position
# behind a prior carried from a shorter context band: the drafter may never have seen such
# positions, and a drop in acceptance must show within a few cycles
BORROWED_WEIGHT = 3.0
# behind the default prior, a guess: it decides nothing once a few cycles have been seen
GUESS_WEIGHT = 2.0
FORGET = 0.98  # per-cycle decay of the request's own counts (acceptance drifts)


@dataclass
class Acceptance:
    """Conditional acceptance per draft position: a prior plus this request's counts.

    Attributes:
        prior: acceptance per position carried from earlier requests.
        hits, seen: decayed counts of accepted / reached drafts per position.
        weight: pseudo-observations behind the prior.
        evidence: real observations behind the prior per position (empty: taken as known,
            ``weight``; a guessed default prior has none).
    """

    prior: list[float]
    hits: list[float] = field(default_factory=list)
    seen: list[float] = field(default_factory=list)
    weight: float = PRIOR_WEIGHT
    evidence: list[float] = field(default_factory=list)

    def __post_init__(self):
        n = len(self.prior)
        self.hits = self.hits or [0.0] * n
        self.seen = self.seen or [0.0] * n
        self.evidence = self.evidence or [PRIOR_WEIGHT] * n

    def update(self, drafted: int, accepted: int) -> None:
        """Record a cycle that drafted ``drafted`` tokens and accepted ``accepted``."""
        self._forget()
        for k in range(min(accepted + 1, drafted)):
            self.seen[k] += 1.0
            self.hits[k] += float(k < accepted)

    def _forget(self) -> None:
        """Decay this request's counts by one cycle."""
        for k in range(len(self.seen)):
            self.hits[k] *= FORGET
            self.seen[k] *= FORGET

    def weights(self) -> list[float]:
        """Pseudo-observations behind the prior per position: its real evidence, between
        ``GUESS_WEIGHT`` (a guess) and ``weight``."""
        return [max(min(e, self.weight), GUESS_WEIGHT) for e in self.evidence]

    def rates(self, optimistic: bool = False) -> list[float]:
        """Estimated conditional acceptance per position.

        Args:
            optimistic: add one standard error (the benefit of the doubt, for probing).
        """
        out, last = [], None
        for p, h, s, w, e in zip(self.prior, self.hits, self.seen, self.weights(), self.evidence):
            if last is not None and e <= 0:
                p = last  # a guess: a position is expected like the one before it
            n = s + w
            r = last = (h + w * p) / n
            if optimistic:
                r = min(1.0, r + math.sqrt(max(r * (1 - r), 0.05) / n))
            out.append(r)
        return out

    def upper(self) -> list[float]:
        """Per position, the most the drafter plausibly accepts (for probing): the upper end
        of the Wilson interval at one standard error on the real observations (the guessed
        part of the prior left out: 1.0 where nothing was ever seen), or the optimistic
        rate if higher."""
        out = []
        rows = zip(self.rates(optimistic=True), self.prior, self.hits, self.seen, self.evidence)
        for r, p, h, s, e in rows:
            n = s + min(e, self.weight)
            if n <= 0:
                out.append(1.0)
                continue
            f = (h + (n - s) * p) / n
            wilson = (f + 0.5 / n + math.sqrt(f * (1 - f) / n + 0.25 / n**2)) / (1 + 1 / n)
            out.append(min(1.0, max(r, wilson)))
        return out

    def carried(self) -> list[float]:
        """The real observations behind ``rates()``, the next request's prior's evidence."""
        got = zip(self.evidence, self.seen)
        return [min(PRIOR_WEIGHT, min(e, self.weight) + s) for e, s in got]


class Catches(Acceptance):
    """How often each sibling of the first draft (``tree.py``), by rank, is the target's
    token when the path's first draft is not and no better-ranked sibling was: a prior plus
    this request's decayed counts, estimated as ``Acceptance`` estimates a position.

    Attributes:
        prior: catch rate per sibling rank carried from earlier requests.
    """

    def update(self, siblings: int, taken: int) -> None:
        """Record a cycle whose path missed its first draft: ``siblings`` were verified and
        the one of rank ``taken`` (1-based; 0: none) was committed."""
        self._forget()
        for k in range(siblings if taken == 0 else taken):
            self.seen[k] += 1.0
            self.hits[k] += float(k + 1 == taken)


def caught(catches: list[float], siblings: int) -> float:
    """Chance that one of the first ``siblings`` catches a missed first draft."""
    miss = 1.0
    for c in catches[:siblings]:
        miss *= 1.0 - c
    return 1.0 - miss


def expected_tokens(rates: list[float], b: int) -> float:
    """E(b): tokens committed by a cycle of block b (accepted drafts + the bonus token)."""
    total, run = 1.0, 1.0
    for r in rates[: b - 1]:
        run *= r
        total += run
    return total
