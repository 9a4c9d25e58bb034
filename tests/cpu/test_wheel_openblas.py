"""Without a system OpenBLAS, the few-row kernel forwards MLX's large products to the
OpenBLAS of the scipy-openblas32 wheel (its symbols prefixed ``scipy_``); the doctor names
the BLAS in use. Each case runs in a fresh process: the BLAS is chosen before MLX loads."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_mlx.cpu import blas, small_gemm

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or small_gemm.compiler() is None,
    reason="the kernel is built on Linux with a C compiler (macOS uses Accelerate)",
)
ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, tmp_path, **switches) -> str:
    env = dict(os.environ, DFLASH_CACHE_DIR=str(tmp_path), **switches)
    cmd = [sys.executable, "-c", code]
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


def test_the_linux_dependencies_carry_the_wheels_openblas():
    """The README's one `pip install` brings the fast BLAS on Linux (and only there)."""
    project = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[0]
    assert "\"scipy-openblas32; sys_platform == 'linux'\"," in project
    assert blas.wheel_openblas() is not None, "scipy-openblas32 is a dependency: install it"


def test_without_system_openblas_the_wheels_openblas_takes_the_large_products(tmp_path):
    """DFLASH_SYSTEM_BLAS=0: a 40-row A @ B^T and a large A @ B go to scipy_cblas_sgemm
    (forwarded, not split into 16-row pieces), a 3-row one stays the kernel's; all equal
    numpy's; the timed BLAS is fast and named."""
    code = (
        "import numpy as np, dflash_mlx\n"
        "from dflash_mlx.cpu import blas, small_gemm\n"
        "import mlx.core as mx\n"
        "assert blas._loaded['kind'] == 'scipy-openblas32', blas._loaded\n"
        "assert 'scipy_openblas32' in blas.loaded_path()\n"
        "assert not small_gemm.status()['split']\n"
        "rng = np.random.default_rng(0)\n"
        "w = rng.standard_normal((300, 64)).astype(np.float32)\n"
        "for rows, small, fwd in ((3, 1, 0), (40, 0, 1)):\n"
        "    x = rng.standard_normal((rows, 64)).astype(np.float32)\n"
        "    s0 = small_gemm.status()\n"
        "    y = np.array(mx.array(x) @ mx.array(w).T)\n"
        "    s1 = small_gemm.status()\n"
        "    assert np.allclose(y, x @ w.T, atol=1e-4), rows\n"
        "    assert s1['small_calls'] - s0['small_calls'] == small, (rows, s0, s1)\n"
        "    assert s1['forwarded_calls'] - s0['forwarded_calls'] == fwd, (rows, s0, s1)\n"
        "b = rng.standard_normal((64, 2000)).astype(np.float32)\n"
        "s0 = small_gemm.status()\n"
        "z = np.array(mx.array(x) @ mx.array(b))\n"
        "assert np.allclose(z, x @ b, atol=1e-3)\n"
        "assert small_gemm.status()['forwarded_calls'] == s0['forwarded_calls'] + 1\n"
        "assert small_gemm.set_one_thread(small_gemm.ONE_THREAD_MACS) == 1  # one thread\n"
        "m = blas.measure(repeats=1)\n"
        "assert m['fast'] and 'scipy-openblas32' in m['name'], m\n"
        "print(blas.in_use())\n"
    )
    out = _run(
        code, tmp_path, DFLASH_SYSTEM_BLAS="0", DFLASH_SCIPY_OPENBLAS="1", OPENBLAS_NUM_THREADS=""
    )
    assert out.startswith("OpenBLAS of the scipy-openblas32 wheel"), out


def test_the_wheels_openblas_takes_the_threads_asked_for(tmp_path):
    """One thread by default (its threaded sgemm collapsed on a busy machine);
    OPENBLAS_NUM_THREADS=2 gives it two."""
    code = (
        "import dflash_mlx\n"
        "from dflash_mlx.cpu import small_gemm\n"
        "print(small_gemm.set_one_thread(small_gemm.ONE_THREAD_MACS))\n"
    )
    switches = {"DFLASH_SYSTEM_BLAS": "0", "DFLASH_SCIPY_OPENBLAS": "1"}
    out = _run(code, tmp_path, OPENBLAS_NUM_THREADS="2", **switches)
    assert out.strip() == "2", out


def test_without_the_kernel_the_wheels_openblas_cannot_serve(tmp_path):
    """MLX binds only plain ``cblas_sgemm``: with the few-row kernel off, the prefixed
    OpenBLAS is left out (with its reason) and the reference BLAS is named as in use."""
    code = (
        "import dflash_mlx\n"
        "from dflash_mlx.cpu import blas\n"
        "assert blas.loaded_path() is None, blas._loaded\n"
        "assert 'no few-row kernel' in blas._loaded['error'], blas._loaded\n"
        "print(blas.in_use())\n"
    )
    switches = {"DFLASH_SYSTEM_BLAS": "0", "DFLASH_SCIPY_OPENBLAS": "1"}
    out = _run(code, tmp_path, DFLASH_SMALL_GEMM="0", **switches)
    assert out.startswith("reference BLAS bundled with MLX"), out


def test_the_wheels_openblas_is_found_in_its_package_folder(monkeypatch, tmp_path):
    lib = tmp_path / "scipy_openblas32" / "lib"
    lib.mkdir(parents=True)
    (lib / "libscipy_openblas.so").write_bytes(b"")
    spec = type("Spec", (), {"submodule_search_locations": [str(lib.parent)]})()
    monkeypatch.setattr(blas.importlib.util, "find_spec", lambda name: spec)
    assert blas.wheel_openblas() == str(lib / "libscipy_openblas.so")
    monkeypatch.setattr(blas.importlib.util, "find_spec", lambda name: None)
    assert blas.wheel_openblas() is None


def test_doctor_names_the_blas_in_use():
    from dflash_mlx import doctor

    check = doctor.cpu_backend()
    assert check.value.startswith(f"BLAS: {blas.in_use()}"), check.value
