"""A shared library checked on disk before anything maps it; MLX's own compile cache swept.

ctypes, Python's import and MLX's JIT all ``dlopen`` their file: one cut short maps pages
past its end and the first touch kills the process (SIGBUS, every run), one with another
library's symbols fails every run. Reading its ELF headers first takes microseconds and
maps nothing: :func:`problem` says whether every loaded segment lies within the file and
the names wanted are exported. :func:`sweep_mlx_cache` applies it to the libraries MLX's
CPU backend compiles into ``$TMPDIR/mlx/<version>/cpu`` and removes the damaged ones (MLX
compiles a missing one again). Nothing here imports MLX.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from ..loading import cachedir

PT_LOAD, SHT_DYNSYM = 1, 11
MAX_BYTES = 256 << 20  # a kernel library is far smaller: read no more than this
SETTLE_S = 2.0  # a damaged library younger than this may be a compiler still writing it
# MLX clips kernel names longer than 245 characters to 229 plus a hash (cpu/compiled.cpp)
MLX_CLIP = 229


def _read(path: Path) -> bytes | str:
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            return f"{size} bytes, too large for a kernel"
        return path.read_bytes()
    except OSError as e:
        return f"unreadable ({e.strerror or e})"


def _header(data: bytes):
    """(byte order, e_phoff, e_shoff, e_phentsize, e_phnum, e_shentsize, e_shnum) of a
    64-bit ELF file, or why it is not one."""
    if len(data) < 64 or data[:4] != b"\x7fELF":
        return "not an ELF library" if data else "empty"
    if data[4] != 2 or data[5] not in (1, 2):
        return "not a 64-bit ELF library"
    order = "<" if data[5] == 1 else ">"
    f = struct.unpack_from(order + "HHIQQQIHHHHHH", data, 16)
    return order, f[4], f[5], f[8], f[9], f[10], f[11]


def _within(data: bytes, off: int, count: int, size: int) -> bool:
    return 0 <= off and off + count * size <= len(data)


def _segments_fit(data: bytes, order: str, phoff: int, phent: int, phnum: int) -> bool:
    if phent < 56 or not _within(data, phoff, phnum, phent):
        return False
    for i in range(phnum):
        p_type, _, p_offset, _, _, p_filesz, _, _ = struct.unpack_from(
            order + "IIQQQQQQ", data, phoff + i * phent
        )
        if p_type == PT_LOAD and p_offset + p_filesz > len(data):
            return False
    return True


def _sections(data: bytes, order: str, shoff: int, shent: int, shnum: int) -> list | None:
    """Each section's (type, offset, size, link, entsize), or None when they lie outside."""
    if shoff == 0 or shent < 64 or not _within(data, shoff, shnum, shent):
        return None
    out = []
    for i in range(shnum):
        f = struct.unpack_from(order + "IIQQQQIIQQ", data, shoff + i * shent)
        if f[4] + (f[5] if f[1] != 8 else 0) > len(data):  # type 8 (NOBITS) takes no bytes
            return None
        out.append((f[1], f[4], f[5], f[6], f[9]))
    return out


