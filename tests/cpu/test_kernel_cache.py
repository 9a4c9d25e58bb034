"""The compiled libraries heal (issue 34): a cached kernel cut short, emptied, overwritten
with random bytes or with another library, or with a damaged manifest, is rebuilt with one
note before anything maps it; MLX's own compile cache is swept of such libraries; a
missing TMPDIR, or one that is a file, is replaced. Every load runs in a subprocess, where
a crash (the probe's "Bus error") shows as a signal.

Rebuilds are copies: a stand-in compiler copies a good build to its ``-o`` file, so a
case costs a Python start, not a compile.
"""

from __future__ import annotations

import _ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# the damage catalogue lives beside the cache tests of loading/
sys.path.insert(0, str(Path(__file__).parents[1] / "loading"))
from corruption import BYTES, JSON, damage, reseal

from dflash_mlx.cpu import exact_ops, sharedlib, small_gemm

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or small_gemm.compiler() is None,
    reason="the kernels are built on Linux with a C compiler",
)
FOREIGN = Path(_ctypes.__file__)  # a real shared library without our symbols
COPY_CC = """#!/bin/sh
out=
while [ $# -gt 0 ]; do [ "$1" = -o ] && out="$2"; shift; done
[ -n "$out" ] && cp "$GOOD" "$out"
exit 0
"""
SMALL_GEMM = """
import dflash_mlx
from dflash_mlx.cpu import small_gemm
print(small_gemm.status()["active"], small_gemm.status()["error"])
"""
EXACT_OPS = """
import dflash_mlx
from dflash_mlx.cpu import exact_ops
exact_ops.load()
print(exact_ops.status()["active"], exact_ops.status()["error"])
"""
JIT = """
import dflash_mlx
import mlx.core as mx
f = mx.compile(lambda x, y: mx.exp(x * y + 1.0) * 2.0)
print(f(mx.ones((64,)), mx.ones((64,)))[0].item())
"""


def _copying_compiler(folder: Path, name: str) -> Path:
    cc = folder / name
    cc.write_text(COPY_CC)
    cc.chmod(0o755)
    return cc


def _run(code: str, env: dict) -> tuple[str, list[str]]:
    """Run code; its stdout and its stderr lines, after checking it ended well."""
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    assert p.returncode == 0, f"exit {p.returncode} (a negative one is a signal): {p.stderr}"
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert all(ln.startswith("note: ") for ln in lines), p.stderr  # no traceback, no noise
    return p.stdout.strip(), lines


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """A cache folder with the few-row kernel built by the copying compiler, kept pristine,
    and what its runs need."""
    root = tmp_path_factory.mktemp("kernels")
    good = small_gemm.status()["path"] or small_gemm.build(root / "built")
    env = {**os.environ, "DFLASH_CACHE_DIR": str(root / "cache"), "GOOD": str(good)}
    env["CC"] = str(_copying_compiler(root, "cc"))
    assert _run(SMALL_GEMM, env) == ("True None", [])
    lib = next((root / "cache" / "cpu").glob("small_gemm-*/small_gemm.so"))
    shutil.copytree(lib.parent, root / "pristine")
    return {"env": env, "lib": lib, "pristine": root / "pristine"}


def _restore(folder: Path, pristine: Path) -> None:
    shutil.rmtree(folder)
    shutil.copytree(pristine, folder)


LIB_CASES = [*BYTES, "foreign", "foreign, manifest forged", "deleted"]
MANIFEST_CASES = [*BYTES, *JSON, "field:without files", "field:files is a string"]


@pytest.mark.parametrize("kind", LIB_CASES)
def test_a_damaged_kernel_is_rebuilt_before_it_is_mapped(kernel, kind):
    lib = kernel["lib"]
    _restore(lib.parent, kernel["pristine"])
    if kind == "deleted":
        lib.unlink()
    elif kind.startswith("foreign"):
        shutil.copyfile(FOREIGN, lib)
        if kind.endswith("forged"):  # only the symbol check is left to notice
            reseal(lib.parent, [lib.name])
    else:
        damage(lib, kind)
    out, notes = _run(SMALL_GEMM, kernel["env"])
    assert out == "True None" and len(notes) == 1, notes
    assert "damaged" in notes[0] and "rebuilding it" in notes[0], notes
    assert _run(SMALL_GEMM, kernel["env"]) == ("True None", [])  # healed: silent


@pytest.mark.parametrize("kind", MANIFEST_CASES)
def test_a_damaged_manifest_means_a_rebuild_with_one_note(kernel, kind):
    lib = kernel["lib"]
    _restore(lib.parent, kernel["pristine"])
    damage(lib.parent / "manifest.json", kind)
    out, notes = _run(SMALL_GEMM, kernel["env"])
    assert out == "True None" and len(notes) == 1, notes
    assert _run(SMALL_GEMM, kernel["env"]) == ("True None", [])


def test_an_unsealed_build_or_a_killed_builds_leftover_is_replaced_silently(kernel):
    lib = kernel["lib"]
    _restore(lib.parent, kernel["pristine"])
    (lib.parent / "manifest.json").unlink()  # killed between the rename and the seal
    leftover = lib.parent / f".tmp4194310-{lib.name}"  # a dead pid: pids stop at 2**22
    leftover.write_bytes(b"half a library")
    assert _run(SMALL_GEMM, kernel["env"]) == ("True None", [])
    assert not leftover.exists() and (lib.parent / "manifest.json").exists()


