"""Several machines as one (docs/distributed.md): under ``mlx.launch`` the target is sharded
with mlx-lm's own tensor parallelism (``Model.shard``), or its pipeline parallelism
(``pipeline.py``), and every rank runs the same DFlash loop. Each sharded layer ends in MLX's ``all_sum``, which leaves every rank the same sum, so
every rank sees the same logits, drafts the same block with its own copy of the drafter,
and takes the same decisions with the same keys: no rank sends another its tokens. Only
rank 0 speaks. What reads a clock (``block_size="auto"``) is decided on rank 0 and sent to
the others (``policy.py``).
"""

from __future__ import annotations

import os
import sys

from ..errors import DFlashError
from .pipeline import check_mode as check_shard  # noqa: F401 - load's check of ``shard``

RANK_ENV = ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")  # ring / JACCL, MPI launchers


def launched() -> bool:
    """Whether this process was started by ``mlx.launch`` (or an MPI launcher)."""
    return any(name in os.environ for name in RANK_ENV)


def group(given=None):
    """The group to shard over: ``given``, else the launched one; None for one process.

    Args:
        given: an ``mx.distributed.Group``, or None.
    """
    if given is None and not launched():
        return None
    if given is None:
        from . import join

        given = _joined.get("group") or _joined.setdefault("group", join.init())
    return given if given.size() > 1 else None


_joined: dict = {}  # the launched group, once joined (``join.init`` starts a watchdog)


def shard(target, group, mode=None) -> str | None:
    """Shard the target over ``group`` with mlx-lm's own tensor or pipeline parallelism, in
    place, before any of our wrappers, then read the weights this rank keeps (the target
    comes loaded lazily under a group: a pipeline stage never reads another's layers).

    Args:
        target: the mlx-lm model. group: an ``mx.distributed.Group`` or None.
        mode: "tensor", "pipeline" or None (tensor where the family has it, else pipeline;
            ``pipeline.mode``).

    Returns:
        The mode used; None for one process.

    Raises:
        DFlashError: the family has neither (or not the one asked for), its heads do not
            split evenly over the ranks, or it has fewer layers than ranks.
    """
    from . import pipeline

    pipeline.check_mode(mode)
    if group is None:
        return None
    import mlx.core as mx

    chosen = pipeline.mode(target, mode, group.size())
    if chosen == "pipeline":
        pipeline.split(target, group)
    else:
        _tensor(target, group)
    mx.eval(target.parameters())
    return chosen


def _tensor(target, group) -> None:
    """mlx-lm's tensor parallelism: each rank keeps 1/size of every projection."""
    from .pipeline import stack

    n = group.size()
    other = ", or use --shard pipeline" if hasattr(stack(target), "pipeline") else ""
    for layer in target.layers:
        attn = getattr(layer, "self_attn", None)
        heads = [getattr(attn, a, 0) for a in ("n_heads", "n_kv_heads")]
        if any(h % n for h in heads):
            raise DFlashError(
                f"this target's attention heads ({heads[0]} query, {heads[1]} key/value) do "
                f"not split over {n} processes; launch a number of processes that divides "
                f"both{other}"
            )
    target.shard(group)


def connect(pair, group, mode) -> None:
    """Join the assembled pair's ranks where the mode needs it: under pipeline parallelism
    each rank's taps reach every rank (``pipeline.connect``); else nothing.

    Args:
        pair: the ``DFlashModel``. group: the ranks, or None. mode: what ``shard`` returned.
    """
    if group is not None and mode == "pipeline":
        from . import pipeline

        pipeline.connect(pair.adapter, group)


def plan_shard(group, mode: str | None) -> tuple[int, int, str] | None:
    """This rank's (size, rank, mode) for its memory plan, before the load (without
    ``--shard`` the plan assumes tensor); None for one process."""
    return None if group is None else (group.size(), group.rank(), mode or "tensor")


def speak_only_on_rank_zero(group) -> None:
    """Ranks other than 0 write nothing (they compute the same text as rank 0)."""
    if group is not None and group.rank() != 0:
        devnull = open(os.devnull, "w")  # noqa: SIM115 - for the rest of the process
        sys.stdout, sys.stderr = devnull, devnull


def fixed_block(cfg, block: int, note=print):
    """``cfg`` with ``block_size="auto"`` replaced by ``block``, said in one note: the
    commands whose ranks replay rank 0's calls (serve, chat, bench) do not send auto's
    choices yet (``dflash run`` and the Python API do: ``policy.py``).

    Args:
        cfg: a ``GenerationConfig``. block: the checkpoint's block. note: where to say it.
    """
    from dataclasses import replace

    if cfg.block_size != "auto":
        return cfg
    note(
        f"note: several processes: block size {block} instead of auto (this command does "
        "not share auto's choices across processes yet); --block-size N to choose another"
    )
    return replace(cfg, block_size=block)
