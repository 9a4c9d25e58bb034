"""Shard claims: which process is generating a shard, and whether it still lives.

Several processes (and machines sharing a folder) may distil one split at once. A shard being
written is a temporary directory ``shard_NNNN.tmp`` that appears atomically with its
holder's record in it (``owner.json``: pid, host, pid namespace). A claim whose holder is
gone is taken over at once on the same host; one from another host, or whose record cannot
be read, when it was not touched for ``STALE_S`` (its holder touches it after every batch).
An interrupted run releases its claim, and a killed one leaves a claim the rerun takes over.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
import uuid
from pathlib import Path

OWNER = "owner.json"
STALE_S = 1800.0  # an untouched claim of unknown liveness is dead after 30 minutes


def tmp_dir(path: Path) -> Path:
    """The temporary directory (the claim) of a shard being written."""
    return path.with_name(path.name + ".tmp")


def me() -> dict:
    """This process: pid, host and pid namespace (containers sharing a folder reuse pids)."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    return {"pid": os.getpid(), "host": socket.gethostname(), "ns": ns}


def owner(tmp: Path) -> dict | None:
    """The holder's record of a claim, or None when it cannot be read."""
    try:
        rec = json.loads((Path(tmp) / OWNER).read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def _alive(pid) -> bool:
    """Whether a process of this pid namespace has this pid."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


def holder(path: Path, stale_s: float = STALE_S) -> dict | None:
    """Who is generating a shard, or None when nobody is (not claimed, or its holder is
    dead: that claim may be taken over).

    Args:
        path: the shard's directory. stale_s: age after which a claim of unknown
            liveness (another host, an unreadable record, a pid maybe reused) is dead.
    """
    tmp = tmp_dir(path)
    try:
        age = time.time() - tmp.stat().st_mtime
    except OSError:
        return None
    rec, here = owner(tmp), me()
    local = rec is not None and all(rec.get(k) == here[k] for k in ("host", "ns"))
    if local and (rec.get("pid") == here["pid"] or not _alive(rec.get("pid"))):
        return None  # this process's own leftover, or a dead process's
    if age >= stale_s:
        return None
    return rec or {"pid": "?", "host": "?"}


def claim(path: Path, stale_s: float = STALE_S) -> bool:
    """Claim a shard for this process; False when it is finished or another live process
    holds it.

    Args:
        path: the shard's directory. stale_s: as for :func:`holder`.
    """
    path = Path(path)
    if path.exists() or holder(path, stale_s) is not None:
        return False
    tmp = tmp_dir(path)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    mine = tmp.with_name(f".{tmp.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    mine.mkdir()
    (mine / OWNER).write_text(json.dumps({**me(), "since": time.time()}))
    try:
        for _ in range(3):
            try:
                mine.rename(tmp)  # atomic, and refused while a claim is there
                return True
            except OSError:
                if path.exists() or holder(path, stale_s) is not None:
                    return False
                _take_over(tmp)
        return False
    finally:
        shutil.rmtree(mine, ignore_errors=True)


def _take_over(tmp: Path) -> None:
    """Move a dead claim away (one process wins the rename) and delete it. A live claim
    made in between and moved by mistake is put back (or left, never deleted)."""
    dead = owner(tmp)
    grave = tmp.with_name(f".{tmp.name}.dead.{os.getpid()}")
    try:
        tmp.rename(grave)
    except OSError:
        return
    if owner(grave) != dead:
        try:
            grave.rename(tmp)
        except OSError:
            pass
        return
    shutil.rmtree(grave, ignore_errors=True)


def release(path: Path) -> None:
    """Give up this process's claim on a shard (an interrupted generation)."""
    tmp = tmp_dir(path)
    rec = owner(tmp)
    if rec is not None and rec.get("pid") == os.getpid() and rec.get("host") == me()["host"]:
        shutil.rmtree(tmp, ignore_errors=True)


def heartbeat(path: Path) -> None:
    """Mark a claimed shard as alive (its temporary directory's mtime is the claim's age)."""
    tmp = tmp_dir(path)
    if tmp.exists():
        os.utime(tmp)
