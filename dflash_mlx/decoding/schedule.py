"""``block_size="auto"``: choose each cycle's block size from measured costs and live
acceptance, and decode plainly when drafting cannot pay.

For a block of b tokens (the anchor plus b-1 drafts) the expected tokens committed are
``E(b) = 1 + sum_{k<b} prod_{j<=k} alpha_j``, where alpha_j is the conditional acceptance at
draft position j; a cycle costs ``C(b)`` seconds. It picks the b maximising ``E(b) / C(b)``,
with b = 1 meaning a plain target step; once drafting pays, the block is the best under
optimistic acceptance among those expected near the best, so unreached positions get tried
at a small cost. Costs come from a warm-up at load and from the loop's own timings;
acceptance is estimated online per request, from a prior carried across requests on the
model. Only the past is used, never the current draft, so every schedule is lossless.

While decoding plainly nothing is learnt about acceptance, so the scheduler re-probes with a
speculative cycle after 8, 16, 32, ... plain steps, and only when an optimistic estimate
(acceptance given the benefit of the doubt) says speculation could win at all.

A context-lookup draft (``lookup.py``) is a third choice when the committed tokens have one:
its cycle skips the drafter, so it has costs of its own, and its acceptance is learnt per
class of match length, since a 4-token match is accepted far more often than a 1-token one.
"""

from __future__ import annotations

from collections import Counter

from . import lookup
from .costs import Bands, CostTable, band
from .estimates import BORROWED_WEIGHT, Acceptance, Catches, caught, expected_tokens
from .policy import Choice
from .tree import MAX_SIBLINGS, SIBLING_PRIOR

PROBE_START, PROBE_MAX = 8, 256  # plain steps before a re-probe, doubling up to the max
PLAIN_RUN_MAX = 32  # plain steps run back to back before the choice is made again
# Speculate only when the expected speedup clears this: estimates near 1.0x are coin flips
# that cost more in the losers than they win in the winners.
GAIN_MARGIN = 1.05
# A block tried for its unseen positions may cost this much of the expected best's speed.
EXPLORE_SLACK = 1.05
DEFAULT_PRIOR = 0.25  # acceptance assumed per position before a model has decoded anything
CALIBRATE_RUN = 8  # plain steps that time a plain step in a band whose blocks are timed
# the warm-up's tables as stored: drafted and copied, at its short and its long context
TABLE_NAMES = ("seconds", "lookup_seconds", "long_seconds", "long_lookup_seconds")


