"""Run an ``mx.fast.metal_kernel`` body on the CPU by compiling it as C++ with g++.

``EmulatedKernel`` has the same constructor and call signature as ``mx.fast.metal_kernel``,
so the launch code in ``dflash_mlx.model.conv`` and ``dflash_mlx.model.selector`` can be pointed at it
unchanged. The generated function signature follows MLX's rules (inputs by dtype, ``const
constant T&`` for 0-d inputs, ``<name>_shape`` / ``_strides`` / ``_ndim`` and thread
attributes only when the source mentions them). The body is compiled against
``metal_shim.h`` and a generated driver runs it over the whole grid, threadgroup by
threadgroup; the threads of a group are cooperative fibers and ``threadgroup_barrier``
suspends each until the whole group has arrived. ``simd_sum`` is modelled on those fibers in
one documented order (``metal_shim.h``), our assumption of the hardware's. Every launch runs twice, with groups and
threads (between barriers) in forward and in reverse order; differing results mean the body
has a race (e.g. a missing barrier) and raise ``RaceDetected``.

As in MLX, what is compiled depends only on the body, the template arguments, the input
dtypes and address spaces, and which shape / stride / ndim parameters the body reads: the
shapes, strides, sizes, grid and threadgroup travel at run time (``meta.txt``), so one
build serves every shape, and ``builds`` counts the distinct compiled programs (what MLX
would compile as Metal libraries). Arrays travel through raw files: float dtypes as float32
(bf16 / fp16 values convert exactly), integers as their own 32-bit type. Outputs start poisoned (NaN / 0xDEADBEEF) like MLX's
uninitialised outputs, so unwritten elements show up.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

SHIM_DIR = Path(__file__).resolve().parent
CACHE_DIR = Path(tempfile.gettempdir()) / "dflash_metal_emu"

# dtype -> (Metal type string as MLX's get_type_string spells it, file dtype)
_TYPES = {
    mx.float32: ("float", np.float32),
    mx.float16: ("float16_t", np.float32),
    mx.bfloat16: ("bfloat16_t", np.float32),
    mx.int32: ("int32_t", np.int32),
    mx.uint32: ("uint32_t", np.uint32),
}
_ATTRIBUTES = [  # the uint3 attributes the driver supplies
    "thread_position_in_grid",
    "thread_position_in_threadgroup",
    "threadgroup_position_in_grid",
    "threads_per_threadgroup",
    "threadgroups_per_grid",
    "threads_per_grid",
]
_INDEX_ATTRIBUTES = {  # uint attributes: name -> value from the thread's index (32 lanes)
    "thread_index_in_threadgroup": "thread_index_in_threadgroup",
    "thread_index_in_simdgroup": "thread_index_in_threadgroup % 32",
    "simdgroup_index_in_threadgroup": "thread_index_in_threadgroup / 32",
}
_MODELLED = re.compile(r"\b(simd_sum|thread_index_in_simdgroup|simdgroup_index_in_threadgroup)\b")
_UNSUPPORTED = re.compile(r"simd_|simdgroup|quad_|atomic|texture")
_CONSTANT_LIMIT = 8  # MLX passes inputs with fewer elements in the constant address space


def compiler() -> str | None:
    """Path of a usable C++ compiler (``$CXX``, g++ or c++), or None."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


class RaceDetected(RuntimeError):
    """The kernel's output depends on the order in which its threads run."""


