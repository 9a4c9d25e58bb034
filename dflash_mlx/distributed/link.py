"""A test hook on the link (docs/distributed.md, "Benchmark"): counts the collectives this
process issues and can add a delay to each, to show on one machine what a slower link
between Macs costs plain and speculative decoding.

``DFLASH_TEST_LINK_DELAY_MS`` (read here only) turns it on under a group. It wraps MLX's
``mx.distributed`` collectives (``all_sum``, ``all_gather``, ``send``, ``recv``): mlx-lm's
sharded layers and our own code look them up there at each call, so every collective is
counted where it enters the graph.

What the delay models: MLX collectives are lazy graph nodes, so a sleep where one is added
to the graph would cost nothing real (the graph runs later, and may overlap the sleep).
So the hook first evaluates the collective's input (the forward up to that point runs),
then sleeps, then adds the collective: each round trip then costs its latency in series
with the compute, as on a real link, where a layer waits for the all-reduce of the one
before. Every rank sleeps alike, so a collective costs the delay once. The forced
evaluation is itself a synchronisation per collective; rows compared against each other
should all run with the hook on (a delay of 0 included).
"""

from __future__ import annotations

import os
import time
from collections import Counter

ENV_DELAY = "DFLASH_TEST_LINK_DELAY_MS"
KINDS = ("all_sum", "all_gather", "send", "recv")

counts: Counter = Counter()  # collectives issued through MLX since install, by kind
_state = {"delay": None, "original": {}}


def delay_from_env() -> float | None:
    """The delay per collective in seconds from ``DFLASH_TEST_LINK_DELAY_MS``; None: off.

    Raises:
        ValueError: the variable is set to something other than a number of milliseconds >= 0.
    """
    raw = os.environ.get(ENV_DELAY)
    if raw is None or raw == "":
        return None
    ms = float(raw)
    if not ms >= 0:
        raise ValueError(f"{ENV_DELAY} must be milliseconds >= 0 (got {raw!r})")
    return ms / 1e3


def install(delay: float | None = None) -> Counter:
    """Wrap MLX's collectives (once): count each, and with ``delay`` seconds evaluate its
    input and sleep before it. Returns ``counts``.

    Args:
        delay: seconds per collective (None or 0: count only, no forced evaluation when None).
    """
    import mlx.core as mx

    _state["delay"] = delay
    for kind in KINDS:
        if kind in _state["original"] or not hasattr(mx.distributed, kind):
            continue
        _state["original"][kind] = getattr(mx.distributed, kind)
        setattr(mx.distributed, kind, _wrapped(kind, _state["original"][kind]))
    return counts


def _wrapped(kind: str, collective):
    def call(x, *args, **kwargs):
        counts[kind] += 1
        delay = _state["delay"]
        if delay is not None and kind != "recv":  # recv's argument is a shape, not an array
            import mlx.core as mx

            mx.eval(x)
            time.sleep(delay)
        return collective(x, *args, **kwargs)

    return call


def uninstall() -> None:
    """Put MLX's own collectives back."""
    import mlx.core as mx

    for kind, f in _state["original"].items():
        setattr(mx.distributed, kind, f)
    _state["original"].clear()
    _state["delay"] = None


def from_env(group) -> None:
    """Install the hook when ``DFLASH_TEST_LINK_DELAY_MS`` is set and there is a group."""
    delay = delay_from_env()
    if group is not None and delay is not None:
        install(delay)


def total() -> int | None:
    """Collectives issued since the hook was installed; None when it is not."""
    return sum(counts.values()) if _state["original"] else None


def agreed_sum(a, group):
    """``all_sum`` of ``a`` over ``group``, evaluated, on the decode's own stream: collectives
    queued on two streams can pair differently on each rank (one rank's handshake meeting
    the other's verify still in flight), and every one of ours goes on that stream.

    Args:
        a: this rank's part (an ``mx.array``). group: the ``mx.distributed.Group``.
    """
    import mlx.core as mx

    from ..decoding.steps import generation_stream

    with mx.stream(generation_stream()):
        s = mx.distributed.all_sum(a, group=group)
    mx.eval(s)
    return s
