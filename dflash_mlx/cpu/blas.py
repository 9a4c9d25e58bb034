"""A fast BLAS for MLX's CPU backend on Linux, loaded before MLX is imported.

MLX's Linux wheel bundles the reference BLAS, with which a forward of 8 tokens costs about
8x one token, so speculation cannot pay. Loading the system OpenBLAS (Debian's
``libopenblas0-pthread``) into the global symbol scope before ``mlx.core`` is imported makes
MLX's ``cblas_sgemm`` calls resolve to it: about 9x faster, no LD_PRELOAD, no re-exec.
``OPENBLAS_CORETYPE`` is never set (forcing SkylakeX crashes CPUs without AVX-512).

In front of whichever BLAS MLX gets, the few-row kernel (``small_gemm.py``) is loaded
first, so decoding's 1-16-row matmuls are its own and every other call goes to that BLAS.

Without a system OpenBLAS, the OpenBLAS of PyPI's ``scipy-openblas32`` wheel (a dependency
on Linux; DYNAMIC_ARCH, its symbols prefixed ``scipy_``) takes the calls the kernel hands
on: MLX still binds the kernel's ``cblas_sgemm``, which forwards to ``scipy_cblas_sgemm``.
Only when neither is there does the wheel's reference BLAS remain.

``DFLASH_SYSTEM_BLAS=0`` turns the system OpenBLAS loading off, ``DFLASH_SCIPY_OPENBLAS=0``
the wheel's. Nothing here imports MLX except :func:`measure`, which reports the BLAS
actually in use by timing a matmul.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import sys
import time
from pathlib import Path

from .. import env

ENV = "DFLASH_SYSTEM_BLAS"
WHEEL_ENV = "DFLASH_SCIPY_OPENBLAS"
WHEEL_PREFIX = "scipy_"  # scipy-openblas32's symbols: scipy_cblas_sgemm, ...
CANDIDATES = (
    "/usr/lib/{arch}-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/{arch}-linux-gnu/libopenblas.so.0",
    "/usr/lib/{arch}-linux-gnu/openblas-openmp/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
    "/usr/local/lib/libopenblas.so.0",
)
# The reference BLAS computes an [8, K] x [K, N] product row by row (~8x one row); a real
# BLAS reads the weights once (~1.5x). A ratio under this marks a fast BLAS, on any CPU.
FAST_RATIO = 4.0

# path: the OpenBLAS loaded; kind: "system" or "scipy-openblas32" (None: the reference BLAS)
_loaded: dict = {"path": None, "kind": None, "error": None, "tried": False}


def _arch() -> str:
    machine = os.uname().machine
    return {"arm64": "aarch64"}.get(machine, machine)


def candidates() -> list[str]:
    """Paths where a system OpenBLAS usually lives, most specific first."""
    out = [c.format(arch=_arch()) for c in CANDIDATES]
    found = ctypes.util.find_library("openblas")
    if found:
        out.append(found)
    return out


def load_system_blas() -> str | None:
    """Load the first system OpenBLAS found with RTLD_GLOBAL (Linux only, once), with the
    few-row kernel in front of it; without one, the kernel in front of scipy-openblas32's
    OpenBLAS, else of the wheel's reference BLAS.

    Returns:
        the OpenBLAS loaded, or None (not Linux, turned off, none installed, or MLX was
        imported first and already bound its BLAS).
    """
    if _loaded["tried"]:
        return _loaded["path"]
    _loaded["tried"] = True
    if not sys.platform.startswith("linux"):
        return None
    from . import small_gemm

    path = _load_system(small_gemm) if env.switch(ENV) else None
    if path is None and env.switch(WHEEL_ENV):
        path = _load_wheel_openblas(small_gemm)
    if path is None:
        _front_bundled_blas(small_gemm)
    return path


def _load_system(small_gemm) -> str | None:
    for path in candidates():
        if path.startswith("/") and not Path(path).exists():
            continue
        try:
            ctypes.CDLL(path)  # loadable? (local scope: the few-row kernel must come first)
        except OSError as e:
            _loaded["error"] = f"{path}: {e}"
            continue
        small_gemm.load(path)
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        _loaded.update(path=path, kind="system")
        return path
    return None


def wheel_openblas() -> str | None:
    """The OpenBLAS of the ``scipy-openblas32`` wheel (``scipy_openblas32/lib/``), found
    without importing it; None when the wheel is not installed."""
    spec = importlib.util.find_spec("scipy_openblas32")
    for d in (spec.submodule_search_locations or []) if spec else []:
        found = sorted((Path(d) / "lib").glob("libscipy_openblas*.so*"))
        if found:
            return str(found[0])
    return None


def _load_wheel_openblas(small_gemm) -> str | None:
    """The few-row kernel in front of scipy-openblas32's OpenBLAS, on one thread unless
    ``OPENBLAS_NUM_THREADS`` says otherwise. MLX never sees its prefixed symbols, so without the kernel (no compiler, ``DFLASH_SMALL_GEMM=0``) it
    cannot serve and None is returned."""
    path = wheel_openblas()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        _loaded["error"] = f"{path}: {e}"
        return None
    if not os.environ.get("OPENBLAS_NUM_THREADS"):
        # One thread unless asked: this build's threaded sgemm ran 4-10x slower than one
        # thread on a busy 2-core machine (docs/linux-cpu.md); read by the kernel's init.
        getattr(lib, WHEEL_PREFIX + "openblas_set_num_threads")(1)
    if small_gemm.load(path, prefix=WHEEL_PREFIX) is None:
        _loaded["error"] = f"{path}: no few-row kernel to call it ({small_gemm.status()['error']})"
        return None
    _loaded.update(path=path, kind="scipy-openblas32")
    return path


def loaded_path() -> str | None:
    """The OpenBLAS (system or scipy-openblas32) loaded by :func:`load_system_blas`, or None."""
    return _loaded["path"]


def in_use() -> str:
    """Which BLAS MLX's large matmuls reach, in words (``dflash doctor``), from what was
    loaded (not timed: :func:`measure` times it)."""
    if sys.platform == "darwin":
        return "Accelerate"
    if _loaded["kind"] == "system":
        return f"system OpenBLAS ({_loaded['path']})"
    if _loaded["kind"]:
        return f"OpenBLAS of the scipy-openblas32 wheel ({_loaded['path']})"
    return "reference BLAS bundled with MLX (slow prefill: pip install scipy-openblas32)"


def bundled_blas() -> str | None:
    """The reference BLAS the ``mlx[cpu]`` wheel ships (``mlx_cpu.libs/libblas-*.so*``),
    found without importing MLX; None when absent."""
    spec = importlib.util.find_spec("mlx")
    for d in (spec.submodule_search_locations or []) if spec else []:
        found = sorted((Path(d).parent / "mlx_cpu.libs").glob("libblas*.so*"))
        if found:
            return str(found[0])
    return None


def _front_bundled_blas(small_gemm) -> None:
    """Without OpenBLAS the few-row kernel still takes decoding's matmuls (the reference
    BLAS costs ~M single-row products for M rows), larger ``A @ B^T`` products in pieces
    of 16 rows (the drafter's context projection, prefill), and hands the rest to the
    wheel's BLAS."""
    path = bundled_blas()
    if path:  # its M-row products cost ~M one-row ones: the kernel takes them in pieces
        small_gemm.load(path, split=True)


def _kernel_calls(status: dict) -> int:
    return status["small_calls"] + status["forwarded_calls"]


def _fast_by_facts(status: dict, calls_before: int) -> bool | None:
    """With the few-row kernel in front (``status``: ``small_gemm.status()``) and MLX's
    matmuls seen reaching it, the BLAS behind it is known by address: fast unless it is the
    wheel's reference BLAS. None otherwise (then only the clock can tell)."""
    s = status
    if not s["active"] or _kernel_calls(s) <= calls_before or not s["behind"]:
        return None
    ref = bundled_blas()
    return not (ref and os.path.realpath(ref) == s["behind"])


def _median_ms(fn, repeats: int, best: bool = False) -> float:
    import mlx.core as mx

    mx.eval(fn())
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return (min(times) if best else sorted(times)[len(times) // 2]) * 1e3


def measure(repeats: int = 5) -> dict:
    """Time float32 matmuls on MLX's CPU backend to tell which BLAS is really in use.

    Returns:
        {"name", "matmul_ms" (an [8, 1024] x [1024, 4096] product), "ratio" (its time over
        one row's), "fast" (from the BLAS the few-row kernel forwards to where it is in
        front, else from the ratio), "library", "small_gemm" (the few-row kernel's path or None),
        "exact_ops" (the exact SiLU/softmax extension's path, once a target loaded it)}.
    """
    import mlx.core as mx

    from . import exact_ops, small_gemm

    w = mx.random.normal((1024, 4096))
    a8, a1 = mx.random.normal((8, 1024)), mx.random.normal((1, 1024))
    calls = _kernel_calls(small_gemm.status())
    with mx.stream(mx.cpu):
        # the fastest of each: on a busy machine a median can catch the other's stalls
        ms8 = _median_ms(lambda: a8 @ w, repeats, best=True)
        ms1 = _median_ms(lambda: a1 @ w, repeats, best=True)
        mx.eval(mx.random.normal((64, 1024)) @ w)  # more rows than the kernel takes
    ratio = ms8 / max(ms1, 1e-6)
    status = small_gemm.status()
    fast = _fast_by_facts(status, calls)
    fast = ratio < FAST_RATIO if fast is None else fast
    path, kernel = _loaded["path"], status["path"]
    if sys.platform == "darwin":
        name = "Accelerate"
    elif fast and _loaded["kind"] == "scipy-openblas32":
        name = f"OpenBLAS of scipy-openblas32 ({path})"
    elif fast:
        name = f"OpenBLAS ({path})" if path else "fast BLAS (loaded outside dflash)"
    elif path:
        name = f"reference BLAS (mlx wheel): {path} was loaded after mlx; import dflash_mlx first"
    else:
        name = "reference BLAS (mlx wheel); pip install scipy-openblas32 (or libopenblas0-pthread) for ~9x faster matmuls"
    if kernel:
        name += " + dflash few-row kernel"
    if exact_ops.active():
        name += " + exact SiLU/softmax"
    return {
        "name": name,
        "matmul_ms": round(ms8, 2),
        "ratio": round(ratio, 2),
        "fast": fast,
        "library": path,
        "small_gemm": kernel,
        "behind": status["behind"],
        "exact_ops": exact_ops.status()["path"],
    }