class EmulatedKernel:
    """Drop-in stand-in for ``mx.fast.metal_kernel`` that runs the body with g++.

    Args:
        name: kernel name. input_names, output_names: parameter names.
        source: the kernel body. header: code placed before the function.
        ensure_row_contiguous: accepted for signature compatibility (inputs are always
            materialised row-contiguous here, as MLX does with the default True).
        atomic_outputs: must be False (atomics are not modelled).
        count_reads: input names whose element reads are counted: after a call,
            ``reads[name]`` holds how often each element was read (forward order's run).
    """

    def __init__(
        self,
        name,
        input_names,
        output_names,
        source,
        header="",
        ensure_row_contiguous=True,
        atomic_outputs=False,
        compile_options=None,
        count_reads=(),
    ):
        code = _MODELLED.sub("", _strip_comments(source + header))
        if atomic_outputs or _UNSUPPORTED.search(code):
            raise NotImplementedError(
                "SIMD-group code other than simd_sum, atomics and textures are not emulated"
            )
        self.name, self.source, self.header = name, source, header
        self.input_names, self.output_names = list(input_names), list(output_names)
        self.calls = 0  # launches, for dispatch accounting in tests and benchmarks
        self.builds: set[str] = set()  # distinct compiled programs (MLX: Metal libraries)
        self.count_reads = tuple(count_reads)
        self.reads: dict[str, np.ndarray] = {}  # name -> reads per element, last call

    def __call__(
        self,
        inputs,
        output_shapes,
        output_dtypes,
        grid,
        threadgroup,
        template=None,
        init_value=None,
        verbose=False,
        stream=None,
    ):
        """Compile (cached by source hash) and run over the grid; returns mx arrays."""
        if init_value is not None:
            raise NotImplementedError("init_value is not emulated")
        self.calls += 1
        template = list(template or [])
        arrays = [mx.array(a) for a in inputs]
        code = self._driver(arrays, output_shapes, output_dtypes, template)
        exe = _build(code)
        self.builds.add(exe.name)
        meta = _meta(arrays, output_shapes, grid, threadgroup)
        with tempfile.TemporaryDirectory(prefix="metal_emu_") as tmp:
            Path(f"{tmp}/meta.txt").write_text(" ".join(map(str, meta)))
            for i, a in enumerate(arrays):
                _, ftype = _TYPES[a.dtype]
                np.asarray(a.astype(mx.float32) if ftype == np.float32 else a, dtype=ftype).tofile(
                    f"{tmp}/in{i}.bin"
                )
            runs = []
            for order in ("forward", "reverse"):
                res = subprocess.run(
                    [str(exe), tmp, order], capture_output=True, text=True, check=False
                )
                if res.returncode != 0:
                    raise RuntimeError(f"emulated kernel {self.name} failed: {res.stderr}")
                runs.append(
                    [
                        np.fromfile(f"{tmp}/out{i}.bin", dtype=_TYPES[dt][1])
                        for i, dt in enumerate(output_dtypes)
                    ]
                )
            for i, n in enumerate(self.input_names):
                if n in self.count_reads:
                    counts = np.fromfile(f"{tmp}/reads{i}.bin", dtype=np.uint32)
                    self.reads[n] = counts.reshape(arrays[i].shape)
            for i, (a, b) in enumerate(zip(*runs)):
                if a.tobytes() != b.tobytes():
                    raise RaceDetected(
                        f"{self.name}: output {self.output_names[i]} differs "
                        "between forward and reverse thread order"
                    )
            outs = [
                mx.array(raw.reshape(shape)).astype(dt)
                for raw, shape, dt in zip(runs[0], output_shapes, output_dtypes)
            ]
        return outs

    def _driver(self, arrays, output_shapes, output_dtypes, template):
        """C++ source: shim, header, templated function with MLX's signature, main(); every
        size, shape, stride, the grid and the threadgroup are read from ``meta.txt`` in the
        order ``_meta`` writes them."""
        src = self.source
        tparams, targs = [], []
        for tname, val in template:
            if isinstance(val, mx.Dtype):
                tparams.append(f"typename {tname}")
                targs.append(_TYPES[val][0])
            elif isinstance(val, bool):
                tparams.append(f"bool {tname}")
                targs.append("true" if val else "false")
            else:
                tparams.append(f"int {tname}")
                targs.append(str(int(val)))
        params, args, setup = [], [], []
        for i, (n, a) in enumerate(zip(self.input_names, arrays)):
            ctype, ftype = _TYPES[a.dtype]
            ftype_c = {np.float32: "float", np.int32: "int32_t", np.uint32: "uint32_t"}[ftype]
            space = "constant" if a.size < _CONSTANT_LIMIT else "device"
            setup.append(f"  auto in{i} = load<{ctype}, {ftype_c}>(dir, {i}, meta.next());")
            setup.append(f"  const int ndim_in{i} = int(meta.next());")
            if a.ndim == 0:
                params.append(f"const {space} {ctype}& {n}")
                args.append(f"in{i}[0]")
                continue
            if n in self.count_reads:
                setup.append(f"  std::vector<uint32_t> reads{i}(in{i}.size(), 0u);")
                params.append(f"emu::Counted<{ctype}> {n}")
                args.append(f"emu::Counted<{ctype}>{{in{i}.data(), reads{i}.data()}}")
            else:
                params.append(f"const {space} {ctype}* {n}")
                args.append(f"in{i}.data()")
            for suffix, ctype2 in (("shape", "int"), ("strides", "int64_t")):
                # always read (meta.txt holds both); passed only when the body uses it
                setup.append(f"  const auto {n}_{suffix}_v = meta.take<{ctype2}>(ndim_in{i});")
                if f"{n}_{suffix}" in src:
                    params.append(f"const constant {ctype2}* {n}_{suffix}")
                    args.append(f"{n}_{suffix}_v.data()")
            if f"{n}_ndim" in src:
                params.append(f"const constant int& {n}_ndim")
                args.append(f"ndim_in{i}")
        for i, (n, shape, dt) in enumerate(zip(self.output_names, output_shapes, output_dtypes)):
            ctype, ftype = _TYPES[dt]
            setup.append(f"  std::vector<{ctype}> out{i}(meta.next(), poison<{ctype}>());")
            params.append(f"device {ctype}* {n}")
            args.append(f"out{i}.data()")
        for attr in _ATTRIBUTES:
            if attr in src:
                params.append(f"uint3 {attr}")
                args.append(attr)
        for attr, value in _INDEX_ATTRIBUTES.items():
            if attr in src:
                params.append(f"uint {attr}")
                args.append(value)
        saves = [f"  save(dir, {i}, out{i});" for i in range(len(output_shapes))]
        saves += [
            f'  if (!reverse) save_raw(dir + "/reads{i}.bin", reads{i});'
            for i, n in enumerate(self.input_names)
            if n in self.count_reads
        ]
        tdecl = f"template <{', '.join(tparams)}>\n" if tparams else ""
        tuse = f"<{', '.join(targs)}>" if targs else ""
        return "\n".join(
            [
                '#include "emu_all.h"',
                self.header,
                tdecl + "void kernel_body(\n  " + ",\n  ".join(params) + ") {",
                src,
                "}",
                "int main(int argc, char** argv) {",
                "  const std::string dir = argv[1];",
                '  const bool reverse = argc > 2 && std::string(argv[2]) == "reverse";',
                "  emu::Meta meta(dir);",
                *setup,
                "  const uint3 launch_grid = meta.dims(), launch_group = meta.dims();",
                "  emu::launch(launch_grid, launch_group, reverse,",
                "    [&](uint3 thread_position_in_grid, uint3 thread_position_in_threadgroup,",
                "        uint3 threadgroup_position_in_grid, uint3 threads_per_threadgroup,",
                "        uint3 threadgroups_per_grid, uint3 threads_per_grid,",
                "        uint thread_index_in_threadgroup) {",
                f"      kernel_body{tuse}({', '.join(args)});",
                "    });",
                *saves,
                "  return 0;",
                "}",
            ]
        )


