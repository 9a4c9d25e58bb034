"""What makes the second start fast, kept on disk: the dequantized weights and the
tokenizer of a GGUF target (dequantizing takes seconds on a CPU) and the warm-up's step
costs per model and machine.

Everything lives under :func:`cache_dir`: ``DFLASH_CACHE_DIR``, else
``$XDG_CACHE_HOME/dflash-mlx``, else ``~/.cache/dflash-mlx``; ``DFLASH_CACHE=0`` turns the
caches off. Entries are keyed by the source files' path, size and mtime and the package
version, so a changed file or a new release builds a new entry. A cache that cannot be
read or written is skipped, never an error: it only costs the time it would have saved.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from .cachedir import cache_dir, enabled

MAX_WEIGHTS = 8 << 30  # weights larger than this are not cached (disk, not time)
COSTS_MAX_AGE = 7 * 24 * 3600  # seconds before the warm-up is measured afresh
COSTS_VERSION = 4  # 2: every width timed; 3: median of WARM_ROUNDS rounds; 4: lookup costs
GGUF_LAYOUT = "f16+tokenizer.json"  # what an entry holds; a new layout makes new entries


def identity(*paths, tag: str = "") -> str:
    """A short key for files (or folders: their files) as they are now: path, size, mtime
    of each, the package version and tag (the layout of the entry)."""
    parts = [sys.modules["dflash_mlx"].__version__, tag]  # the package is loaded: no cycle
    for p in map(Path, paths):
        files = sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else [p]
        for f in files:
            st = f.stat()
            parts.append(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def read_json(path: Path) -> dict | None:
    """The JSON object in path, or None when it is missing or unreadable."""
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def _replace_into(path: Path, write: Callable[[Path], None]) -> bool:
    """Write through a temporary file renamed into place (readers never see half a file);
    False when it could not be written."""
    tmp = path.with_name(f".tmp{os.getpid()}-{path.name}")  # same suffix: MLX adds its own
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        os.replace(tmp, path)
        return True
    except (OSError, RuntimeError, ValueError):  # read-only, full disk, MLX's write errors
        try:
            tmp.unlink()
        except OSError:
            pass
        return False


def write_json(path: Path, obj: dict) -> bool:
    """Store obj as JSON at path, atomically; False on failure."""
    return _replace_into(path, lambda t: t.write_text(json.dumps(obj)))


# ------------------------------------------------------------------ GGUF weights


def gguf_entry(path) -> Path | None:
    """The cache folder of a GGUF file's dequantized weights, or None with caching off."""
    if not enabled():
        return None
    try:
        return cache_dir() / "gguf" / identity(path, tag=GGUF_LAYOUT)
    except OSError:
        return None


def load_weights(entry: Path | None):
    """(weights dict, config dict, tokenizer metadata) cached in entry (with its
    tokenizer.json beside them), or None."""
    if entry is None:
        return None
    info = read_json(entry / "info.json")
    if info is None or not (entry / "weights.safetensors").is_file():
        return None
    import mlx.core as mx

    try:
        weights = mx.load(str(entry / "weights.safetensors"))
    except (RuntimeError, ValueError, OSError):
        return None
    return weights, info["config"], info["tokenizer"]


def save_weights(
    entry: Path | None,
    weights: dict,
    config: dict,
    tok_meta: dict,
    tok_json: str,
    source=None,
    log=None,
):
    """Cache dequantized weights with their config, tokenizer metadata and tokenizer.json
    (skipped when too large or the disk is short of room); says once, through log, that it
    does. The entries of older versions of the same source file are removed."""
    if entry is None:
        return
    import mlx.core as mx

    size = sum(w.nbytes for w in weights.values())
    try:
        root = cache_dir()
        root.mkdir(parents=True, exist_ok=True)
        room = shutil.disk_usage(root).free
    except OSError:
        return
    if size > MAX_WEIGHTS or size * 2 > room:
        return
    if log is not None:
        log(
            f"note: caching the dequantized weights ({size / 2**20:.0f} MB) in {entry} once; "
            "later starts skip the dequantization"
        )
    ok = _replace_into(
        entry / "weights.safetensors", lambda t: mx.save_safetensors(str(t), weights)
    )
    ok = ok and _replace_into(entry / "tokenizer.json", lambda t: t.write_text(tok_json))
    if ok:  # written last: an entry without it is incomplete and ignored
        write_json(entry / "info.json", {"config": config, "tokenizer": tok_meta})
    if ok and source is not None:
        _prune(entry, str(Path(source).resolve()))