def test_the_probes_commands_survive_a_truncated_kernel(kernel):
    """The probe: ``truncate -s 5000`` the cached kernel, then ``dflash models``."""
    lib = kernel["lib"]
    _restore(lib.parent, kernel["pristine"])
    os.truncate(lib, 5000)
    p = subprocess.run(
        [sys.executable, "-m", "dflash_mlx.cli", "models"],
        capture_output=True, text=True, env=kernel["env"], check=False,
    )  # fmt: skip
    notes = [ln for ln in p.stderr.splitlines() if ln.startswith("note: ")]
    assert p.returncode == 0 and len(notes) == 1, p.stderr
    assert "Traceback" not in p.stderr


def test_caches_off_leave_no_build_folder_behind(kernel, tmp_path):
    env = {**kernel["env"], "DFLASH_CACHE": "0", "TMPDIR": str(tmp_path)}
    (tmp_path / "dflash-mlx-scratch-4194310-abc").mkdir()  # a killed run's
    assert _run(SMALL_GEMM, env) == ("True None", [])
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ the exact ops


@pytest.fixture(scope="module")
def extension(tmp_path_factory):
    if exact_ops.compiler() is None:
        pytest.skip("no C++ compiler")
    root = tmp_path_factory.mktemp("ext")
    good = exact_ops.build()  # this session's build (the first test to want it builds it)
    env = {**os.environ, "DFLASH_CACHE_DIR": str(root / "cache"), "GOOD": str(good)}
    env["CXX"] = str(_copying_compiler(root, "c++"))
    assert _run(EXACT_OPS, env) == ("True None", [])
    lib = next((root / "cache" / "cpu").glob("exact_ops-*/_dflash_exact_ops*"))
    shutil.copytree(lib.parent, root / "pristine")
    return {"env": env, "lib": lib, "pristine": root / "pristine"}


@pytest.mark.parametrize("kind", ["truncated-5000", "random", "foreign, manifest forged"])
def test_a_damaged_exact_ops_extension_is_rebuilt(extension, kind, kernel):
    lib = extension["lib"]
    _restore(lib.parent, extension["pristine"])
    if kind.startswith("foreign"):
        shutil.copyfile(kernel["lib"], lib)  # a library, but no Python module
        reseal(lib.parent, [lib.name])
    else:
        damage(lib, kind)
    out, notes = _run(EXACT_OPS, extension["env"])
    assert out == "True None" and len(notes) == 1, notes
    assert _run(EXACT_OPS, extension["env"]) == ("True None", [])


# ------------------------------------------------------------------ MLX's compile cache


@pytest.fixture(scope="module")
def mlx_cache(tmp_path_factory):
    """A private TMPDIR whose MLX compile cache holds one compiled function, and a g++ that
    copies it (MLX compiles with the g++ on PATH)."""
    root = tmp_path_factory.mktemp("jit")
    env = {**os.environ, "TMPDIR": str(root / "tmp"), "DFLASH_CACHE_DIR": str(root / "c")}
    (root / "tmp").mkdir()
    out, _ = _run(JIT, env)
    libs = list((root / "tmp" / "mlx").glob("*/cpu/lib*.so"))
    assert len(libs) == 1 and sharedlib.problem(libs[0]) is None
    shutil.copyfile(libs[0], root / "good.so")
    (root / "bin").mkdir()
    _copying_compiler(root / "bin", "g++")
    env |= {"GOOD": str(root / "good.so"), "PATH": f"{root / 'bin'}{os.pathsep}{env['PATH']}"}
    return {"env": env, "lib": libs[0], "good": root / "good.so", "value": out}


@pytest.mark.parametrize("kind", ["truncated-5000", "empty", "random", "foreign"])
def test_a_damaged_library_in_mlx_compile_cache_is_removed_before_mlx_loads_it(mlx_cache, kind):
    lib = mlx_cache["lib"]
    shutil.copyfile(mlx_cache["good"], lib)
    if kind == "foreign":  # MLX's dlsym would fail: "Failed to load compiled function"
        shutil.copyfile(FOREIGN, lib)
    else:
        damage(lib, kind)
    os.utime(lib, (1, 1))  # old: not a compile in progress elsewhere
    out, notes = _run(JIT, mlx_cache["env"])
    assert out == mlx_cache["value"] and len(notes) == 1, notes
    assert "MLX's compile cache" in notes[0]
    assert _run(JIT, mlx_cache["env"]) == (mlx_cache["value"], [])


def test_a_fresh_damaged_library_is_left_to_the_compiler_writing_it(
    mlx_cache, tmp_path, monkeypatch
):
    """MLX compiles in place: a library cut short a moment ago may be another process's
    g++ still writing it; the sweep waits for it to settle and keeps it once whole."""
    import threading

    folder = tmp_path / "mlx" / "0" / "cpu"
    folder.mkdir(parents=True)
    lib = folder / mlx_cache["lib"].name
    lib.write_bytes(mlx_cache["good"].read_bytes()[:5000])
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    done = threading.Timer(0.5, shutil.copyfile, (mlx_cache["good"], lib))
    done.start()
    try:
        assert sharedlib.sweep_mlx_cache(log=lambda s: None) == 0
    finally:
        done.join()
    assert sharedlib.problem(lib) is None


@pytest.mark.parametrize("how", ["missing", "a file", "empty", "TMP missing"])
def test_an_unusable_temp_folder_is_replaced_with_one_note(mlx_cache, tmp_path, how):
    env = {k: v for k, v in mlx_cache["env"].items() if k not in ("TMPDIR", "TMP")}
    bad = tmp_path / "nope"
    if how == "a file":
        bad.write_text("x")
    env["TMP" if how == "TMP missing" else "TMPDIR"] = "" if how == "empty" else str(bad)
    out, notes = _run(JIT, env)
    assert out == mlx_cache["value"] and len(notes) == 1, notes
    assert "is not a writable folder" in notes[0]