class Scheduler:
    """Per-request block-size chooser.

    Args:
        costs: the model's CostTable (shared across requests, updated here).
        prior: acceptance per draft position from earlier requests (len max_block - 1).
        min_block: smallest speculative block considered (2).
        frozen: never update the costs (a seeded request's schedule must not depend on
            timings taken during it).
        lookup_costs: seconds per lookup cycle by block (None: lookup drafts are never
            chosen). lookup_priors: acceptance per position for each ``lookup.match_class``.
        catch_prior: sibling catch rates by rank. bands: callable(band) -> (drafted,
            copied) cost tables of a context band (``costs.Bands``); None: ``costs`` and
            ``lookup_costs`` at every length. context: tokens in the cache at the start.
        prior_weight: pseudo-observations behind ``prior`` (default ``PRIOR_WEIGHT``).
        lookup_weight: the same behind ``lookup_priors``.
    """

    def __init__(
        self,
        costs: CostTable,
        prior: list[float],
        min_block: int = 2,
        frozen: bool = False,
        lookup_costs: CostTable | None = None,
        lookup_priors: dict[int, list[float]] | None = None,
        catch_prior: list[float] | None = None,
        bands=None,
        context: int = 0,
        prior_weight: float | None = None,
        lookup_weight: float | None = None,
    ):
        self.costs, self.frozen = costs, frozen
        self.lookup_costs = lookup_costs
        # bands(b) -> (drafted, copied) tables of context band b; None: these tables only
        self.bands, self.band, self.context = bands, band(0), 0
        self._calibrating = False
        self.at_context(context)
        if lookup_costs is not None and lookup_priors is None:
            lookup_priors = lookup.priors(costs.max_block - 1)
        self.lookup_acc = {c: Acceptance(list(p)) for c, p in (lookup_priors or {}).items()}
        for acc in self.lookup_acc.values() if lookup_weight is not None else ():
            acc.weight = lookup_weight  # learnt in another context band: held lightly
        self.lookup_history: Counter = Counter()
        self.max_block = costs.max_block
        self.min_block = min_block
        self.acc = Acceptance(list(prior))
        if prior_weight is not None:  # a prior from another context band: held lightly
            self.acc.weight = prior_weight
        self.catches = Catches(list(catch_prior or [SIBLING_PRIOR] * MAX_SIBLINGS))
        self.tree = False  # set by the decode loop when it can verify siblings
        self.since_spec = 0
        self.probe_after = PROBE_START
        self.history: Counter = Counter()
        self.key: tuple = ()  # (mode, selector): where Tuning keeps this request's prior
        self.notes: list[str] = []  # why and when decoding switched to / from plain
        self._plain = False
        self.last_reason = ""

    def at_context(self, context: int) -> None:
        """The request's context is now ``context`` tokens: past a band's edge that band's
        cost tables weigh the choices."""
        self.context = context
        b = band(context)
        if self.bands is not None and b != self.band:
            self.band = b
            self.costs, self.lookup_costs = self.bands(b)

    def _best(self, rates: list[float], top: int, costs: CostTable | None = None):
        """The speculative block (<= top) with the highest expected speedup over plain,
        as (block, speedup, siblings); ``costs``: the cycles' cost table (default: drafted
        ones, which may hold siblings when the loop verifies trees)."""
        (b, n), best = max(self._scores(rates, top, costs).items(), key=lambda kv: kv[1])
        return b, best, n

    def _scores(self, rates: list[float], top: int, costs: CostTable | None = None) -> dict:
        """Expected speedup over plain of each (block, siblings) up to ``top``, by block."""
        tree, costs = costs is None and self.tree, self.costs if costs is None else costs
        scores, catches = {}, self.catches.rates()
        for b in range(self.min_block, top + 1):
            for n in range(min(MAX_SIBLINGS, b - 2) + 1 if tree else 1):
                e = expected_tokens(rates, b - n) + (1 - rates[0]) * caught(catches, n)
                scores[b, n] = e / costs(b) * self.costs(1)
        return scores

    def _explore(self, top: int, speedup: float) -> tuple[int, int]:
        """(block, siblings) once speculation pays: the best under optimistic acceptance
        (unreached positions get tried) among blocks expected within ``EXPLORE_SLACK`` of
        the best, so a steep verify curve (a MoE's) keeps deep trials cheap."""
        expected = self._scores(self.acc.rates(), top)
        hopeful = self._scores(self.acc.rates(optimistic=True), top)
        fair = {k: v for k, v in hopeful.items() if expected[k] * EXPLORE_SLACK >= speedup}
        return max(fair, key=fair.get)

    def _lookup_best(self, match: int, top: int) -> tuple[int, float]:
        """The best block for the lookup draft of a match of length ``match`` (0, 0.0:
        none)."""
        acc = self.lookup_acc.get(lookup.match_class(match))
        if acc is None or self.lookup_costs is None:
            return 0, 0.0
        return self._best(acc.rates(), top, self.lookup_costs)[:2]

    def copy_pays(self, match: int) -> bool:
        """Whether the lookup draft of a match of this length is expected to beat plain
        decoding (a plain run then ends, to verify it)."""
        return self._lookup_best(match, self.max_block)[1] > GAIN_MARGIN

    def choose(self, budget: int | None = None, match: int = 0) -> Choice:
        """The block size for the next cycle (1: a plain step).

        Args:
            budget: tokens still to generate (a block never drafts past it).
            match: length of the context-lookup match after the committed tokens (0: none).
        """
        top = self.max_block if budget is None else max(1, min(self.max_block, budget))
        if top < self.min_block:
            return Choice(1, 1.0, reason="one token left")
        if self.costs.fresh == {"plain"}:  # blocks timed at this context, plain steps not
            self._calibrating = True
            choice = Choice(1, 1.0, reason=f"plain: timing a plain step at {self.context} tokens")
            self._note(choice)
            return choice
        b, s, n_sib = self._best(self.acc.rates(), top)
        lb, ls = self._lookup_best(match, top)
        if ls > max(s, GAIN_MARGIN):
            choice = Choice(lb, ls, reason=f"lookup block {lb}: expected {ls:.2f}x", lookup=True)
            self._note(choice)
            return choice
        if s > GAIN_MARGIN:
            self.probe_after = PROBE_START  # speculation pays again: probe eagerly next time
            b, n_sib = self._explore(top, s)
            why = f"block {b}" + (f" ({n_sib} siblings)" if n_sib else "")
            choice = Choice(b, s, reason=f"{why}: expected {s:.2f}x plain decoding", siblings=n_sib)
        else:
            ob, os_, o_sib = self._best(self.acc.rates(optimistic=True), top)
            if os_ <= GAIN_MARGIN:
                why = f"no block beats plain decoding (best, block {b}: {s:.2f}x; even "
                why += f"optimistically {os_:.2f}x)"
            else:
                why = f"best block {b} expected {s:.2f}x plain; re-probing with backoff"
            self.last_reason = "plain: " + why
            if os_ > GAIN_MARGIN and self.since_spec >= self.probe_after:
                self.probe_after = min(self.probe_after * 2, PROBE_MAX)
                choice = Choice(ob, os_, probe=True, reason=f"probe block {ob}", siblings=o_sib)
            else:
                choice = Choice(1, 1.0, reason=self.last_reason)
        self._note(choice)
        return choice

    def _note(self, choice: Choice) -> None:
        """Remember switches between plain and speculative decoding (for --verbose)."""
        plain = choice.block == 1
        if plain != self._plain and len(self.notes) < 20:
            steps = sum(self.history.values())
            self.notes.append(f"step {steps}: {choice.reason}")
        self._plain = plain

    def plain_run(self) -> int:
        """Plain steps to run back to back before choosing again: up to the next probe, or
        ``PLAIN_RUN_MAX`` once it is due but was refused (no block can pay even
        optimistically). Short runs would cost the pipelining: a run's first step is not
        overlapped with the previous one (a ~5% loss when every run was one step)."""
        if self._calibrating:
            self._calibrating = False
            return CALIBRATE_RUN
        left = self.probe_after - self.since_spec
        return min(PLAIN_RUN_MAX, left) if left > 0 else PLAIN_RUN_MAX

    def record(self, b: int, step, seconds: float | None) -> None:
        """Fold in a finished cycle of block b.

        Args:
            b: its block. step: the ``steps.Cycle`` it committed (accepted drafts, the
                lookup match its drafts were copied after, its siblings and the one taken).
            seconds: the cycle's wall time, or None if unknown.
        """
        self.at_context(self.context + len(step.tokens))
        if step.lookup:
            self.lookup_history[b] += 1
            if seconds is not None and seconds > 0 and not self.frozen:
                self.lookup_costs.observe(b, seconds)
            self.lookup_acc[lookup.match_class(step.lookup)].update(b - 1, step.accepted)
            return
        self.history[b] += 1
        if seconds is not None:
            self.observe(b, seconds)
        if b == 1:
            self.since_spec += 1
            return
        self.acc.update(b - 1 - step.siblings, 0 if step.sibling else step.accepted)
        if step.siblings and (step.sibling or step.accepted == 0):
            self.catches.update(step.siblings, step.sibling)
        self.since_spec = 0

    def observe(self, b: int, seconds: float) -> None:
        """Fold in the measured cost of a drafted block b (b = 1: a plain step's, which also
        rescales the copied blocks' costs: the machine's drift moves them too)."""
        if seconds > 0 and not self.frozen:
            scale = self.costs.observe(b, seconds)
            if self.lookup_costs is not None and b == 1:
                self.lookup_costs.follow(scale)

    def posterior(self) -> list[float]:
        """Acceptance per position after this request (the next request's prior)."""
        return self.acc.rates()

    def summary(self) -> dict:
        """Block-size histograms (drafted, copied by lookup) and the share of plain steps."""
        n = sum(self.history.values()) + sum(self.lookup_history.values())
        return {
            "blocks": dict(sorted(self.history.items())),
            "lookup_blocks": dict(sorted(self.lookup_history.items())),
            "plain_share": self.history.get(1, 0) / n if n else 0.0,
        }


