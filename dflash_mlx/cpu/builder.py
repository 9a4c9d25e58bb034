"""Build a C/C++ source into the cache folder once, the one way every CPU kernel is built.

A build is keyed by its sources, compiler, flags, the CPU it runs on and whatever else the
caller names (versions it links against); a finished file is reused, a new one is compiled
to a temporary name and moved into place, so a killed build never leaves a half library.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ..loading import cachedir


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
        out_dir: the folder instead of the cache's (a fresh temporary one when caches are
            off).
    """
    key = hashlib.sha256(b"\n".join([*parts, cpu_flags().encode()])).hexdigest()[:16]
    if out_dir is None:
        on = cachedir.enabled()
        out_dir = cachedir.cache_dir() / "cpu" if on else Path(tempfile.mkdtemp())
    return Path(out_dir) / f"{stem}-{key}" / filename


def compile_once(lib: Path, commands: Sequence[Sequence[str]], what: str) -> Path:
    """Return ``lib``, compiling it first unless it exists: each command in turn (the
    first that succeeds wins), with ``{out}`` in a command standing for the output file.

    Args:
        lib: from :func:`output_path`. commands: compiler command lines, best first.
        what: what is built, for the error message.

    Raises:
        RuntimeError: every command failed (the compiler's first error line is in it).
    """
    if lib.is_file():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_name(f"{lib.name}.{os.getpid()}.tmp")
    proc = None
    for cmd in commands:
        argv = [str(tmp) if a == "{out}" else str(a) for a in cmd]
        proc = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=300)
        if proc.returncode == 0:
            os.replace(tmp, lib)
            return lib
    lines = (proc.stderr if proc else "").strip().splitlines() or ["(no output)"]
    first = next((ln for ln in lines if "error" in ln), lines[-1])
    raise RuntimeError(f"{commands[0][0]} could not build {what}: {first.strip()}")
