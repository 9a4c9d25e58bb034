"""Build a C/C++ source into the cache folder once, the one way every CPU kernel is built.

A build is keyed by its sources, compiler, flags, the CPU it runs on and whatever else the
caller names (versions it links against). It is compiled to a temporary name, checked,
renamed into place and sealed by a manifest (size, CRC-32, versions: ``cachedir``), so a
killed build never leaves a half library. Before a cached build is used its manifest and
its ELF headers are checked (``sharedlib``), without mapping it: one cut short, replaced or
without its symbols is rebuilt with one note instead of crashing every run.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from ..loading import cachedir
from . import sharedlib

T = TypeVar("T")
LAYOUT = b"sealed-1"  # builds sealed by a manifest: older unsealed ones are not reused


def source(name: str) -> Path:
    """A C/C++ source shipped as package data (``dflash_mlx/cpu/csrc/<name>``).

    Raises:
        FileNotFoundError: the installation lacks it.
    """
    src = Path(__file__).resolve().parent / "csrc" / name
    if not src.is_file():
        raise FileNotFoundError(f"no {src}; reinstall dflash-mlx")
    return src


def cpu_flags() -> str:
    """The CPU's feature flags (Linux), or its machine name: a build made for one CPU's
    instructions (``-march=native``) is never loaded on another."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine


def output_path(stem: str, filename: str, parts: Sequence[bytes], out_dir=None) -> Path:
    """Where the build of these inputs lives: ``<cache>/cpu/<stem>-<key>/<filename>``.

    Args:
        stem: the kernel's name. filename: the built file's name. parts: everything the
            build depends on besides the CPU (sources, compiler, flags, versions).
        out_dir: the folder instead of the cache's (this process's scratch folder, removed
            at exit, when caches are off).
    """
    key = hashlib.sha256(b"\n".join([*parts, LAYOUT, cpu_flags().encode()])).hexdigest()[:16]
    if out_dir is None:
        on = cachedir.enabled()
        out_dir = cachedir.cache_dir() / "cpu" if on else cachedir.scratch_dir()
    folder = Path(out_dir) / f"{stem}-{key}"
    cachedir.sweep_temps(folder)  # what a killed build left
    return folder / filename


def problem(lib: Path, exports: Sequence[str], versions: Mapping[str, str]) -> str | None:
    """Why the cached build ``lib`` cannot be loaded (None: its manifest checks out and its
    headers say it is whole and defines ``exports``); read, never mapped."""
    why = cachedir.check(lib.parent, [lib.name], versions)
    return why if why is not None else sharedlib.problem(lib, exports)


def _compile(tmp: Path, commands: Sequence[Sequence[str]], what: str, exports) -> None:
    proc = None
    for cmd in commands:
        argv = [str(tmp) if a == "{out}" else str(a) for a in cmd]
        proc = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=300)
        if proc.returncode == 0:
            why = sharedlib.problem(tmp, exports)
            if why is None:
                return
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"{cmd[0]} built a broken {what} ({why})")
    tmp.unlink(missing_ok=True)
    lines = (proc.stderr if proc else "").strip().splitlines() or ["(no output)"]
    first = next((ln for ln in lines if "error" in ln), lines[-1])
    raise RuntimeError(f"{commands[0][0]} could not build {what}: {first.strip()}")


def compile_once(
    lib: Path,
    commands: Sequence[Sequence[str]],
    what: str,
    exports: Sequence[str] = (),
    versions: Mapping[str, str] | None = None,
) -> Path:
    """Return ``lib``, compiling it first unless a sealed, whole build is there: each
    command in turn (the first that succeeds wins), with ``{out}`` in a command standing
    for the output file. A damaged build is rebuilt, with one note.

    Args:
        lib: from :func:`output_path`. commands: compiler command lines, best first.
        what: what is built, for messages. exports: names the library must define.
        versions: what it is built against, kept in its manifest.

    Raises:
        RuntimeError: every command failed (the compiler's first error line is in it).
    """
    folder = lib.parent
    versions = {"build": folder.name, **(versions or {})}
    if cachedir.sealed(folder):
        why = problem(lib, exports, versions)
        if why is None:
            return lib
        cachedir.note(f"the cached build of {what} in {folder} is damaged ({why}); rebuilding it")
    folder.mkdir(parents=True, exist_ok=True)
    tmp = cachedir.temp_name(lib)
    _compile(tmp, commands, what, exports)
    cachedir.unseal(folder)  # never the old seal on the new file
    os.replace(tmp, lib)
    cachedir.seal(folder, [lib.name], versions)
    return lib


def open_built(build: Callable[[], Path], open_: Callable[[Path], T], what: str):
    """Build (or find) a library and open it; one that fails to open is removed, with one
    note, and built and opened once more.

    Args:
        build: returns the library's path (e.g. ``small_gemm.build``). open_: loads it.
        what: what it is, for the note.

    Returns:
        (path, what ``open_`` returned).

    Raises:
        whatever ``build`` raises, or ``open_`` the second time.
    """
    path = build()
    try:
        return path, open_(path)
    except (OSError, ImportError, AttributeError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]
        cachedir.note(f"the cached build of {what} {path} failed to load ({first}); rebuilding it")
        cachedir.discard(path.parent)
    path = build()
    return path, open_(path)