class Tuning:
    """What a loaded model keeps across requests: the costs measured at load, a live cost
    table per decoding mode (greedy, sampled) and an acceptance prior per (mode, selector).

    Args:
        measured: the CostTable of the warm-up at load (kept as measured).
        measured_lookup: the same for cycles verifying a lookup draft (no drafter pass);
            None: lookup drafts are not scheduled.
        long: the warm-up's (drafted, copied) tables at ``costs.LONG_CONTEXT``, which
            predict a context band's costs before it has timed any (None: a band starts as
            a copy of the band below).
    """

    def __init__(
        self,
        measured: CostTable,
        measured_lookup: CostTable | None = None,
        long: tuple[CostTable, CostTable | None] | None = None,
    ):
        self.max_block = measured.max_block
        self.measured, self.measured_lookup, self.long = measured, measured_lookup, long
        self.costs: dict[str, Bands] = {}  # per mode, by context band
        self.lookup_costs: dict[str, Bands] = {}
        self.priors: dict[tuple, list[float]] = {}  # by (mode, selector, band)
        self.lookup_priors: dict[tuple, dict[int, list[float]]] = {}  # by (mode, band)
        self.catch_priors: dict[tuple, list[float]] = {}  # sibling catch rates, by key
        # (probe_after, plain steps since the last speculative cycle) per (mode, selector):
        # the probe backoff carries across requests, so short requests on a pair that
        # cannot win do not each pay for fresh probes.
        self.backoff: dict[tuple, tuple[int, int]] = {}

    @classmethod
    def from_seconds(cls, max_block: int, tables: dict[str, dict[int, float]]) -> Tuning:
        """A Tuning from stored costs (``tables()``'s form).

        Args:
            max_block: the checkpoint's block. tables: {"seconds", "lookup_seconds"}:
                seconds by block width, drafted and copied; "long_seconds" and
                "long_lookup_seconds" the same at ``costs.LONG_CONTEXT`` (optional).
        """
        made = {name: CostTable(max_block) for name in TABLE_NAMES if name in tables}
        for name, table in made.items():
            table.seconds = dict(tables[name])
        long = made.get("long_seconds")
        long = None if long is None else (long, made.get("long_lookup_seconds"))
        return cls(made["seconds"], made.get("lookup_seconds"), long)

    def tables(self) -> dict[str, dict[int, float]]:
        """The costs measured at load, seconds by block width: {"seconds" (drafted),
        "lookup_seconds" (copied)} and, when timed, the same at ``costs.LONG_CONTEXT``
        ("long_seconds", "long_lookup_seconds")."""
        got = [self.measured, self.measured_lookup, *(self.long or (None, None))]
        return {n: dict(t.seconds) for n, t in zip(TABLE_NAMES, got, strict=True) if t is not None}

    def _copy(self, measured: CostTable | None = None) -> CostTable:
        return (self.measured if measured is None else measured).copy()

    def _prior(self, mode: str, selector: bool, b: int) -> tuple[list[float], float | None]:
        """The acceptance prior of context band b and its weight (``_banded``), else the
        default."""
        prior, weight = _banded(self.priors, (mode, selector), b)
        return (
            (prior, weight) if prior is not None else ([DEFAULT_PRIOR] * (self.max_block - 1), None)
        )

    def scheduler(
        self,
        greedy: bool,
        selector: bool,
        seeded: bool = False,
        lookup: bool = False,
        context: int = 0,
    ) -> Scheduler:
        """A scheduler for one request.

        Args:
            greedy: temperature 0. selector: the path selector is on.
            lookup: context-lookup drafts may be chosen (needs ``measured_lookup``).
            seeded: seeded sampling: the schedule must depend on the seed alone, so it uses
                the costs measured at load, frozen, and the default prior (two runs with the
                same seed on the same loaded model then draw the same sample).
            context: the prompt's tokens: costs and priors are kept per context band.
        """
        mode = "greedy" if greedy else "sampled"
        default = [DEFAULT_PRIOR] * (self.max_block - 1)
        lookup = lookup and self.measured_lookup is not None
        if seeded and not greedy:
            lk = self._copy(self.measured_lookup) if lookup else None
            sched = Scheduler(self._copy(), default, frozen=True, lookup_costs=lk)
        else:
            long = self.long or (None, None)
            drafted = self.costs.setdefault(mode, Bands(self.measured, long[0]))
            copied = None
            if lookup:
                copied = self.lookup_costs.setdefault(mode, Bands(self.measured_lookup, long[1]))

            def bands(b: int) -> tuple[CostTable, CostTable | None]:
                return drafted.at(b), None if copied is None else copied.at(b)

            prior, weight = self._prior(mode, selector, band(context))
            lookup_prior, lookup_weight = _banded(self.lookup_priors, (mode,), band(context))
            costs, lk = bands(0)
            sched = Scheduler(
                costs,
                prior,
                lookup_costs=lk,
                lookup_priors=lookup_prior if lookup else None,
                catch_prior=self.catch_priors.get((mode, selector)),
                bands=bands,
                context=context,
                prior_weight=weight,
                lookup_weight=lookup_weight,
            )
            sched.probe_after, sched.since_spec = self.backoff.get(
                (mode, selector), (PROBE_START, 0)
            )
        sched.key = (mode, selector, seeded and not greedy)
        return sched

    def finish(self, sched: Scheduler) -> None:
        """Carry a finished request's acceptance into the prior of its mode."""
        if not sched.key[2]:
            self.priors[(*sched.key[:2], sched.band)] = sched.posterior()
            self.catch_priors[sched.key[:2]] = sched.catches.rates()
            if sched.lookup_acc:
                rates = {c: a.rates() for c, a in sched.lookup_acc.items()}
                self.lookup_priors[sched.key[0], sched.band] = rates
            self.backoff[sched.key[:2]] = (sched.probe_after, sched.since_spec)


def _banded(table: dict, head: tuple, b: int) -> tuple:
    """What ``table`` learnt for context band b (keys ``(*head, band)``) and its weight:
    the band's own (None: the default weight), else the nearest band's below held at
    ``BORROWED_WEIGHT`` (acceptance, drafted or copied, may change at longer context), else
    (None, None)."""
    own = table.get((*head, b))
    if own is not None:
        return own, None
    below = [k[-1] for k in table if k[:-1] == head and k[-1] < b]
    return (table[(*head, max(below))], BORROWED_WEIGHT) if below else (None, None)
