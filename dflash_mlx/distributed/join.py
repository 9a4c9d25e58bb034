"""Joining the group, bounded (docs/distributed.md, "Faults"): MLX's ring backend waits
forever in ``accept`` for a rank that never connects (one started without ``mlx.launch``'s
``MLX_RANK`` and hostfile runs alone instead), and holds the GIL while it waits, so no
thread of this process can end the wait. A small watchdog process can: after ``JOIN_S``
seconds it prints one line naming the rank this one waits for and ends this process.
"""

from __future__ import annotations

import os
import subprocess
import sys

from ..errors import DFlashError

ENV_JOIN = "DFLASH_JOIN_TIMEOUT"  # seconds; read here only
JOIN_S = 60.0  # the ring's own connect gives up after 31 s (5 tries, 1 s doubling)

# the watchdog: EOF on fd 0 (this process joined, or ended) ends it; else, after the
# timeout, it says the line on stderr and ends its parent (TERM, then KILL)
_WATCHDOG = """
import os, select, signal, sys, time
pid, wait, line = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
if select.select([0], [], [], wait)[0]:
    sys.exit(0)
os.write(2, (line + "\\n").encode())
for sig in (signal.SIGTERM, signal.SIGKILL):
    try:
        os.kill(pid, sig)
    except OSError:
        break
    time.sleep(1.0)
"""


def timeout() -> float:
    """Seconds a rank waits for the others to join (``DFLASH_JOIN_TIMEOUT``, else
    ``JOIN_S``); a value that is not a positive number is the default."""
    try:
        s = float(os.environ.get(ENV_JOIN, JOIN_S))
    except ValueError:
        return JOIN_S
    return s if s > 0 else JOIN_S


def waits_for(rank: int, size: int) -> str:
    """Whom this rank waits for while the ring forms: rank r accepts its left neighbour
    (rank 0 accepts rank size-1, whose first move is to connect to it), the last rank
    connects to rank 0 first."""
    if rank == 0:
        return f"rank {size - 1}"
    if rank == size - 1:
        return f"rank 0 or rank {rank - 1}" if rank > 1 else "rank 0"
    return f"rank {rank - 1} (or a rank before it)"


def message(rank: int, size: int, seconds: float) -> str:
    """The line of a rank whose group did not form in time."""
    return (
        f"error: rank {rank} of {size} waited {seconds:g} s for {waits_for(rank, size)} to "
        "join and stops: start every rank with mlx.launch (a rank started without its "
        f"MLX_RANK and hostfile runs alone); {ENV_JOIN}=S waits S seconds"
    )


def ring_size() -> int | None:
    """The group's size from ``mlx.launch``'s hostfile (a JSON list, one entry a rank)."""
    import json

    try:
        with open(os.environ["MLX_HOSTFILE"]) as f:
            return len(json.load(f))
    except (OSError, KeyError, TypeError, ValueError):
        return None


def init():
    """``mx.distributed.init()``, ended with one line naming the rank waited for when the
    group does not form within ``timeout()`` seconds (ring backend: ``MLX_RANK`` and a
    hostfile of more than one rank; any other start is MLX's own)."""
    import mlx.core as mx

    size, rank = ring_size(), os.environ.get("MLX_RANK", "")
    if size is None or size < 2 or not rank.isdigit():
        return mx.distributed.init()
    wait = timeout()
    read, write = os.pipe()
    line = message(int(rank), size, wait)
    try:
        dog = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _WATCHDOG, str(os.getpid()), str(wait), line],
            stdin=read,
            stdout=subprocess.DEVNULL,
        )
    except OSError:  # no watchdog (no process left to start): MLX's own wait
        os.close(write)
        dog = None
    os.close(read)
    try:
        return mx.distributed.init()
    except RuntimeError as e:  # the last rank's connect gives up: rank 0 is not there
        raise DFlashError(
            f"rank {rank} of {size} could not reach {waits_for(int(rank), size)} ({e}); start "
            "every rank with mlx.launch"
        ) from None
    finally:
        if dog is not None:
            os.close(write)  # the watchdog sees EOF and ends
            dog.wait()
