"""Exact, vectorised SwiGLU and softmax, and a decode-width attention, for MLX's CPU backend
(Linux), built on first use.

MLX's Linux wheel evaluates ``exp`` one element at a time (each step of its polynomial a
call to libm's ``fmaf``, ~18 ns an element here), so the MLP's SiLU and the attention's
softmax cost a decode step ~1.4 ms per row: at 8 verify rows, ~12 ms of a ~75 ms forward.
``cpu/exact_ops.cpp`` holds two MLX primitives that run MLX's own algorithm in a loop the
compiler vectorises, every output with MLX's bits (checked exhaustively for ``exp``, and
against MLX's ops when loading), so a token's logits do not change by a bit.

A third primitive (``csrc/decode_attention.h``) is the attention of 1-16 query rows: it
reads a KV cache's sliced keys and values in place, each KV head once for all its query
heads, and sums in an order fixed by each row alone, so a verify row has the bits of the
same row in a plain step at any context length (MLX's graph, which prefills still take,
handed P @ V over more than 1,024 keys to OpenBLAS, whose bits for a row depend on the rows
beside it).

For the drafter's compiled step (``cpu/draft_step.py``) it also holds an RMSNorm with
``mx.fast.rms_norm``'s CPU bits (in-order sums, checked at load), one side of the two-tap conv
and the attention's softmax of powers of 2 (libm's ``powf`` as MLX calls it), each one graph
op where MLX's CPU backend took 3, ~11 and 5 (``csrc/draft_kernels.h``).

The extension is compiled once per source, compiler, CPU, MLX and nanobind version into the
cache folder (``g++ -O3 -march=native -ffp-contract=off -fopenmp``, ~10 s) and binds MLX's
arrays through nanobind's ``mlx`` domain. No compiler, no nanobind, a failed build or
self-check, another OS or ``DFLASH_EXACT_OPS=0``: :func:`silu_mul` and :func:`softmax` are
MLX's ops and :func:`attention` is mlx-lm's.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import mlx.core as mx
from mlx import nn

from .. import env
from . import builder

ENV = "DFLASH_EXACT_OPS"
MODULE = "_dflash_exact_ops"
FLAGS = ("-std=c++20", "-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno")
FLAGS += ("-fPIC", "-shared", "-fvisibility=hidden", "-fopenmp", "-DNB_DOMAIN=mlx")
HEADERS = ("exp_mlx.h", "decode_attention.h", "draft_kernels.h")  # included: part of its key

_state: dict = {"module": None, "error": None, "tried": False, "path": None}


def compiler() -> str | None:
    """The C++ compiler: ``$CXX``, else ``g++`` or ``c++`` on PATH."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _paths() -> dict:
    import nanobind

    nb = Path(nanobind.source_dir()).parent
    mlx_dir = Path(mx.__file__).resolve().parent  # mlx/core.*.so: the package folder
    return {
        "source": builder.source("exact_ops.cpp"),
        "includes": [
            nb / "include",
            nb / "ext" / "robin_map" / "include",
            Path(sysconfig.get_paths()["include"]),
            mlx_dir / "include",
        ],
        "nb_source": Path(nanobind.source_dir()) / "nb_combined.cpp",
        "mlx_lib": mlx_dir / "lib",
        "versions": f"{mx.__version__} {nanobind.__version__} {sys.version}",
    }


def build(out_dir: Path | None = None) -> Path:
    """Compile the extension (or find it already built) and return its path.

    Args:
        out_dir: where to put it; the cache folder (``cpu/``) by default, a fresh temporary
            folder when the caches are off.

    Raises:
        RuntimeError: no compiler, or it failed (its first error line is in the message).
        ImportError: nanobind is not installed.
    """
    cxx = compiler()
    if not cxx or shutil.which(cxx) is None:
        raise RuntimeError("no C++ compiler (g++); install g++ for the fast SiLU and softmax")
    p = _paths()
    parts = [p["source"].read_bytes(), *(builder.source(h).read_bytes() for h in HEADERS)]
    parts += [cxx.encode(), p["versions"].encode()]
    parts.append(" ".join(FLAGS).encode())
    name = MODULE + sysconfig.get_config_var("EXT_SUFFIX")
    lib = builder.output_path("exact_ops", name, parts, out_dir)
    cmd = [cxx, *FLAGS, *(f"-I{d}" for d in p["includes"]), str(p["source"]), str(p["nb_source"])]
    cmd += [f"-L{p['mlx_lib']}", "-lmlx", f"-Wl,-rpath,{p['mlx_lib']}", "-o", "{out}"]
    versions = {"compiler": cxx, "versions": p["versions"]}
    serial = [a for a in cmd if a != "-fopenmp"]  # a compiler without OpenMP: one thread
    exports = [f"PyInit_{MODULE}"]
    return builder.compile_once(lib, [cmd, serial], p["source"].name, exports, versions)


