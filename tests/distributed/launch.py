"""Start a script on two ranks on this machine (the ring backend on loopback, with or
without ``mlx.launch``), bounded in time; kills only what it started."""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

LAUNCH = shutil.which("mlx.launch") or str(Path(sys.executable).with_name("mlx.launch"))
TIMEOUT = 420  # seconds for both ranks, loading included (generous: a CI box may be loaded)
needs_launch = pytest.mark.skipif(not Path(LAUNCH).exists(), reason="mlx.launch is not installed")


def kernels_built() -> None:
    """The CPU kernels built here first, into the run's cache the ranks share: ranks building
    them at once on a loaded machine could end one with them and one without (a compile past
    its time limit), whose drafts would differ and whose collectives would no longer pair
    (the suspected cause of a hang seen here at load 40)."""
    from dflash_mlx.cpu import exact_ops

    exact_ops.load()


def ring(n: int = 2) -> list[str]:
    """``mlx.launch``'s command for ``n`` ranks on loopback, on ports of their own (its
    default starting port is fixed, so two launches at once would join one ring)."""
    from dflash_mlx.distributed.local import free_port

    kernels_built()
    return [LAUNCH, "-n", str(n), "--backend", "ring", "--starting-port", str(free_port(n))]


def launch(args: list[str], cwd: Path, timeout: int = TIMEOUT) -> subprocess.CompletedProcess:
    """Run ``python args...`` on two ring ranks (``distributed.local``: the environment
    ``mlx.launch`` gives, without its launcher, which spins a core while the ranks run);
    every rank's output, rank 0's first. The test that needs ``mlx.launch`` itself uses
    ``launch_with_mlx``."""
    from dflash_mlx.distributed.local import run_ranks

    kernels_built()
    res = run_ranks([sys.executable, *args], 2, cwd=cwd, timeout=timeout)
    if res.timed_out:
        pytest.fail(f"the ranks did not finish in {timeout} s:\n{res.output[-2000:]}")
    return subprocess.CompletedProcess(args, res.returncode, res.output)


def launch_with_mlx(
    args: list[str], cwd: Path, timeout: int = TIMEOUT
) -> subprocess.CompletedProcess:
    """Run ``python args...`` under ``mlx.launch -n 2 --backend ring``; the launcher's output
    (it exits 0 even when a rank fails: check each rank's own lines)."""
    cmd = [*ring(2), "--", sys.executable, *args]
    proc = subprocess.Popen(
        cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the ranks it started, only
        out, _ = proc.communicate()
        pytest.fail(f"the ranks did not finish in {timeout} s:\n{out.decode()[-2000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out.decode(errors="replace"))


class FakeGroup:
    """A stand-in ``mx.distributed.Group`` for tests that need only its size and rank."""

    def __init__(self, size=2, rank=0):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank
