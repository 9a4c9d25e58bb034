"""Where dflash keeps what it caches on disk, and how a cached file is written and trusted
(a leaf module: only ``env`` of the package imported).

``DFLASH_CACHE_DIR``, else ``$XDG_CACHE_HOME/dflash-mlx``, else ``~/.cache/dflash-mlx``;
``DFLASH_CACHE=0`` turns the caches off (builds then go to a scratch folder removed at
exit). ``diskcache.py`` keeps the entries, ``cpu/builder.py`` the kernels.

Every entry is a folder whose files are written under a temporary name and renamed into
place, then sealed by ``manifest.json``: each file's size and CRC-32 and the versions it
was made for. :func:`check` trusts a file whose size, inode, mtime and ctime are still the
ones sealed (no write can keep its ctime) and hashes it again otherwise. Temporary files
of a killed writer are removed at the next start (:func:`sweep_temps`).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from .. import env

ENV_DIR, ENV_OFF = "DFLASH_CACHE_DIR", "DFLASH_CACHE"
MANIFEST = "manifest.json"
MAX_JSON = 64 << 20  # no JSON file of ours is larger: a bigger one is not read
STALE_S = 3600  # a temporary file this old is stale whatever its writer's pid says
# File times tick coarsely (a jiffy, or seconds on some file systems): a stamp taken this
# close to sealing could hide a later write in the same tick, so its bytes are hashed
RACY_NS = 2_000_000_000
# The variables libstdc++'s temp_directory_path reads, in its order (MLX's JIT uses it)
TMP_VARS = ("TMPDIR", "TMP", "TEMP", "TEMPDIR")
SCRATCH = "dflash-mlx-scratch-"

_state: dict = {"swept": set(), "scratch": None}


def enabled() -> bool:
    """False when ``DFLASH_CACHE=0`` (or off / false / no) turns the caches off."""
    return env.switch(ENV_OFF)


def cache_dir() -> Path:
    """The cache folder; not created here."""
    if os.environ.get(ENV_DIR):
        return Path(os.path.expanduser(os.environ[ENV_DIR]))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dflash-mlx"


def note(text: str, log: Callable[[str], None] | None = None) -> None:
    """One ``note:`` line through log, else on stderr."""
    line = f"note: {text}"
    if log is not None:
        log(line)
    else:
        print(line, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ writing and reading


def temp_name(path: Path) -> Path:
    """Where path is written before it is renamed into place: ``.tmp<pid>-<name>`` (same
    suffix: MLX's savers add their own; the pid tells :func:`sweep_temps` whose it is)."""
    return path.with_name(f".tmp{os.getpid()}-{path.name}")


def write_atomic(path: Path, write: Callable[[Path], None]) -> bool:
    """Write through a temporary file renamed into place (readers never see half a file);
    False when it could not be written."""
    tmp = temp_name(path)
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


def read_json(path: Path) -> dict | None:
    """The JSON object in path, or None when it is missing, too large or unreadable
    (deep nesting included)."""
    try:
        if path.stat().st_size > MAX_JSON:
            return None
        obj = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def write_json(path: Path, obj: dict) -> bool:
    """Store obj as JSON at path, atomically; False on failure."""
    return write_atomic(path, lambda t: t.write_text(json.dumps(obj)))


# ------------------------------------------------------------------ manifests


def crc32(path: Path) -> int:
    """The CRC-32 of a file's bytes (~1 GB/s: 0.1 s of CPU for the demo's 257 MB)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]


def seal(folder: Path, names: Sequence[str], versions: Mapping[str, str]) -> bool:
    """Write ``folder/manifest.json`` for the files ``names``: each one's size, CRC-32 and
    stat stamp, when they were stamped, and ``versions`` (what it was made with). False
    when it could not be."""
    try:
        files = {n: {"crc32": crc32(folder / n), "stamp": _stamp(folder / n)} for n in names}
    except OSError:
        return False
    manifest = {"versions": dict(versions), "files": files, "stamped": time.time_ns()}
    return write_json(folder / MANIFEST, manifest)


def _is_stamp(stamp) -> bool:
    return isinstance(stamp, list) and len(stamp) == 4 and all(type(v) is int for v in stamp)


def _versions_problem(stored, versions: dict) -> str | None:
    if stored == versions:
        return None
    if not isinstance(stored, dict):
        return "its manifest is damaged"
    key = next((k for k, v in versions.items() if stored.get(k) != v), None)
    if key is None:
        return "its manifest is damaged"
    return f"it was made for {key} {str(stored.get(key))[:40]}, not {versions[key]}"


def sealed(folder: Path) -> bool:
    """Whether folder has a manifest (an entry without one is incomplete: never read)."""
    return (folder / MANIFEST).exists()


def _file_problem(path: Path, want, stamped: int, refresh: list) -> str | None:
    if not isinstance(want, dict) or not _is_stamp(want.get("stamp")):
        return "its manifest is damaged"
    try:
        stamp = _stamp(path)
    except OSError:
        return f"{path.name} is missing"
    if stamp[0] != want["stamp"][0]:
        return f"{path.name} has {stamp[0]} bytes, {want['stamp'][0]} were written"
    if stamp == want["stamp"] and stamp[3] < stamped - RACY_NS:
        return None
    try:  # touched since it was sealed, or stamped too soon to tell: its bytes decide
        if crc32(path) != want.get("crc32"):
            return f"{path.name}'s bytes changed"
    except OSError:
        return f"{path.name} is unreadable"
    refresh.append(path.name)
    return None


def check(
    folder: Path, names: Sequence[str], versions: Mapping[str, str] | None = None
) -> str | None:
    """Why the sealed files ``names`` in folder cannot be used (None: they are as written,
    for these versions). A file whose bytes were checked again gets a fresh stamp.

    Args:
        folder: the entry. names: its files.
        versions: what they must have been made with (None: whatever they were).
    """
    manifest = read_json(folder / MANIFEST)
    if manifest is None or not isinstance(manifest.get("files"), dict):
        return "its manifest is damaged"
    if versions is not None:
        why = _versions_problem(manifest.get("versions"), dict(versions))
        if why is not None:
            return why
    stamped = manifest.get("stamped")
    stamped = stamped if type(stamped) is int else 0
    refresh: list[str] = []
    for name in names:
        why = _file_problem(folder / name, manifest["files"].get(name), stamped, refresh)
        if why is not None:
            return why
    if refresh:  # the next start trusts the stamps (a copied cache is hashed once)
        try:
            for name in names:
                manifest["files"][name]["stamp"] = _stamp(folder / name)
        except OSError:
            return None
        write_json(folder / MANIFEST, {**manifest, "stamped": time.time_ns()})
    return None


def unseal(folder: Path) -> None:
    """Remove folder's manifest: its files are about to be rewritten (never read until
    sealed again)."""
    try:
        (folder / MANIFEST).unlink()
    except OSError:
        pass


def discard(folder: Path) -> None:
    """Remove an entry (its manifest first, so a half-removed entry is never read); a
    symbolic link is left alone (removing through it would reach outside the cache)."""
    if folder.is_symlink():
        return
    unseal(folder)
    shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------------ leftovers


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # another user's process, or no such number
        return True
    return True


def _pid_of(name: str, prefix: str) -> int | None:
    digits = name[len(prefix) :].split("-", 1)[0]
    return int(digits) if name.startswith(prefix) and digits.isdigit() else None


def _stale(path: Path, pid: int) -> bool:
    try:
        age = time.time() - path.lstat().st_mtime
    except OSError:
        return False
    return age > STALE_S or not _alive(pid)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except OSError:
            pass


def sweep_temps(folder: Path, prefix: str = ".tmp") -> int:
    """Remove the temporary files (``<prefix><pid>-*``) in folder whose writer is gone or
    that are over an hour old; once per folder and process. Returns how many."""
    if folder in _state["swept"]:
        return 0
    _state["swept"].add(folder)
    try:
        entries = list(folder.iterdir())
    except OSError:
        return 0
    removed = 0
    for path in entries:
        pid = _pid_of(path.name, prefix)
        if pid is not None and _stale(path, pid):
            _remove(path)
            removed += 1
    return removed


def scratch_dir() -> Path:
    """This process's folder for builds when the caches are off: removed at exit, and a
    killed process's is removed by the next start."""
    if _state["scratch"] is None:
        base = Path(tempfile.gettempdir())
        sweep_temps(base, SCRATCH)
        path = Path(tempfile.mkdtemp(prefix=f"{SCRATCH}{os.getpid()}-", dir=base))
        atexit.register(shutil.rmtree, path, True)
        _state["scratch"] = path
    return _state["scratch"]


