"""``block_size="auto"`` across ranks (docs/distributed.md, "auto"): rank 0's scheduler
decides, the other ranks take its decisions.

The scheduler reads a clock: each rank's own timings could choose another block, and then
the ranks' collectives no longer pair (a hang, or sums of unlike tensors). So every value
the decode loop steers by (``choose``, ``plain_run``, ``copy_pays``) is rank 0's, sent to
the others in one small ``all_sum`` (they add zeros). The warm-up that fills the cost
tables runs the sharded target, so every rank runs it, and rank 0's tables end up on every
rank (and in the start-up cache, keyed by the group, for the next launch). A batch's block
chooser (``dflash serve``) follows rank 0 the same way. Only decisions travel, never
tokens: the tokens still follow from identical logits and keys on every rank.
"""

from __future__ import annotations

from ..decoding.policy import Choice

FIELDS = 4  # a Choice as sent: block, lookup, siblings, probe
MISSING = -1.0  # a width a cost table lacks, as sent


def broadcast(values: list[float], group, dtype=None) -> list:
    """Rank 0's ``values`` on every rank: one ``all_sum`` in which the other ranks add
    zeros, on the decode loop's stream (collectives from two streams can pair wrongly).

    Args:
        values: what rank 0 sends (the others' are ignored; same length on every rank).
        group: the ``mx.distributed.Group``. dtype: an MLX dtype (default int32).
    """
    import mlx.core as mx

    from ..decoding.steps import generation_stream

    dtype = mx.int32 if dtype is None else dtype
    mine = values if group.rank() == 0 else [0] * len(values)
    out = mx.distributed.all_sum(mx.array(mine, dtype), group=group, stream=generation_stream())
    return out.tolist()


class Follow:
    """A block policy whose decisions are rank 0's: rank 0 asks the wrapped policy and
    sends its answer; the other ranks only receive it. What the loop reports back
    (``record``, ``observe``) reaches the wrapped policy on every rank.

    Args:
        policy: the rank's own policy (``schedule.Scheduler``). group: the group.
    """

    def __init__(self, policy, group):
        object.__setattr__(self, "policy", policy)
        object.__setattr__(self, "group", group)

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def __setattr__(self, name, value):  # the loop sets ``tree``: the policy's
        setattr(self.policy, name, value)

    def _lead(self) -> bool:
        return self.group.rank() == 0

    def choose(self, budget: int, match: int = 0) -> Choice:
        """Rank 0's choice for the next cycle."""
        mine = self.policy.choose(budget, match) if self._lead() else Choice(1)
        sent = [mine.block, int(mine.lookup), mine.siblings, int(mine.probe)]
        block, lookup, siblings, probe = broadcast(sent, self.group)
        if self._lead():
            return mine
        return Choice(block, lookup=bool(lookup), siblings=siblings, probe=bool(probe))

    def plain_run(self) -> int:
        """Rank 0's count of plain steps to run back to back."""
        return broadcast([self.policy.plain_run() if self._lead() else 0], self.group)[0]

    def copy_pays(self, match: int) -> bool:
        """Rank 0's answer: whether a lookup match ends the plain run."""
        return bool(broadcast([int(self._lead() and self.policy.copy_pays(match))], self.group)[0])

    def record(self, block: int, cycle, seconds) -> None:
        self.policy.record(block, cycle, seconds)

    def observe(self, block: int, seconds: float) -> None:
        self.policy.observe(block, seconds)


def follow(policy, group):
    """``policy`` as every rank must run it: itself without a group, else :class:`Follow`.

    Args:
        policy: a block policy, or None. group: an ``mx.distributed.Group`` or None.
    """
    return policy if group is None or policy is None else Follow(policy, group)