def _import(path: Path):
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _self_check(module) -> str | None:
    """Why the built kernels cannot stand in for MLX's ops here (None: they can)."""
    import numpy as np

    x = np.linspace(-90.0, 90.0, 1 << 16, dtype=np.float32)
    y = np.empty_like(x)
    module.exp_buffer(x.ctypes.data, y.ctypes.data, x.size)
    if not np.array_equal(y.view(np.uint32), np.array(mx.exp(mx.array(x))).view(np.uint32)):
        return "its exp differs from MLX's"
    g = mx.random.normal((3, 257), key=mx.random.key(7)) * 12.0
    g = mx.concatenate([g, mx.array([[0.0, -0.0, 88.5, -88.5, 1e-30] + [3.0] * 252])], 0)
    u = mx.random.normal(g.shape, key=mx.random.key(8))
    s = mx.concatenate([g, mx.full((4, 3), mx.finfo(mx.float32).min)], 1)
    with mx.stream(mx.cpu):
        if not mx.array_equal(module.silu_mul(g, u), mx.sigmoid(g) * g * u).item():
            return "its SiLU differs from MLX's"
        if not mx.array_equal(module.softmax(s), mx.softmax(s, axis=-1, precise=True)).item():
            return "its softmax differs from MLX's"
        q = mx.random.normal((1, 4, 3, 16), key=mx.random.key(9))
        k = mx.random.normal((1, 2, 40, 16), key=mx.random.key(10))
        want = mx.fast.scaled_dot_product_attention(q, k, -k, scale=0.25, mask="causal")
        if not mx.allclose(module.attention(q, k, -k, 0.25, True, None), want, 1e-5, 1e-6).item():
            return "its decode attention differs from MLX's"
    return None


def _rms_norm_agrees(module) -> bool:
    """Whether the kernel's RMSNorm gives ``mx.fast.rms_norm``'s bits here (rows of 64 and
    576 as the drafter normalises, an odd width, large and tiny values); if not, only the
    RMSNorm stays MLX's."""
    with mx.stream(mx.cpu):
        for i, shape in enumerate([(1, 8, 9, 64), (1, 10, 576), (3, 37), (40, 576)]):
            x = mx.random.normal(shape, key=mx.random.key(20 + i)) * 10.0 ** (i - 2)
            w = mx.random.normal(shape[-1:], key=mx.random.key(30 + i))
            for eps in (1e-6, 1e-5):
                if not mx.array_equal(module.rms_norm(x, w, eps), mx.fast.rms_norm(x, w, eps)):
                    return False
    return True


def load():
    """Build, import and check the extension once; returns it, or None (see :func:`status`)."""
    if _state["tried"]:
        return _state["module"]
    _state["tried"] = True
    if not env.switch(ENV):
        _state["error"], _state["off"] = f"turned off ({ENV}=0)", True
        return None
    if sys.platform != "linux":
        _state["error"] = "only built on Linux (MLX's exp is vectorised elsewhere)"
        return None
    try:
        path, module = builder.open_built(build, _import, "the exact ops")
        why = _self_check(module)
    except (ImportError, OSError, RuntimeError, subprocess.SubprocessError, TypeError) as e:
        _state["error"] = str(e).splitlines()[0] if str(e) else type(e).__name__
        return None
    if why:
        _state["error"] = f"not used: {why}"
        return None
    _state.update(module=module, path=str(path), rms_norm=_rms_norm_agrees(module))
    return module