# ------------------------------------------------------------------ the temp folder


def _cpp_tmp() -> tuple[str, str]:
    for var in TMP_VARS:
        if var in os.environ:
            return var, os.environ[var]
    return "", "/tmp"


def cpp_tmpdir() -> str:
    """The temp folder C++'s ``temp_directory_path`` (MLX's JIT cache) uses here: the first
    of TMPDIR, TMP, TEMP, TEMPDIR set (even empty), else /tmp."""
    return _cpp_tmp()[1]


def _usable(path: str) -> bool:
    return bool(path) and os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)


def fix_tmpdir(log: Callable[[str], None] | None = None) -> str | None:
    """Point TMPDIR at a usable folder when the temp folder named is missing, a file or
    read-only (MLX's compiler would raise on every compiled function), with one note.

    Returns:
        the folder now used, or None when nothing was changed.
    """
    var, current = _cpp_tmp()
    if _usable(current):
        return None
    for candidate in ("/tmp", "/var/tmp", "/usr/tmp", str(cache_dir() / "tmp")):
        try:
            os.makedirs(candidate, exist_ok=True)
        except OSError:
            continue
        if _usable(candidate):
            os.environ["TMPDIR"] = candidate
            tempfile.tempdir = None  # Python's own temp folder is looked up again
            named = f"{var}={current}" if var else current
            note(f"{named} is not a writable folder; using {candidate} for temporary files", log)
            return candidate
    return None