class FollowPlans:
    """A batch's ``auto`` planner (``decoding/batch_auto.BatchPlanner``) whose plans are rank
    0's: the planner times the batch's cycles, so each rank's own would part from rank 0's.
    One small ``all_sum`` per cycle carries each row's block and whether it copies.

    Args:
        planner: the rank's own planner. group: the group.
    """

    def __init__(self, planner, group):
        self.planner, self.group = planner, group

    def plan(self, rows: list) -> list:
        """Rank 0's plan for the batch's next cycle (the rows are alike on every rank)."""
        from ..decoding.batch_auto import Option

        lead = self.group.rank() == 0
        mine = self.planner.plan(rows) if lead else [Option(1, False, 0.0) for _ in rows]
        got = broadcast([v for o in mine for v in (o.block, int(o.copy))], self.group)
        return [Option(int(b), bool(c), o.tokens) for b, c, o in zip(got[::2], got[1::2], mine)]

    def __getattr__(self, name):
        return getattr(self.planner, name)


def follow_plans(planner, group):
    """``planner`` as every rank must run it: itself without a group, else
    :class:`FollowPlans`."""
    return planner if group is None else FollowPlans(planner, group)


def ensure(model, group=None):
    """``warmup.ensure`` (the ``auto`` step costs), alike on every rank. Rank 0 reads the
    costs stored for this group (``diskcache`` keys them by ranks, shard mode, backend and
    link: a sharded pair costs otherwise than the one-process pair) and decides whether
    they stand; a spot check or a warm-up runs the sharded target, so every rank runs it.
    Rank 0's tables then reach every rank, and a measured table is stored for the next
    launch.

    Args:
        model: the loaded pair. group: the pair's group (None: ``warmup.ensure`` as is).
    """
    from ..decoding import warmup
    from ..loading import diskcache

    if group is None:
        return warmup.ensure(model)
    if model.tuning is not None:
        return model.tuning
    lead = group.rank() == 0
    stored = diskcache.read_costs(model) if lead else None
    measure = not _stands(model, stored, group)
    if measure:
        warmup.warm_up(model)
    mine = (model.tuning.tables() if measure else stored) if lead else {}
    tables = send_tables(mine, model, group)
    if lead and measure:
        diskcache.write_costs(model, tables)
    warmup.tune(model, tables)  # rank 0's tables on every rank
    return model.tuning


def _stands(model, stored: dict | None, group) -> bool:
    """Every rank: whether rank 0's ``stored`` costs stand, as ``warmup.ensure`` decides it
    in one process (a spot check, unless ``DFLASH_COSTS_CHECK=0`` on rank 0)."""
    from .. import env
    from ..decoding import warmup
    from ..loading import diskcache

    lead = group.rank() == 0
    state = 0 if stored is None else 2 if env.switch(warmup.ENV_CHECK) else 1
    state = broadcast([state], group)[0]  # 0: none stored, 1: use it, 2: check it first
    if state < 2:
        return state == 1
    spot = warmup.spot_check(model)  # every rank: it runs the sharded target
    why = warmup.disagreement(stored, *spot, model.block_size) if lead else None
    if why is not None:
        diskcache.note(f"the stored warm-up costs {why}; measuring them again", model.notes)
    return bool(broadcast([int(why is None)], group)[0])


def send_tables(tables: dict, model, group) -> dict:
    """Rank 0's cost tables (``Tuning.tables``' form) on every rank, in one float32
    ``all_sum``: a row per table name, a column per block width (-1: not timed)."""
    import mlx.core as mx

    from ..decoding.schedule import TABLE_NAMES

    width = model.block_size + 1
    flat = [MISSING] * (len(TABLE_NAMES) * width)
    for i, name in enumerate(TABLE_NAMES):
        for b, s in tables.get(name, {}).items():
            flat[i * width + b] = s
    got = broadcast(flat, group, mx.float32)
    out = {}
    for i, name in enumerate(TABLE_NAMES):
        row = {b: got[i * width + b] for b in range(width) if got[i * width + b] != MISSING}
        if row:
            out[name] = row
    return out