def status() -> dict:
    """{"active": bool, "path": the built extension (or None), "error": why not (or None)}."""
    return {
        "active": _state["module"] is not None,
        "path": _state["path"],
        "error": _state["error"],
        "off": bool(_state.get("off")),  # turned off on purpose: not a failure
    }


def active() -> bool:
    """Whether the extension is loaded (call :func:`load` first)."""
    return _state["module"] is not None


def silu_mul(g: mx.array, u: mx.array) -> mx.array:
    """``silu(g) * u`` with MLX's bits: the kernel when loaded, else MLX's ops."""
    m = _state["module"]
    return m.silu_mul(g, u) if m is not None else mx.sigmoid(g) * g * u


def rms_norm(norm, x: mx.array) -> mx.array:
    """``norm(x)`` for an ``nn.RMSNorm`` with MLX's bits, one kernel instead of three ops
    (square, sum, the rest) on the CPU when loaded and checked (``_rms_norm_agrees``)."""
    m = _state["module"]
    if m is None or not _state.get("rms_norm") or type(norm) is not nn.RMSNorm:
        return norm(x)
    if not x.dtype == norm.weight.dtype == mx.float32:  # the kernel's one type
        return norm(x)
    return m.rms_norm(x, norm.weight, norm.eps)


def two_tap():
    """The kernel of one side of the two-tap conv over one block (``cpu/draft_step.py``'s
    ``_conv``, which checks it against its ops), or None when not loaded."""
    m = _state["module"]
    return None if m is None else m.two_tap


def pow2_softmax():
    """The kernel of the drafter's softmax of log2 scores (``cpu/draft_step.py`` checks it
    against ``fastmath.attention``'s ops), or None when not loaded."""
    m = _state["module"]
    return None if m is None else m.pow2_softmax


def softmax(x: mx.array) -> mx.array:
    """``mx.softmax(x, axis=-1, precise=True)`` with MLX's bits (kernel or MLX's op)."""
    m = _state["module"]
    return m.softmax(x) if m is not None else mx.softmax(x, axis=-1, precise=True)


def _sdpa_fits(queries, keys, values, cache, mask, sinks) -> bool:
    """Whether :func:`attention` may run its kernel: float32 on the CPU, no sinks, a plain
    (not quantized) cache, and no mask, the causal one or a mask array."""
    if _state["module"] is None or sinks is not None or hasattr(cache, "bits"):
        return False
    if isinstance(mask, str) and mask != "causal":
        return False
    f32 = queries.dtype == keys.dtype == values.dtype == mx.float32
    return f32 and queries.ndim == 4 and mx.default_device() == mx.cpu


def attention(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's ``scaled_dot_product_attention`` (``models/base.py``) for float32 on the CPU:
    1-16 query rows run the decode kernel (each row's bits its own, at any context length;
    MLX's result to float32 rounding), more rows MLX's fallback graph with the exact
    vectorised softmax (MLX's bits); anything else is mlx-lm's own function."""
    if not _sdpa_fits(queries, keys, values, cache, mask, sinks):
        from mlx_lm.models import base

        return base.scaled_dot_product_attention(
            queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks
        )
    causal = isinstance(mask, str)
    return _state["module"].attention(
        queries, keys, values, scale, causal, None if causal else mask
    )


def install_attention(layers) -> int:
    """Point the mlx-lm modules that define these layers' attention at :func:`attention`
    (only where they call ``base.scaled_dot_product_attention``; other models of those
    modules then run it too, e.g. mlx-lm's plain decoding of the same target). Returns how
    many modules were changed.

    Args:
        layers: decoder layers with a ``self_attn``.
    """
    if _state["module"] is None:
        return 0
    from mlx_lm.models import base

    n = 0
    for layer in layers:
        attn = getattr(getattr(layer, "inner", layer), "self_attn", None)
        mod = sys.modules.get(type(attn).__module__) if attn is not None else None
        if mod is not None and getattr(mod, "scaled_dot_product_attention", None) is (
            base.scaled_dot_product_attention
        ):
            mod.scaled_dot_product_attention = attention
            n += 1
    return n