def _prune(entry: Path, source: str) -> None:
    """Mark entry as built from source and delete the other entries built from it (the
    file changed since: they can never be read again)."""
    _replace_into(entry / "source.txt", lambda t: t.write_text(source))
    for other in entry.parent.iterdir():
        try:
            stale = other != entry and (other / "source.txt").read_text() == source
        except OSError:
            continue
        if stale:
            shutil.rmtree(other, ignore_errors=True)


# ------------------------------------------------------------------ warm-up step costs


def _cpu_model() -> str:
    """The CPU's model name (Linux), so that a disk moved to another CPU measures afresh."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _machine() -> str:
    from .. import ops

    described = ops.describe()  # the device, MLX, and the CPU backend's BLAS and kernels
    return "|".join(
        [platform.node(), platform.machine(), _cpu_model(), str(os.cpu_count())]
        + [str(described[k]) for k in sorted(described)]
    )


WARM_UP_VERSION = 3  # how ``warmup.warm_up`` times: tables of another version are re-measured


def costs_file(target_path: str, drafter_path: str, vocab: str = "") -> Path | None:
    """Where the warm-up costs of this pair on this machine are kept, or None.

    Args:
        target_path, drafter_path: the pair. vocab: its draft vocabulary's size ("" for
            the full vocabulary): the drafter's cost depends on it.
    """
    if not enabled():
        return None
    try:
        key = identity(target_path, drafter_path, tag=f"vocab={vocab} warm-up={WARM_UP_VERSION}")
    except OSError:
        return None
    machine = hashlib.sha256(_machine().encode()).hexdigest()[:12]
    return cache_dir() / "costs" / f"{key}-{machine}.json"


def _costs_path(pair) -> Path | None:
    head = getattr(pair, "draft_head", None)
    return costs_file(pair.target_path, pair.drafter_path, "" if head is None else str(head.size))


def read_costs(pair) -> dict[str, dict[int, float]] | None:
    """The stored step costs of this pair on this machine, in seconds by block width, as
    {"seconds": drafted cycles (1: a plain step), "lookup_seconds": copied cycles}; None
    when there are none, they are a week old or from another layout, or unreadable.

    Args:
        pair: the loaded ``DFlashModel`` (its paths, block size and draft vocabulary).
    """
    path = _costs_path(pair)
    stored = read_json(path) if path is not None else None
    try:
        fresh = (
            stored.get("version") == COSTS_VERSION
            and stored.get("max_block") == pair.block_size
            and 0 <= time.time() - stored.get("measured", 0) < COSTS_MAX_AGE
        )
        tables = {
            name: {int(b): float(s) for b, s in stored[name].items()}
            for name in ("seconds", "lookup_seconds")
        }
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    ok = all(t and all(0 < s < float("inf") for s in t.values()) for t in tables.values())
    return tables if fresh and ok else None


def write_costs(pair, tables: dict[str, dict[int, float]]) -> None:
    """Store step costs as :func:`read_costs` returns them (skipped when caches are off).

    Args:
        pair: the loaded ``DFlashModel``. tables: {"seconds": ..., "lookup_seconds": ...}.
    """
    path = _costs_path(pair)
    if path is None:
        return
    data = {name: {str(b): s for b, s in t.items()} for name, t in tables.items()}
    meta = {"version": COSTS_VERSION, "max_block": pair.block_size, "measured": time.time()}
    write_json(path, {**meta, **data})
