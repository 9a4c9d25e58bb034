"""The start-up handshake (docs/distributed.md, "Checks at start"): ranks started with other
model files, flags or versions are refused before anything is loaded.

Ranks that load different weights, or run a different dflash / mlx / mlx-lm, would still
pair their collectives and print plausible text that is nobody's model. So right after the
model files are found, every rank gathers every rank's facts (a fixed-size row each, in
one ``all_sum``), and every rank compares them with rank 0's: any difference is one
``error:`` line naming the ranks and what differs, and every rank exits 2. A rank that
could not find its model (a missing directory) sends its error instead of its facts, so
every rank ends with one line naming it rather than a lost connection. The weights are
compared by content too (``weights.digest``: headers and sampled bytes). ``dflash doctor``
prints the same facts as a table (``table``).
"""

from __future__ import annotations

import hashlib
import json
import socket
import sys
import time
from contextlib import contextmanager
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
    "content": "weights (same file names and sizes, other contents)",
}
MODEL_FILES = (".safetensors", ".gguf", ".json")  # weights, configs, tokenizer
# seconds the other ranks wait before raising a refusal: mlx.launch ends the rest when one
# rank exits, and rank 0 (the only one that writes) must have printed its line by then
LINGER_S = 1.0


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "-"


def flags(argv: list[str]) -> list[str]:
    """The arguments after the program, with a path reduced to its name (each host may keep
    the model elsewhere; the files themselves are compared by name and size)."""
    return [Path(a).name if "/" in a and Path(a).exists() else a for a in argv]


def _found(paths) -> list[tuple[str, Path]]:
    """(shown name, path) of each weight, config and tokenizer file of the model paths."""
    out = []
    for p in map(Path, paths):
        if p.is_file():
            out.append((p.name, p))
            continue
        found = sorted(f for f in p.glob("*") if f.suffix in MODEL_FILES and f.is_file())
        out += [(f"{p.name}/{f.name}", f) for f in found]
    return out


def files(paths) -> list[tuple[str, int]]:
    """(name, bytes) of each weight, config and tokenizer file of the model paths (a
    directory's top level, or a single ``.gguf`` file), in order."""
    return [(name, f.stat().st_size) for name, f in _found(paths)]


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:12]


def facts(paths, argv: list[str] | None = None) -> dict:
    """This rank's facts: host, versions, and digests of its flags and model files.

    Args:
        paths: the target's and the drafter's files (directories or ``.gguf`` files).
        argv: the command line (default ``sys.argv``; the program itself is left out).
    """
    from . import weights

    argv = sys.argv if argv is None else argv
    found = files(paths)
    content = [(name, weights.digest(f)) for name, f in _found(paths)]
    row = {"host": _host(), **{p: _version(p) for p in PACKAGES}}
    row |= {"flags": _digest(flags(argv[1:])), "files": _digest(found)}
    row |= {"content": _digest(content)}
    return row | {"n_files": len(found), "gb": round(sum(s for _, s in found) / 1e9, 3)}


def _host() -> str:
    return socket.gethostname()[:40]


def failed(error: BaseException) -> dict:
    """The row of a rank that cannot start (its model is missing): its host and error."""
    return {"host": _host(), "error": " ".join(str(error).split())[:400]}


def gather(row: dict, group) -> list[dict]:
    """Every rank's ``row``, in rank order: a [size, WIDTH] array in which each rank fills
    its own line, summed over the group (a gather made of one ``all_sum``)."""
    import mlx.core as mx

    from .link import agreed_sum

    raw = json.dumps(row, separators=(",", ":")).encode()
    while len(raw) > WIDTH and row.get("error"):  # an error line too long for its row
        row = {**row, "error": row["error"][: len(row["error"]) - (len(raw) - WIDTH) - 8]}
        raw = json.dumps(row, separators=(",", ":")).encode()
    raw = raw[:WIDTH]
    lines = [[0] * WIDTH for _ in range(group.size())]
    lines[group.rank()][: len(raw)] = list(raw)
    got = agreed_sum(mx.array(lines, mx.int32), group)
    return [json.loads(bytes(v for v in line if v).decode()) for line in got.tolist()]


def differences(rows: list[dict]) -> list[str]:
    """What sets each rank apart from rank 0, one phrase per rank that differs (ranks that
    sent an error instead of their facts are ``check``'s)."""
    out = []
    for r, row in enumerate(rows[1:], 1):
        what = []
        for key, name in COMPARED.items():
            if "error" in row or "error" in rows[0] or row.get(key) == rows[0].get(key):
                continue
            if key == "content" and COMPARED["files"] in what:
                continue  # other files: other contents, said once
            digests = ("flags", "files", "content")
            shown = "" if key in digests else f" ({row[key]} vs {rows[0][key]})"
            what.append(name + shown)
        if what:
            out.append(f"rank {r} ({row.get('host')}) has other {', '.join(what)}")
    return out


def check(group, paths, argv: list[str] | None = None, failure=None) -> list[dict]:
    """Refuse ranks started differently, or that could not find their model; every rank
    raises alike.

    Args:
        group: the ``mx.distributed.Group`` (None: one process, nothing to check).
        paths: this rank's target and drafter files. argv: the command line.
        failure: this rank's error when it could not find its model (``paths`` unused):
            sent instead of its facts, so that every rank names it.

    Returns:
        every rank's facts ([] for one process).

    Raises:
        DFlashError: one line naming each rank that failed or differs from rank 0.
    """
    if group is None:
        return []
    try:
        row = failed(failure) if failure is not None else facts(paths, argv)
    except OSError as e:  # a model file vanished or cannot be read
        row = failed(f"cannot read its model files ({e})")
    try:
        rows = gather(row, group)
    except RuntimeError as e:  # MLX's ring: a rank ended before it sent its facts
        raise DFlashError(
            f"another rank exited during the start-up check ({e}); run `mlx.launch ... "
            "dflash doctor` to see which, and start every rank alike"
        ) from None
    n, broken = len(rows), []
    for r, x in enumerate(rows):
        if "error" in x:
            broken.append(f"rank {r} of {n} ({x.get('host')}): {x['error']}")
    diff = differences(rows)
    if (broken or diff) and group.rank() != 0:
        time.sleep(LINGER_S)
    if broken:
        raise DFlashError(f"a rank cannot start: {'; '.join(broken)}")
    if diff:
        raise DFlashError(
            f"the ranks were started differently than rank 0: {'; '.join(diff)}; start every "
            "rank with the same model files, flags and dflash / mlx / mlx-lm versions"
        )
    return rows


@contextmanager
def told(group):
    """Inside: a ``DFlashError`` of this rank (its model is missing) goes through the
    handshake (``check``'s ``failure``), so that every rank raises naming it; in one
    process it is raised as is.

    Args:
        group: the ``mx.distributed.Group``, or None.
    """
    try:
        yield
    except DFlashError as e:
        check(group, (), failure=e)
        raise


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
