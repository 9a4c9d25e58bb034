"""``dflash doctor``'s checks: what this install runs on and whether it decodes losslessly.

Each check returns one ``Check`` (a name, a one-line value, ok or not). The lines: device and
chip, memory budget, versions, the Linux CPU backend's BLAS and kernels (``cpu.status()``),
the Metal kernels against their MLX twins (Mac), a 16-token greedy parity check of DFlash
against plain decoding on a tiny random pair (``tiny_pair``), and the cache folders. A check
that raises becomes a failing line naming the error; nothing here needs the network.
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

PARITY_TOKENS = 16
PARITY_PROMPT = [5, 17, 42, 8, 99, 3, 77, 12]
TIE_GAP = 1e-4  # logits this close (relative to the largest) are a floating-point near-tie
ORDER = ("device", "memory", "versions", "cpu backend", "metal kernels", "parity", "caches")


@dataclass
class Check:
    """One line of the report.

    Attributes:
        name: what was checked. value: the finding, one line. ok: False fails the doctor.
    """

    name: str
    value: str
    ok: bool = True


def _first_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:200]


def _guarded(name: str, check: Callable[[], Check]) -> Check:
    try:
        return check()
    except Exception as e:  # noqa: BLE001 - a broken check is a failing line, not a crash
        return Check(name, f"check failed ({_first_line(e)})", ok=False)


def _is_mac() -> bool:
    return sys.platform == "darwin"


def _metal_info() -> dict:
    import mlx.core as mx

    if not mx.metal.is_available():
        return {}
    return dict(mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info())


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device() -> Check:
    """The default MLX device and the chip behind it."""
    import mlx.core as mx

    info = _metal_info()
    chip = info.get("device_name") or info.get("architecture") or _cpu_model()
    return Check("device", f"{mx.default_device()} on {chip} ({os.cpu_count()} CPU cores)")


def memory() -> Check:
    """The bytes a pair may use (``loading.memory.device_budget``), else what the OS says."""
    try:
        from .loading.memory import device_budget

        size, where = device_budget()
    except ImportError:
        size, where = _meminfo(), "MemAvailable"
    if not size:
        return Check("memory", "unknown (the budget could not be measured)")
    return Check("memory", f"{size / 1e9:.1f} GB ({where})")


def _meminfo() -> int:
    size = int(_metal_info().get("memory_size", 0))
    if size or not os.path.exists("/proc/meminfo"):
        return size
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _os_name() -> str:
    if _is_mac():
        return f"macOS {platform.mac_ver()[0]} ({platform.machine()})"
    try:
        distro = platform.freedesktop_os_release().get("PRETTY_NAME", "")
    except (OSError, AttributeError):
        distro = ""
    name = f"{platform.system()} {platform.release()} ({platform.machine()})"
    return f"{name}, {distro}" if distro else name


def versions() -> Check:
    """dflash-mlx, MLX, mlx-lm, Python and the operating system."""
    from importlib.metadata import PackageNotFoundError, version

    import mlx.core as mx

    from . import __version__

    try:
        lm = version("mlx-lm")
    except PackageNotFoundError:
        lm = "missing"
    py = platform.python_version()
    text = f"dflash-mlx {__version__}, MLX {mx.__version__}, mlx-lm {lm}, Python {py}"
    return Check("versions", f"{text}, {_os_name()}", ok=lm != "missing")


def cpu_backend() -> Check:
    """The Linux CPU backend: the BLAS in use, whether the few-row and exact kernels built."""
    from . import ops
    from .loading import backend

    if not backend.install():
        why = "DFLASH_CPU=0" if sys.platform.startswith("linux") else "not Linux"
        return Check("cpu backend", f"not applicable ({why}: plain MLX)")
    st = ops.backend_status()
    parts, ok = [f"BLAS: {st.get('blas_in_use') or st['blas'] or 'bundled with MLX'}"], True
    for key, label in (("small_gemm", "few-row kernel"), ("exact_ops", "exact ops")):
        part = st[key]
        if part.get("off"):  # a documented switch, not a failure
            parts.append(f"{label} off ({part['error'] or 'turned off'})")
        elif part.get("error"):
            parts.append(f"{label} failed ({part['error']})")
            ok = False
        else:
            parts.append(f"{label} {'built' if part.get('active') else 'off'}")
    parts.append(f"host selector {'on' if st['host_select'] else 'off'}")
    return Check("cpu backend", ", ".join(parts), ok)


def metal_kernels() -> Check:
    """Each Metal kernel built and equal to its MLX twin on small inputs (Mac)."""
    from .model import conv, metal_kernel, qmm, qmm_choice, selector

    if not metal_kernel.use_metal():
        if _is_mac() and _metal_info():
            return Check(
                "metal kernels",
                f"off ({metal_kernel.REFERENCE_ENV}: the MLX twins); "
                f"{qmm.ROWS_LINE}: not checked (the twins run)",
            )
        return Check(
            "metal kernels",
            "not applicable (no Metal GPU: the MLX twins run; the few-row quantized matmul's "
            f"body is checked in the tests' emulator only); {qmm.ROWS_LINE}: the check "
            "needs a Mac",
        )
    metal_kernel.cached(conv.KERNEL, conv.self_check)
    metal_kernel.cached(selector.KERNEL, selector.self_check)
    few_row = metal_kernel.cached(qmm.KERNEL, qmm.self_check)  # the verify's quantized matmul
    report = metal_kernel.report()
    ok = all(v == "ok" for v in report.values())
    text = ", ".join(f"{n} {v}" for n, v in report.items())
    if qmm_choice.CHOOSER.table:  # shapes timed against MLX's qmm in this process
        text += f"; few_row_qmm {qmm_choice.CHOOSER.report()}"
    return Check("metal kernels", f"{text}; {_rows_match(few_row)}", ok)


def _rows_match(kernel) -> str:
    """The few-row kernel's "verify rows = plain rows" finding; a "no" fails nothing (the
    greedy claim is then "near ties may differ", docs/algorithm.md §4.2.1)."""
    from .model import qmm

    if kernel is None:
        return f"{qmm.ROWS_LINE}: not checked (few_row_qmm failed)"
    try:
        return qmm.rows_match(kernel)
    except Exception as e:  # noqa: BLE001 - a launch error must not hide the kernels' states
        return f"{qmm.ROWS_LINE}: not checked ({_first_line(e)})"


def parity() -> Check:
    """16 greedy tokens of DFlash against plain decoding on a tiny random pair: equal on the
    CPU backend with the few-row kernel; elsewhere they may part only at a near-tie."""
    from . import tiny_pair

    with tempfile.TemporaryDirectory(prefix="dflash-doctor-") as root:
        pair = tiny_pair.load_pair(*tiny_pair.write_pair(Path(root)))
        plain, ours = tiny_pair.greedy_parity(pair, PARITY_PROMPT, PARITY_TOKENS)
        n = len(plain)
        if ours == plain:
            return Check("parity", f"DFlash's {n} greedy tokens equal plain decoding's")
        at = next((i for i, (a, b) in enumerate(zip(plain, ours, strict=False)) if a != b), n)
        differs = f"DFlash differs from plain decoding at token {at} of {n}"
        if at >= min(len(plain), len(ours)) or _bit_exact_backend():
            return Check("parity", differs, ok=False)
        gap = tiny_pair.tie_gap(pair, PARITY_PROMPT, plain, ours, at)
    if gap <= TIE_GAP:
        return Check("parity", f"{differs}, at a floating-point near-tie ({gap:.1e}; allowed)")
    return Check("parity", f"{differs}, and not at a near-tie ({gap:.1e})", ok=False)


def _bit_exact_backend() -> bool:
    """Whether greedy DFlash must be bit-identical to plain decoding here (algorithm.md
    §4.2.1): the CPU backend with its few-row kernel."""
    from . import ops
    from .loading import backend

    st = ops.backend_status() if backend.install() else None
    return bool(st) and bool(st["small_gemm"].get("active"))


def caches() -> Check:
    """The dflash-mlx cache folder and the Hugging Face cache, with their sizes."""
    from .loading import cachedir, hub

    def where(path: Path) -> str:
        return (
            f"{path} ({hub.human_size(hub.dir_size(path))})" if path.exists() else f"{path} (none)"
        )

    own = where(cachedir.cache_dir()) if cachedir.enabled() else "off (DFLASH_CACHE=0)"
    return Check("caches", f"dflash {own}; Hugging Face {where(hub.cache_dir())}")


CHECKS: dict[str, Callable[[], Check]] = {
    "parity": parity,  # first: it loads a pair, so the CPU backend's kernels are built
    "device": device,
    "memory": memory,
    "versions": versions,
    "cpu backend": cpu_backend,
    "metal kernels": metal_kernels,
    "caches": caches,
}


def run_checks() -> list[Check]:
    """Every check, in report order (``ORDER``)."""
    found = {name: _guarded(name, CHECKS[name]) for name in CHECKS}
    return [found[name] for name in ORDER]


def render(checks: list[Check]) -> str:
    """The report as text: one line per check, a failing one marked, and a verdict."""
    width = max(len(c.name) for c in checks)
    lines = [f"{c.name:<{width}}  {c.value}{'' if c.ok else '  <- FAILED'}" for c in checks]
    bad = [c.name for c in checks if not c.ok]
    lines.append("all checks passed" if not bad else f"failed: {', '.join(bad)}")
    return "\n".join(lines)


def as_json(checks: list[Check]) -> dict:
    """The report as one JSON-ready object: ``ok`` and the checks by name."""
    return {
        "ok": all(c.ok for c in checks),
        "checks": {c.name: {k: v for k, v in asdict(c).items() if k != "name"} for c in checks},
    }
