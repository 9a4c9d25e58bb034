"""Ranks on this machine without ``mlx.launch``, for the tests and benchmarks: each process
gets the ring backend's own environment (``MLX_RANK``, ``MLX_HOSTFILE`` on loopback), as
``mlx.launch --backend ring`` gives it.

Why not ``mlx.launch`` itself: its relay thread (MLX 0.32) selects on each rank's stdin
pipe for writing, which a pipe always is, so it spins a core for as long as the ranks run;
on a 2-core machine that is a third of the CPU that two ranks and the launcher share.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


def free_port(n: int = 1) -> int:
    """A port p with p .. p + n - 1 free on loopback: ``mlx.launch``'s default starting port
    is fixed, and two launches at once on one machine would join one ring."""
    for _ in range(50):
        port = random.randrange(20000, 60000)
        try:
            for p in range(port, port + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free ports on loopback")


@dataclass
class Ranks:
    """What the ranks did: each one's exit code (None where it was killed) and output
    (stdout and stderr together, rank 0 first), and whether the time ran out."""

    codes: list[int | None]
    output: str
    timed_out: bool = False

    @property
    def returncode(self) -> int:
        """0 when every rank ended well, else the first rank's own failing code, else -9
        (ranks killed: by the deadline)."""
        bad = [c for c in self.codes if c not in (0, None)]
        return bad[0] if bad else (-9 if None in self.codes else 0)


def start_ranks(argv: list[str], n: int, cwd=None, env=None) -> tuple[list, Path]:
    """Start ``argv`` as ``n`` ring ranks on loopback: (their processes, in rank order, each
    the leader of its own process group; the folder of their logs ``rank<r>.log``, stdout
    and stderr together).

    Args:
        argv: the command of every rank. n: how many ranks. cwd: their folder.
        env: their environment (default: this one's).
    """
    folder = Path(tempfile.mkdtemp(prefix="dflash-ranks-"))
    port = free_port(n)
    hosts = folder / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{port + i}"] for i in range(n)]))
    procs = []
    for rank in range(n):
        rank_env = dict(env if env is not None else os.environ)
        rank_env.update(MLX_RANK=str(rank), MLX_HOSTFILE=str(hosts))
        with open(folder / f"rank{rank}.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    argv, cwd=cwd, env=rank_env, stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True,
                )
            )  # fmt: skip
    return procs, folder


def run_ranks(argv: list[str], n: int, cwd=None, timeout: float = 600, env=None) -> Ranks:
    """Run ``argv`` as ``n`` ring ranks on loopback and wait: a rank that fails ends the
    others (as ``mlx.launch`` does), and so does the timeout.

    Args:
        argv: the command of every rank. n: how many ranks. cwd: their folder.
        timeout: seconds for all of them. env: their environment (default: this one's).
    """
    procs, folder = start_ranks(argv, n, cwd, env)
    timed_out = _wait(procs, time.monotonic() + timeout)
    codes = [None if p.returncode is None or p.returncode < 0 else p.returncode for p in procs]
    out = "".join((folder / f"rank{r}.log").read_text(errors="replace") for r in range(n))
    return Ranks(codes, out, timed_out)


def stop(procs: list) -> None:
    """Kill every rank still running, and what it started."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait()


def _wait(procs: list[subprocess.Popen], deadline: float) -> bool:
    """Wait for every process; kill the rest when one fails or at the deadline (then True)."""
    while [p.poll() for p in procs].count(None):  # every one polled: its code is read
        late = time.monotonic() > deadline
        if late or any(p.returncode not in (None, 0) for p in procs):
            stop(procs)
            return late
        time.sleep(0.05)
    return False
