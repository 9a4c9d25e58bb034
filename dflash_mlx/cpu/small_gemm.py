"""A few-row float32 matmul in front of MLX's BLAS (Linux), built on first use.

Decoding multiplies 1-16 rows by each weight (a plain step, a verify, the drafter). OpenBLAS
packs the whole weight for such an ``x @ W.T`` and reads it about three times: an
[8, 576] x [576, 49152] head costs ~26 ms where one pass over the weight takes ~9. The kernel
in ``cpu/small_gemm.c`` reads each weight row once for all rows and sums every dot product in
an order that depends only on K, so a token's logits are the same bits in a plain step and in
a verify. Loaded with RTLD_GLOBAL before MLX, its ``cblas_sgemm`` is the one MLX binds to;
it takes row-major ``A @ B^T`` products with at most :data:`MAX_ROWS` rows and small
``A @ B`` ones (attention's probabilities @ values), and hands every other call to the BLAS
behind it: the system OpenBLAS, or the wheel's reference BLAS when there is none (then it
also takes larger ``A @ B^T`` products, in :data:`MAX_ROWS`-row pieces). Handed-on
products under :data:`ONE_THREAD_MACS` multiply-adds run on one OpenBLAS thread: threaded,
its workers spin on after the call and take the cores the kernel's OpenMP team needs.

It is compiled once per source, compiler and CPU (``cc -O3 -march=native``, the CPU it runs
on) into the cache folder. No compiler, a failed build or ``DFLASH_SMALL_GEMM=0``: MLX uses
OpenBLAS directly, as before. Nothing here imports MLX.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

from .. import env
from . import builder

ENV = "DFLASH_SMALL_GEMM"
MAX_ROWS = 16  # decode widths (block <= 16); more rows (prefill) go to the BLAS behind it
ONE_THREAD_MACS = 1 << 21  # forwarded products smaller than this run on one OpenBLAS thread
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fopenmp")
SELECTOR_SOURCES = ("path_select.c",)  # built into the same library (select_host.py)
# what this module calls: a cached library without them is rebuilt before it is loaded
EXPORTS = ("cblas_sgemm", "dflash_small_gemm_init", "dflash_small_gemm_counter")
EXPORTS += ("dflash_small_gemm_half_calls", "dflash_small_gemm_set_split")
EXPORTS += ("dflash_small_gemm_set_one_thread", "dflash_small_gemm_set_rows")
EXPORTS += ("dflash_small_gemm_register", "dflash_small_gemm_use_halves")
EXPORTS += ("dflash_small_gemm_forward_library",)

_state: dict = {"path": None, "error": None, "lib": None, "split": False}


def source_path() -> Path:
    """``dflash_mlx/cpu/csrc/small_gemm.c``, the kernel's C source."""
    return builder.source("small_gemm.c")


