"""What makes the second start fast, kept on disk: the dequantized weights and the
tokenizer of a GGUF target (dequantizing takes seconds on a CPU) and the warm-up's step
costs per model pair and chip.

Everything lives under :func:`cache_dir`: ``DFLASH_CACHE_DIR``, else
``$XDG_CACHE_HOME/dflash-mlx``, else ``~/.cache/dflash-mlx``; ``DFLASH_CACHE=0`` turns the
caches off. Entries are keyed by the source files' path, size and mtime and the package
version, so a changed file or a new release builds a new entry. Each entry is a folder
sealed by a manifest (``cachedir``): one whose files are not as written, or whose content
is not what this module writes, is removed and built again with one note. A cache that
cannot be read or written is skipped, never an error: it only costs the time it saved.
"""

from __future__ import annotations

import hashlib
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .cachedir import (
    cache_dir,
    check,
    discard,
    enabled,
    note,
    read_json,
    seal,
    sealed,
    sweep_temps,
    unseal,
    write_atomic,
    write_json,
)

MAX_WEIGHTS = 8 << 30  # weights larger than this are not cached (disk, not time)
COSTS_MAX_AGE = 7 * 24 * 3600  # seconds before the warm-up is measured afresh
COSTS_VERSION = 4  # 2: every width timed; 3: median of WARM_ROUNDS rounds; 4: lookup costs
GGUF_LAYOUT = "f16+tokenizer.json+manifest"  # what an entry holds; a new layout: new entries
GGUF_FILES = ("weights.safetensors", "tokenizer.json", "info.json")
COSTS_FILE = "costs.json"
COSTS_VERSIONS = {"costs": str(COSTS_VERSION)}  # in the entry's key too: never a mismatch
MIN_COST, MAX_COST = 1e-9, 1e4  # seconds a stored cycle may cost: outside is not a timing


class Damaged(Exception):
    """A cache entry that failed its checks (already removed); the message says how."""


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


# ------------------------------------------------------------------ GGUF weights


def gguf_entry(path) -> Path | None:
    """The cache folder of a GGUF file's dequantized weights, or None with caching off.
    What killed writers left in the GGUF entries is removed first."""
    if not enabled():
        return None
    try:
        entry = cache_dir() / "gguf" / identity(path, tag=GGUF_LAYOUT)
    except OSError:
        return None
    try:
        for folder in entry.parent.iterdir():
            sweep_temps(folder)
    except OSError:
        pass
    return entry


def _gguf_versions() -> dict[str, str]:
    import mlx.core as mx

    return {"dflash-mlx": sys.modules["dflash_mlx"].__version__, "mlx": mx.__version__}


def _info(entry: Path) -> tuple[dict, dict] | str:
    info = read_json(entry / "info.json")
    config = info.get("config") if info is not None else None
    tok = info.get("tokenizer") if info is not None else None
    if not isinstance(config, dict) or not isinstance(tok, dict):
        return "info.json lacks its config or tokenizer"
    return config, tok


def load_weights(entry: Path | None):
    """(weights dict, config dict, tokenizer metadata) cached in entry (with its
    tokenizer.json beside them), or None when there is no finished entry.

    Raises:
        Damaged: the entry is not as it was written, or MLX cannot read it; it is removed.
    """
    if entry is None or not sealed(entry):
        return None
    import mlx.core as mx

    why = check(entry, GGUF_FILES, _gguf_versions())
    info = _info(entry) if why is None else why
    if isinstance(info, tuple):
        try:
            return mx.load(str(entry / "weights.safetensors")), *info
        except (RuntimeError, ValueError, OSError) as e:
            info = f"weights.safetensors: {(str(e).splitlines() or ['unreadable'])[0]}"
    discard(entry)
    raise Damaged(info)


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
    unseal(entry)  # rewritten below: never read until sealed again
    src = str(Path(source).resolve()) if source is not None else None
    ok = src is None or write_atomic(entry / "source.txt", lambda t: t.write_text(src))
    ok = ok and write_atomic(entry / GGUF_FILES[0], lambda t: mx.save_safetensors(str(t), weights))
    ok = ok and write_atomic(entry / GGUF_FILES[1], lambda t: t.write_text(tok_json))
    ok = ok and write_json(entry / GGUF_FILES[2], {"config": config, "tokenizer": tok_meta})
    if ok:  # sealed last: an entry without a manifest is incomplete and never read
        seal(entry, GGUF_FILES, _gguf_versions())
    if src is not None:
        _prune(entry, src)


def _prune(entry: Path, source: str) -> None:
    """Delete the other entries built from source (the file changed since: they can never
    be read again), finished or not: each names its source in ``source.txt``, first."""
    for other in entry.parent.iterdir():
        try:
            stale = other != entry and (other / "source.txt").read_text() == source
        except OSError:
            continue
        if stale:
            discard(other)


# ------------------------------------------------------------------ warm-up step costs


def _cpu_model() -> str:
    """The CPU's model name: /proc/cpuinfo (Linux), sysctl's brand string (macOS)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    try:
        cmd = ["sysctl", "-n", "machdep.cpu.brand_string"]
        out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=5)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor()


def chip() -> str:
    """What computes, as the warm-up costs' key names it: MLX's device name (a Mac's chip,
    e.g. "Apple M3 Max"), the CPU model and core count. Never the host name, which changes
    with a Mac's network."""
    import mlx.core as mx

    try:
        device = str(mx.device_info().get("device_name", ""))
    except (AttributeError, RuntimeError):
        device = ""
    return "|".join([device, platform.machine(), _cpu_model(), str(os.cpu_count())])