def _meta(arrays, output_shapes, grid, threadgroup) -> list[int]:
    """What a launch passes at run time, in the order the driver reads it: per input its
    size, ndim, shape and strides (row-contiguous); per output its size; the grid; the
    threadgroup (clipped to the grid, as MLX does)."""
    meta = []
    for a in arrays:
        strides = np.cumprod([1] + list(a.shape[::-1]))[:-1][::-1] if a.ndim else []
        meta += [a.size, a.ndim, *a.shape, *strides]
    meta += [int(np.prod(shape)) if len(shape) else 1 for shape in output_shapes]
    meta += [*grid, *(min(t, g) for t, g in zip(threadgroup, grid))]
    return [int(v) for v in meta]


def _strip_comments(code: str) -> str:
    """Source without // and /* */ comments (so a comment naming a feature is harmless)."""
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", code, flags=re.DOTALL)


_FLAGS = ["-std=c++17", "-O1", "-Wno-attributes", "-ffp-contract=off"]


def _prelude(cxx: str) -> Path:
    """Folder with shim + driver headers behind one ``emu_all.h`` and, when the compiler
    manages, its precompiled form (halves each kernel's compile time)."""
    text = {n: (SHIM_DIR / n).read_text() for n in ("metal_shim.h", "driver.h")}
    text["emu_all.h"] = '#include "metal_shim.h"\n#include "driver.h"\n'
    key = hashlib.sha256(("".join(text.values()) + cxx + " ".join(_FLAGS)).encode())
    folder = CACHE_DIR / f"prelude_{key.hexdigest()[:16]}"
    if not (folder / "emu_all.h").exists():
        tmp = Path(tempfile.mkdtemp(dir=CACHE_DIR))
        for name, body in text.items():
            (tmp / name).write_text(body)
        subprocess.run(
            [
                cxx,
                *_FLAGS,
                "-x",
                "c++-header",
                str(tmp / "emu_all.h"),
                "-o",
                str(tmp / "emu_all.h.gch"),
            ],
            capture_output=True,
            check=False,
        )
        try:
            os.replace(tmp, folder)
        except OSError:  # another process got there first
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _build(code: str) -> Path:
    """Compile a driver once per distinct source; returns the executable path."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (install g++)")
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    prelude = _prelude(cxx)
    key = hashlib.sha256((code + prelude.name).encode()).hexdigest()[:20]
    exe = CACHE_DIR / f"k_{key}"
    if exe.exists():
        return exe
    # per-process names: test workers (pytest -n) may build the same kernel at once
    cpp = CACHE_DIR / f"k_{key}.{os.getpid()}.cpp"
    cpp.write_text(code)
    tmp_exe = CACHE_DIR / f"k_{key}.{os.getpid()}.tmp"
    cmd = [cxx, *_FLAGS, "-I", str(prelude), str(cpp), "-o", str(tmp_exe)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"g++ failed on the kernel body:\n{res.stderr[-4000:]}")
    os.replace(tmp_exe, exe)
    cpp.unlink(missing_ok=True)
    return exe