def compiler() -> str | None:
    """The C compiler to build with: ``$CC``, else ``cc`` or ``gcc`` on PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(out_dir: Path | None = None) -> Path:
    """Compile the kernel library (or find it already built) and return its path.

    One shared library holds two kernels: the few-row matmul (``small_gemm.c``) and the
    host path selector (``path_select.c``, used by ``select_host.py``). When the selector's
    source does not build here the matmul is built alone, and the selector runs as MLX ops;
    without libgomp it is built without OpenMP (one thread).

    Args:
        out_dir: where to put it; the cache folder (``cpu/``) by default, a fresh temporary
            folder when the caches are off.

    Raises:
        RuntimeError: no compiler, or it failed (its error line is in the message).
    """
    cc = compiler()
    if not cc:
        raise RuntimeError("no C compiler (cc); install gcc for the fast few-row matmul")
    if shutil.which(cc) is None:
        raise RuntimeError(f"C compiler {cc} not found; install gcc or set CC")
    src = source_path()
    srcs = [src] + [p for p in [src.with_name(n) for n in SELECTOR_SOURCES] if p.is_file()]
    parts = [p.read_bytes() for p in srcs]
    parts += [
        cc.encode(),
        str(os.stat(shutil.which(cc)).st_size).encode(),
        " ".join(FLAGS).encode(),
    ]
    lib = builder.output_path("small_gemm", "small_gemm.so", parts, out_dir)
    commands = [
        [cc, *flags, "-o", "{out}", *map(str, files), "-ldl", "-lm"]
        for files in ((srcs, [src]) if len(srcs) > 1 else (srcs,))
        for flags in (FLAGS, FLAGS[:-1])
    ]
    return builder.compile_once(lib, commands, src.name, EXPORTS, {"compiler": cc})


def load(
    blas_path: str, max_rows: int = MAX_ROWS, split: bool = False, prefix: str = ""
) -> str | None:
    """Build and load the kernel in front of the BLAS at ``blas_path`` (before MLX loads).

    Args:
        blas_path: the BLAS to forward to: the system OpenBLAS, the scipy-openblas32
            wheel's, or MLX's reference BLAS; the kernel loads it and binds its
            ``cblas_sgemm``.
        max_rows: products with more rows than this go to that BLAS.
        split: instead, multiply ``A @ B^T`` products of more rows in ``max_rows``-row
            pieces (for the wheel's reference BLAS, which costs ~M one-row products).
        prefix: what the BLAS's symbol names start with (``scipy_`` for scipy-openblas32's
            ``scipy_cblas_sgemm``; MLX, bound to the kernel's ``cblas_sgemm``, never sees it).

    Returns:
        the kernel's path, or None (turned off, or it could not be built: see :func:`status`).
    """
    if _state["lib"] is not None:
        return _state["path"]
    if not env.switch(ENV):
        _state["error"], _state["off"] = f"turned off ({ENV}=0)", True
        return None
    try:
        path, lib = builder.open_built(build, _open, "the few-row kernel")
        rc = lib.dflash_small_gemm_init(blas_path.encode(), prefix.encode(), int(max_rows))
    except (OSError, RuntimeError, FileNotFoundError, subprocess.SubprocessError) as e:
        _state["error"] = str(e)
        return None
    if rc != 0:
        _state["error"] = f"could not bind {prefix}cblas_sgemm in {blas_path} (code {rc})"
        return None
    lib.dflash_small_gemm_counter.restype = ctypes.c_long
    lib.dflash_small_gemm_half_calls.restype = ctypes.c_long
    lib.dflash_small_gemm_forward_library.restype = ctypes.c_char_p
    lib.dflash_small_gemm_set_split(int(split))
    _state.update(path=str(path), lib=lib, error=None, split=bool(split), rows=int(max_rows))
    return str(path)


def _open(path: Path):
    # global scope: MLX, loaded next, binds its cblas_sgemm to this library's
    return ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)


def status() -> dict:
    """The loaded kernel: {"active", "path", "error", "split"}, the BLAS file the calls it
    does not take go to ("behind", found by the symbol's address, not timed) and, since
    loading, the calls it took and handed to that BLAS with the milliseconds spent
    ("small_calls", "small_ms", "forwarded_calls", "forwarded_ms")."""
    lib = _state["lib"]
    out = {"active": lib is not None, "path": _state["path"], "error": _state["error"]}
    behind = lib.dflash_small_gemm_forward_library() if lib is not None else None
    out["behind"] = os.path.realpath(behind.decode()) if behind else None
    out["off"] = bool(_state.get("off"))  # turned off on purpose: not a failure
    out["split"] = _state["split"]
    for fwd, name in ((0, "small"), (1, "forwarded")):
        out[f"{name}_calls"] = lib.dflash_small_gemm_counter(fwd, 0) if lib is not None else 0
        ns = lib.dflash_small_gemm_counter(fwd, 1) if lib is not None else 0
        out[f"{name}_ms"] = round(ns / 1e6, 3)
    return out


def set_one_thread(macs: int) -> int:
    """Run forwarded products of fewer than ``macs`` multiply-adds on one OpenBLAS thread
    (0: never; the default is ``ONE_THREAD_MACS``).

    Returns:
        OpenBLAS's own thread count, or 0 when the kernel is off or its BLAS (the wheel's)
        has no thread setting.
    """
    if _state["lib"] is None:
        return 0
    return int(_state["lib"].dflash_small_gemm_set_one_thread(ctypes.c_long(int(macs))))


def set_max_rows(rows: int) -> None:
    """Send products with more than ``rows`` rows to OpenBLAS (0: all of them)."""
    if _state["lib"] is not None:
        _state["lib"].dflash_small_gemm_set_rows(int(rows))
        _state["rows"] = int(rows)


def max_rows() -> int:
    """The most rows of an ``A @ B^T`` product the kernel takes itself (0: no kernel);
    up to there a row's bits do not depend on the rows multiplied with it."""
    return _state.get("rows", 0) if _state["lib"] is not None else 0


BF16, F16 = 1, 2  # kinds of 16-bit words (cpu/small_gemm.c)
_held: list = []  # (owner, view, words) of every registered weight, kept for the process
_registered: set = set()  # their buffers' addresses


def exact_words(a):
    """The 16-bit words [N, K] that hold a float32 array's values exactly, and their kind:
    bfloat16 (a bfloat16 checkpoint loaded as float32) or float16 (weights dequantized in
    float16); None when neither does, since rounding would change the products.

    Args:
        a: a C-contiguous float32 numpy array [N, K].

    Returns:
        (uint16 words [N, K], BF16 or F16), or None.
    """
    import numpy as np

    bits = a.view(np.uint32)
    if not np.any(bits & 0xFFFF):
        return (bits >> 16).astype(np.uint16), BF16
    h = a.astype(np.float16)
    if np.array_equal(h.astype(np.float32).view(np.uint32), bits):
        return h.view(np.uint16), F16
    return None


def register(owner, a) -> bool:
    """Let the kernel read the float32 weight ``a`` [N, K] as exact 16-bit words: its
    few-row products then read half the bytes and give the same bits.

    The kernel keys the words by ``a``'s buffer, so ``owner`` (the object that owns that
    buffer, e.g. an MLX array) and the words are kept alive for the rest of the process:
    the buffer is then never freed, reused or written while registered.

    Args:
        owner: what keeps ``a``'s memory alive. a: a C-contiguous float32 numpy view [N, K].

    Returns:
        whether it was registered (False: no kernel, not exact, or the table is full).
    """
    lib = _state["lib"]
    if lib is None or a.ndim != 2 or a.dtype.str != "<f4" or not a.flags.c_contiguous:
        return False
    if a.ctypes.data in _registered:
        return True
    found = exact_words(a)
    if found is None:
        return False
    words, kind = found
    p = ctypes.c_void_p
    n, k = a.shape
    if lib.dflash_small_gemm_register(p(a.ctypes.data), n, k, p(words.ctypes.data), kind):
        return False
    _held.append((owner, a, words))
    _registered.add(a.ctypes.data)
    return True


def use_halves(on: bool) -> None:
    """Read registered weights as their 16-bit words (default) or as float32 (A/B)."""
    if _state["lib"] is not None:
        _state["lib"].dflash_small_gemm_use_halves(int(bool(on)))


def has_kernel() -> bool:
    """Whether the kernel is loaded."""
    return _state["lib"] is not None


def function(name: str):
    """A function of the loaded kernel's library (e.g. the selector's), or None."""
    return None if _state["lib"] is None else getattr(_state["lib"], name, None)


def half_calls() -> int:
    """Products that read registered 16-bit words since loading."""
    lib = _state["lib"]
    return 0 if lib is None else int(lib.dflash_small_gemm_half_calls())