def _machine() -> str:
    from .. import ops

    described = ops.describe()  # the device, MLX, and the CPU backend's BLAS and kernels
    return "|".join([chip()] + [str(described[k]) for k in sorted(described)])


# how ``warmup.warm_up`` times (4: long-context tables too): other versions are re-measured
WARM_UP_VERSION = 4


def costs_file(target_path: str, drafter_path: str, vocab: str = "") -> Path | None:
    """Where the warm-up costs of this pair on this machine are kept (``costs.json`` in an
    entry folder of its own), or None.

    Args:
        target_path, drafter_path: the pair. vocab: its draft vocabulary's size ("" for
            the full vocabulary): the drafter's cost depends on it.
    """
    if not enabled():
        return None
    try:
        tag = f"vocab={vocab} warm-up={WARM_UP_VERSION} costs={COSTS_VERSION}"
        key = identity(target_path, drafter_path, tag=tag)
    except OSError:
        return None
    machine = hashlib.sha256(_machine().encode()).hexdigest()[:12]
    entry = cache_dir() / "costs" / f"{key}-{machine}"
    sweep_temps(entry)
    return entry / COSTS_FILE


def _costs_path(pair) -> Path | None:
    from ..model.quantize import bits_of  # a quantized drafter costs otherwise

    head, bits = getattr(pair, "draft_head", None), bits_of(getattr(pair, "drafter", None))
    vocab = ("" if head is None else str(head.size)) + (f" bits={bits}" if bits else "")
    return costs_file(pair.target_path, pair.drafter_path, vocab + _group_tag(pair))


def _group_tag(pair) -> str:
    """The key's part for a target sharded over ranks (its costs are not the one-process
    pair's, nor another group's): ranks, shard mode, backend, link; "" in one process."""
    info = getattr(pair, "group_info", None)
    if not info:
        return ""
    return " group=" + ",".join(f"{k}:{info[k]}" for k in sorted(info))


def _number(x) -> float | None:
    """x as a finite float when it is a JSON number (not a bool, a string or a huge int)."""
    if type(x) not in (int, float):
        return None
    try:
        x = float(x)
    except OverflowError:
        return None
    return x if math.isfinite(x) else None


def _tables(stored: dict, max_block: int) -> dict[str, dict[int, float]] | None:
    """The tables of stored costs (the two at the long context optional), or None when
    one is missing, or a width or a cost is not one."""
    from ..decoding.schedule import TABLE_NAMES  # the names ``Tuning.tables`` writes

    out = {}
    for name in TABLE_NAMES:
        table = stored.get(name)
        if name.startswith("long") and table is None:
            continue
        if not isinstance(table, dict) or not table:
            return None
        out[name] = {}
        for b, s in table.items():
            width = int(b) if b.isascii() and b.isdigit() and len(b) < 4 else 0
            s = _number(s)
            if not 1 <= width <= max_block or s is None or not MIN_COST <= s <= MAX_COST:
                return None
            out[name][width] = s
    return out


def _fresh(stored: dict, max_block: int) -> bool:
    """Measured by this layout for this block size, less than a week ago."""
    measured = _number(stored.get("measured"))
    age = time.time() - measured if measured is not None else -1.0
    same = type(stored.get("version")) is int and stored["version"] == COSTS_VERSION
    return same and stored.get("max_block") == max_block and 0 <= age < COSTS_MAX_AGE


def read_costs(pair) -> dict[str, dict[int, float]] | None:
    """The stored step costs of this pair on this machine, in seconds by block width, as
    {"seconds": drafted cycles (1: a plain step), "lookup_seconds": copied cycles} and the
    same at the warm-up's long context ("long_seconds", "long_lookup_seconds"); None
    when there are none, or they are a week old or from another layout (measured again).
    Costs that are not as written, or not costs, are removed with one note.

    Args:
        pair: the loaded ``DFlashModel`` (its paths, block size and draft vocabulary).
    """
    path = _costs_path(pair)
    if path is None or not sealed(path.parent):
        return None
    why = check(path.parent, [COSTS_FILE], COSTS_VERSIONS)
    stored = read_json(path) if why is None else None
    if why is None and stored is not None and not _fresh(stored, pair.block_size):
        return None
    tables = _tables(stored, pair.block_size) if stored is not None else None
    if tables is None:
        discard(path.parent)
        note(
            f"the stored warm-up costs {path} cannot be used ({why or 'not costs'}); measuring them again",
            getattr(pair, "notes", None),
        )
    return tables


def write_costs(pair, tables: dict[str, dict[int, float]]) -> None:
    """Store step costs as :func:`read_costs` returns them (skipped when caches are off).

    Args:
        pair: the loaded ``DFlashModel``. tables: {"seconds": ..., "lookup_seconds": ...,
            and at the long context "long_seconds": ..., "long_lookup_seconds": ...}.
    """
    path = _costs_path(pair)
    if path is None:
        return
    data = {name: {str(b): s for b, s in t.items()} for name, t in tables.items()}
    meta = {"version": COSTS_VERSION, "max_block": pair.block_size, "measured": time.time()}
    unseal(path.parent)
    if write_json(path, {**meta, **data}):
        seal(path.parent, [COSTS_FILE], COSTS_VERSIONS)
    try:  # the layout before entries: one file per pair and machine
        path.parent.with_suffix(".json").unlink(missing_ok=True)
    except OSError:
        pass
