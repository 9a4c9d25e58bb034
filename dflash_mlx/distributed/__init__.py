"""Several machines as one (docs/distributed.md): under ``mlx.launch`` the target is sharded
with mlx-lm's own tensor parallelism (``Model.shard``) and every rank runs the same DFlash
loop. Each sharded layer ends in MLX's ``all_sum``, which leaves every rank the same sum, so
every rank sees the same logits, drafts the same block with its own copy of the drafter,
and takes the same decisions with the same keys: no rank sends another its tokens. Only
rank 0 speaks. What reads a clock (``block_size="auto"``) is decided on rank 0 and sent to
the others (``policy.py``).
"""

from __future__ import annotations

import os
import sys

from ..errors import DFlashError

RANK_ENV = ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")  # ring / JACCL, MPI launchers


def launched() -> bool:
    """Whether this process was started by ``mlx.launch`` (or an MPI launcher)."""
    return any(name in os.environ for name in RANK_ENV)


def group(given=None):
    """The group to shard over: ``given``, else the launched one; None for one process.

    Args:
        given: an ``mx.distributed.Group``, or None.
    """
    import mlx.core as mx

    if given is None and not launched():
        return None
    g = given if given is not None else mx.distributed.init()
    return g if g.size() > 1 else None


def shard(target, group) -> None:
    """Shard the target's layers over ``group`` with mlx-lm's tensor parallelism, in place,
    before any of our wrappers: each rank keeps 1/size of every projection.

    Args:
        target: the mlx-lm model, as loaded. group: an ``mx.distributed.Group`` or None.

    Raises:
        DFlashError: the family has no tensor parallelism in mlx-lm, or its heads do not
            split evenly over the ranks.
    """
    if group is None:
        return
    kind = getattr(getattr(target, "args", None), "model_type", type(target).__module__)
    n = group.size()
    if not hasattr(target, "shard"):
        raise DFlashError(
            f"mlx-lm has no tensor parallelism for '{kind}' targets, so it cannot be sharded "
            f"over {n} processes; run it in one process, or use a llama / qwen2 / qwen3 target"
        )
    for layer in target.layers:
        attn = getattr(layer, "self_attn", None)
        heads = [getattr(attn, a, 0) for a in ("n_heads", "n_kv_heads")]
        if any(h % n for h in heads):
            raise DFlashError(
                f"this target's attention heads ({heads[0]} query, {heads[1]} key/value) do "
                f"not split over {n} processes; launch a number of processes that divides both"
            )
    target.shard(group)


def speak_only_on_rank_zero(group) -> None:
    """Ranks other than 0 write nothing (they compute the same text as rank 0)."""
    if group is not None and group.rank() != 0:
        devnull = open(os.devnull, "w")  # noqa: SIM115 - for the rest of the process
        sys.stdout, sys.stderr = devnull, devnull
