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

    if getattr(target, "vision_language", False):  # mlx-vlm's model: our own split
        chosen = _vision(target, group, mode)
    else:
        chosen = pipeline.mode(target, mode, group.size())
    if chosen == "pipeline":
        pipeline.split(target, group)
    elif not getattr(target, "vision_language", False):
        _tensor(target, group)
    mx.eval(target.parameters())
    return chosen


def _vision(target, group, mode) -> str:
    """A vision-language target split by tensor parallelism (``vision.shard``)."""
    from ..vision import shard as vision

    if mode == "pipeline":
        raise DFlashError(
            "a vision-language target runs under mlx.launch with --shard tensor only; "
            "drop --shard pipeline"
        )
    vision.shard(target, group)
    return "tensor"


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


def describe(group, mode: str | None) -> dict | None:
    """What ``dflash bench`` reports of the group, and what keys the warm-up costs stored
    for it: {"ranks", "shard", "backend", "link"}, plus "injected_delay_ms" when the
    benchmark's link hook is on (``link.py``); None for one process.

    Args:
        group: the ``mx.distributed.Group`` or None. mode: what ``shard`` returned.
    """
    if group is None:
        return None
    from .link import delay_from_env

    info = {"ranks": group.size(), "shard": mode, "backend": backend(), "link": link_kind()}
    delay = delay_from_env()
    if delay is not None:
        info["injected_delay_ms"] = delay * 1e3
    return info


def backend() -> str:
    """The backend ``mlx.launch`` started, from the environment it gives each rank."""
    env = os.environ
    if "MLX_JACCL_COORDINATOR" in env:
        return "jaccl-ring" if env.get("MLX_JACCL_RING") else "jaccl"
    if env.get("MLX_HOSTFILE"):
        return "ring"
    if "NCCL_HOST_IP" in env:
        return "nccl"
    return "mpi" if any(k in env for k in RANK_ENV[1:]) else "unknown"


def link_kind() -> str:
    """What joins the ranks, as far as this rank can tell: "loopback" when the ring's
    hostfile lists this machine alone, "rdma" under JACCL (Thunderbolt 5), "tcp" for a ring
    over other addresses (Thunderbolt bridge or Ethernet: not told apart), else "unknown"."""
    import json

    if backend().startswith("jaccl"):
        return "rdma"
    path = os.environ.get("MLX_HOSTFILE", "")
    try:
        with open(path) as f:
            hosts = json.load(f)
        ips = {a.rsplit(":", 1)[0] for node in hosts for a in node}
    except (OSError, ValueError, TypeError, AttributeError):
        return "unknown"
    local = all(ip.startswith("127.") or ip in ("localhost", "::1") for ip in ips)
    return "loopback" if ips and local else "tcp"
