"""The start-up handshake (docs/distributed.md, "Checks at start"): ranks started with other
model files, flags or versions are refused before anything is loaded.

Ranks that load different weights, or run a different dflash / mlx / mlx-lm, would still
pair their collectives and print plausible text that is nobody's model. So right after the
model files are found, every rank gathers every rank's facts (a fixed-size row each, in
one ``all_sum``), and every rank compares them with rank 0's: any difference is one
``error:`` line naming the ranks and what differs, and every rank exits 2. ``dflash
doctor`` prints the same facts as a table (``table``).
"""

from __future__ import annotations

import hashlib
import json
import socket
import sys
from importlib import metadata
from pathlib import Path

from ..errors import DFlashError

WIDTH = 512  # bytes of one rank's facts as gathered (JSON, zero-padded)
PACKAGES = ("dflash-mlx", "mlx", "mlx-lm")
# what is compared, and how the error line calls it
COMPARED = {
    "dflash-mlx": "dflash version",
    "mlx": "mlx version",
    "mlx-lm": "mlx-lm version",
    "flags": "command-line flags",
    "files": "model files",
}
MODEL_FILES = (".safetensors", ".gguf", ".json")  # weights, configs, tokenizer


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "-"


def flags(argv: list[str]) -> list[str]:
    """The arguments after the program, with a path reduced to its name (each host may keep
    the model elsewhere; the files themselves are compared by name and size)."""
    return [Path(a).name if "/" in a and Path(a).exists() else a for a in argv]


def files(paths) -> list[tuple[str, int]]:
    """(name, bytes) of each weight, config and tokenizer file of the model paths (a
    directory's top level, or a single ``.gguf`` file), in order."""
    out = []
    for p in map(Path, paths):
        if p.is_file():
            out.append((p.name, p.stat().st_size))
            continue
        found = sorted(f for f in p.glob("*") if f.suffix in MODEL_FILES and f.is_file())
        out += [(f"{p.name}/{f.name}", f.stat().st_size) for f in found]
    return out


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:12]


def facts(paths, argv: list[str] | None = None) -> dict:
    """This rank's facts: host, versions, and digests of its flags and model files.

    Args:
        paths: the target's and the drafter's files (directories or ``.gguf`` files).
        argv: the command line (default ``sys.argv``; the program itself is left out).
    """
    argv = sys.argv if argv is None else argv
    found = files(paths)
    row = {"host": socket.gethostname()[:40], **{p: _version(p) for p in PACKAGES}}
    row |= {"flags": _digest(flags(argv[1:])), "files": _digest(found)}
    return row | {"n_files": len(found), "gb": round(sum(s for _, s in found) / 1e9, 3)}


def gather(row: dict, group) -> list[dict]:
    """Every rank's ``row``, in rank order: a [size, WIDTH] array in which each rank fills
    its own line, summed over the group (a gather made of one ``all_sum``)."""
    import mlx.core as mx

    raw = json.dumps(row, separators=(",", ":")).encode()[:WIDTH]
    lines = [[0] * WIDTH for _ in range(group.size())]
    lines[group.rank()][: len(raw)] = list(raw)
    got = mx.distributed.all_sum(mx.array(lines, mx.int32), group=group)
    return [json.loads(bytes(v for v in line if v).decode()) for line in got.tolist()]


def differences(rows: list[dict]) -> list[str]:
    """What sets each rank apart from rank 0, one phrase per rank that differs."""
    out = []
    for r, row in enumerate(rows[1:], 1):
        what = []
        for key, name in COMPARED.items():
            if row.get(key) != rows[0].get(key):
                shown = "" if key in ("flags", "files") else f" ({row[key]} vs {rows[0][key]})"
                what.append(name + shown)
        if what:
            out.append(f"rank {r} ({row.get('host')}) has other {', '.join(what)}")
    return out


def check(group, paths, argv: list[str] | None = None) -> list[dict]:
    """Refuse ranks started differently; every rank raises alike.

    Args:
        group: the ``mx.distributed.Group`` (None: one process, nothing to check).
        paths: this rank's target and drafter files. argv: the command line.

    Returns:
        every rank's facts ([] for one process).

    Raises:
        DFlashError: one line naming each rank that differs from rank 0 and what differs.
    """
    if group is None:
        return []
    rows = gather(facts(paths, argv), group)
    diff = differences(rows)
    if diff:
        raise DFlashError(
            f"the ranks were started differently than rank 0: {'; '.join(diff)}; start every "
            "rank with the same model files, flags and dflash / mlx / mlx-lm versions"
        )
    return rows


def table(rows: list[dict]) -> str:
    """The gathered facts, a line per rank, for ``dflash doctor``."""
    head = f"{'rank':<5}{'host':<22}{'dflash':<12}{'mlx':<10}{'mlx-lm':<10}{'files':<8}{'GB':>9}"
    lines = [head]
    for r, row in enumerate(rows):
        lines.append(
            f"{r:<5}{row['host'][:21]:<22}{row['dflash-mlx']:<12}{row['mlx']:<10}"
            f"{row['mlx-lm']:<10}{row['n_files']:<8}{row['gb']:>9.3f}"
        )
    return "\n".join(lines)


def reachable(group, timeout: float) -> float | None:
    """Seconds one ``all_sum`` over the group took, or None when it did not complete within
    ``timeout`` seconds (a rank is down or unreachable; the waiting thread is left behind).

    Args:
        group: the ``mx.distributed.Group``. timeout: seconds to wait.
    """
    import threading
    import time

    import mlx.core as mx

    got: dict = {}

    def ring() -> None:
        t = time.perf_counter()
        total = mx.distributed.all_sum(mx.array([1], mx.int32), group=group).item()
        got["seconds"] = time.perf_counter() - t if total == group.size() else None

    worker = threading.Thread(target=ring, daemon=True)
    worker.start()
    worker.join(timeout)
    return got.get("seconds")