def exported(data: bytes, order: str, sections: list) -> set[str]:
    """The names a library's dynamic symbol table defines."""
    names = set()
    for kind, off, size, link, entsize in sections:
        if kind != SHT_DYNSYM or entsize < 24 or link >= len(sections):
            continue
        _, str_off, str_size, _, _ = sections[link]
        strtab = data[str_off : str_off + str_size]
        for i in range(size // entsize):
            st_name, _, _, shndx, _, _ = struct.unpack_from(
                order + "IBBHQQ", data, off + i * entsize
            )
            end = strtab.find(b"\0", st_name)
            if shndx != 0 and 0 <= st_name < end:
                names.add(strtab[st_name:end].decode("utf-8", "replace"))
    return names


def problem(path, exports: Iterable[str] = (), prefix: bool = False) -> str | None:
    """Why the file at ``path`` cannot be mapped safely as the library wanted (None: it can).

    Args:
        path: the library. exports: names it must define.
        prefix: an export need only start with each name (MLX's clipped kernel names).
    """
    data = _read(Path(path))
    if isinstance(data, str):
        return data
    head = _header(data)
    if isinstance(head, str):
        return head
    order, phoff, shoff, phent, phnum, shent, shnum = head
    if not _segments_fit(data, order, phoff, phent, phnum):
        return f"cut short ({len(data)} bytes)"
    sections = _sections(data, order, shoff, shent, shnum)
    if sections is None:
        return f"cut short ({len(data)} bytes)"
    wanted = list(exports)
    if not wanted:
        return None
    names = exported(data, order, sections)
    missing = [w for w in wanted if not any(n == w or (prefix and n.startswith(w)) for n in names)]
    return f"it does not define {missing[0]}" if missing else None


def mlx_cache_dirs() -> list[Path]:
    """MLX's CPU compile caches, ``<temp>/mlx/<version>/cpu``, where the temp folder is the
    one MLX reads (the first of TMPDIR, TMP, TEMP, TEMPDIR set, else /tmp)."""
    root = Path(cachedir.cpp_tmpdir()) / "mlx"
    try:
        return sorted(d / "cpu" for d in root.iterdir() if (d / "cpu").is_dir())
    except OSError:
        return []


def _mlx_problem(lib: Path) -> str | None:
    kernel = lib.name[len("lib") : -len(".so")]
    clipped = len(kernel) > MLX_CLIP
    return problem(lib, [kernel[:MLX_CLIP] if clipped else kernel], prefix=clipped)


def _changed(folder: Path, since: int) -> list[Path]:
    """The libraries in folder whose ctime (ns) is ``since`` or later."""
    libs = []
    try:
        for entry in os.scandir(folder):
            lib = entry.name.startswith("lib") and entry.name.endswith(".so")
            if lib and entry.stat(follow_symlinks=False).st_ctime_ns >= since:
                libs.append(Path(entry.path))
    except OSError:
        return []
    return libs


def _damaged(libs: list[Path]) -> dict[Path, str]:
    found = {lib: _mlx_problem(lib) for lib in libs}
    return {lib: why for lib, why in found.items() if why is not None}


def _settled(damaged: dict[Path, str]) -> dict[Path, str]:
    """The damaged libraries that stay damaged once none is younger than SETTLE_S: a fresh
    one may be another process's compiler writing it (MLX compiles in place)."""
    try:
        youngest = max(lib.stat().st_mtime for lib in damaged)
    except (OSError, ValueError):
        youngest = 0.0
    wait = youngest + SETTLE_S - time.time()
    if wait <= 0:
        return damaged
    time.sleep(min(wait, SETTLE_S))
    again = {lib: _mlx_problem(lib) for lib in damaged if lib.exists()}
    return {lib: why for lib, why in again.items() if why is not None}


def _record() -> Path | None:
    # when each folder was last swept: only what changed since (its ctime) is read again
    return cachedir.cache_dir() / "cpu" / "mlx-cache-checked.json" if cachedir.enabled() else None


def sweep_mlx_cache(log: Callable[[str], None] | None = None) -> int:
    """Remove the libraries in MLX's CPU compile cache that would crash or fail its load
    (cut short, empty, not a library, or without the kernel their name promises), with one
    note. Only libraries changed since the last sweep are read. Returns how many went."""
    record_path = _record()
    record = (cachedir.read_json(record_path) if record_path else None) or {}
    # file times lag the clock by a tick: what changed just before now is read next time too
    start, removed, where, why, seen = time.time_ns() - cachedir.RACY_NS, 0, None, "", False
    for folder in mlx_cache_dirs():
        since = record.get(str(folder))
        libs = _changed(folder, since if type(since) is int else 0)
        damaged = _damaged(libs)
        failed = False
        for lib, reason in (_settled(damaged) if damaged else {}).items():
            try:
                os.unlink(lib)
            except OSError:
                failed = True  # still there: read it again next time
                continue
            removed, where, why = removed + 1, folder, reason
        if libs and not failed:
            record[str(folder)], seen = start, True
    if record_path is not None and seen:
        cachedir.write_json(record_path, record)
    if removed:
        what, it = (
            ("a damaged library", "it")
            if removed == 1
            else (f"{removed} damaged libraries", "them")
        )
        cachedir.note(
            f"removed {what} from MLX's compile cache {where} ({why}); MLX compiles {it} again", log
        )
    return removed
