"""The Linux CPU backend sits behind one seam: the engine calls ``dflash_mlx.ops``, only the
package's entry and the loader reach ``dflash_mlx.cpu``, and with the backend off (the path a
Mac runs) no compiler path is imported and greedy decoding still equals mlx-lm's."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_mlx import cpu, ops

ROOT = Path(__file__).resolve().parents[2]
ENTRY_USERS = {
    "dflash_mlx/__init__.py",
    "dflash_mlx/loading/backend.py",  # install, for the loader, the doctor and its tiny pair
}


def _imported(f: Path, root: Path) -> set[str]:
    """Absolute names of the package modules ``f`` imports (function-local ones included)."""
    package = list(f.relative_to(root).parts[:-1])  # a module's package; an __init__'s own
    out = set()
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
    return {n for n in out if n.startswith("dflash_mlx")}


def seam_breaches(root: Path = ROOT) -> list[str]:
    """Imports outside dflash_mlx/cpu/ that reach past the seam, in the checkout at root."""
    bad = []
    for f in sorted((root / "dflash_mlx").rglob("*.py")):
        rel = f.relative_to(root).as_posix()
        if rel.startswith("dflash_mlx/cpu/"):
            continue
        for name in sorted(_imported(f, root)):
            if name.startswith("dflash_mlx.cpu."):
                bad.append(f"{rel} imports {name} (call dflash_mlx.ops instead)")
            elif name == "dflash_mlx.cpu" and rel not in ENTRY_USERS:
                bad.append(f"{rel} imports dflash_mlx.cpu (only {sorted(ENTRY_USERS)} may)")
    return bad


def test_no_module_outside_cpu_reaches_past_the_seam():
    assert seam_breaches() == []


def test_the_seam_check_finds_a_breach(tmp_path):
    pkg = tmp_path / "dflash_mlx" / "decoding"
    pkg.mkdir(parents=True)
    (pkg / "loop.py").write_text("from ..cpu import draft_step\nfrom .. import cpu\n")
    found = seam_breaches(tmp_path)
    assert any("imports dflash_mlx.cpu.draft_step" in line for line in found), found
    assert any("imports dflash_mlx.cpu (only" in line for line in found), found


def test_ops_take_only_known_replacements():
    with pytest.raises(ValueError, match="no"):
        ops.use(softmaxx=lambda x: x)


@pytest.mark.skipif(not cpu.enabled(), reason="the CPU backend is installed on Linux")
def test_install_swaps_the_ops_once_and_the_twins_are_the_cpus():
    from dflash_mlx.cpu import draft_step, fastmath

    assert cpu.install() and cpu.install()
    assert ops.softmax is fastmath.softmax and ops.draft_step is draft_step.step
    assert set(ops.describe()) >= {"device", "mlx", "blas", "small_gemm", "exact_ops"}


CODE = """
import sys
import mlx.core as mx
from mlx_lm.generate import generate_step
from dflash_mlx import load, ops
from dflash_mlx.decoding.acceptance import SamplingParams
from dflash_mlx.decoding.loop import DecodeOptions, decode

m, _ = load(sys.argv[1], sys.argv[2], warmup=False, quiet=True)
ids = [5, 17, 3, 99, 42]
ref = [t for t, _ in generate_step(mx.array(ids), m.target, max_tokens=24)]
out = []
for c in decode(m, ids, m.make_cache(), SamplingParams(), DecodeOptions(24, block_size=4)):
    out += c.tokens
assert out[:24] == ref, (out, ref)
cpu = sorted(n for n in sys.modules if n.startswith("dflash_mlx.cpu."))
assert cpu == [], cpu
assert ops.softmax is ops._DEFAULTS["softmax"]
print("ok")
"""


def test_with_the_backend_off_nothing_of_it_loads_and_greedy_still_matches(tiny_dir):
    """DFLASH_CPU=0 runs what a Mac runs (plain MLX ops, the drafter's own step): no
    compiler path is imported and the output is still mlx-lm's greedy output."""
    env = dict(os.environ, DFLASH_CPU="0")
    args = [str(tiny_dir / "qwen3"), str(tiny_dir / "d2_qwen3")]
    p = subprocess.run(
        [sys.executable, "-c", CODE, *args], capture_output=True, text=True, env=env, check=False
    )
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]
