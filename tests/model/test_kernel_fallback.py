"""A Metal kernel that fails its first-use check switches to its MLX twin, with one warning.

On Linux ``use_metal()`` is monkeypatched true and ``metal_kernel.factory`` is pointed at a
stand-in: one that fails at build, one whose kernel fails at launch, one whose kernel returns
wrong numbers, and (with a C++ compiler) the emulated real kernel, which must pass.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for metal_emu

from metal_emu.emulator import EmulatedKernel, compiler
from references import PROMPTS, reference, run

from dflash_mlx.model import conv, metal_kernel, selector

H, G = 64, 4


def _build_fails(**kw):
    raise RuntimeError("[metal::Device] Unable to build metal library from source")


class _LaunchFails:
    def __init__(self, **kw):
        pass

    def __call__(self, **kw):
        raise RuntimeError("[metal_kernel] launch failed")


class _WrongNumbers:
    """Outputs of the right shapes and dtypes, filled with ones."""

    def __init__(self, **kw):
        pass

    def __call__(self, *, output_shapes, output_dtypes, **kw):
        return [mx.ones(s, dtype=d) for s, d in zip(output_shapes, output_dtypes, strict=True)]


FAILING = {"build": _build_fails, "launch": _LaunchFails, "numbers": _WrongNumbers}


@pytest.fixture
def fake_metal(monkeypatch):
    """use_metal() true, a clean kernel cache; yields a setter for the factory."""
    monkeypatch.setattr(metal_kernel, "use_metal", lambda: True)
    monkeypatch.setattr(metal_kernel, "_cache", {})
    monkeypatch.setattr(metal_kernel, "_problems", {})
    return lambda f: monkeypatch.setattr(metal_kernel, "factory", f)


def _conv_and_select():
    mx.random.seed(3)
    x, base = mx.random.normal((2, 12, H)), mx.random.normal((2, H))
    dyn = 0.5 * mx.random.normal((2, 12, 2, G))
    U, g = mx.random.normal((2, 6, 8)), mx.random.normal((2, 6, 16))
    cand = mx.random.randint(0, 50, (2, 6, 8)).astype(mx.uint32)
    anchor = mx.array([1, 2], dtype=mx.uint32)
    A, Bc = 0.3 * mx.random.normal((50, 16)), 0.3 * mx.random.normal((50, 16))
    args = (U, cand, anchor, g, A, Bc)
    got = (conv.two_tap_conv(x, base, dyn, 4), selector.select_path(*args)[0])
    want = (conv.two_tap_conv_ops(x, base, dyn, 4), selector.select_path_ops(*args)[0])
    return got, want


@pytest.mark.parametrize("how", sorted(FAILING))
def test_a_failing_kernel_warns_once_and_the_twin_runs(fake_metal, capsys, how):
    fake_metal(FAILING[how])
    for _ in range(2):  # the second use neither rebuilds nor warns again
        got, want = _conv_and_select()
        assert all(mx.array_equal(a, b) for a, b in zip(got, want, strict=True))
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines  # one per kernel
    for name, line in zip(("two_tap_conv", "path_select"), lines, strict=True):
        assert line.startswith(f"warning: the {name} Metal kernel failed its check (")
        assert "using the MLX twin" in line and "dflash doctor" in line
    assert metal_kernel.report() == {
        "two_tap_conv": f"failed: {metal_kernel._problems['two_tap_conv']}",
        "path_select": f"failed: {metal_kernel._problems['path_select']}",
    }


def test_the_warning_says_why(fake_metal, capsys):
    fake_metal(_WrongNumbers)
    _conv_and_select()
    err = capsys.readouterr().err
    assert "differs from the twin by" in err


@pytest.mark.parametrize("how", sorted(FAILING))
def test_greedy_decode_is_unchanged_by_a_failing_kernel(pairs, fake_metal, capsys, how):
    """The selector (and, off the CPU backend's compiled drafter step, the conv) takes the
    Metal branch; every kernel fails."""
    fake_metal(FAILING[how])
    model, tok = pairs("qwen3", "d2")
    ids = tok.encode(PROMPTS[0])
    got, _ = run(model, ids, 24, 8, selector=True)
    assert got == reference(model, ids, 24)
    assert "path_select" in metal_kernel._cache
    assert all(k is None for k in metal_kernel._cache.values())
    assert capsys.readouterr().err.count("warning: the ") == len(metal_kernel._cache)


@pytest.mark.skipif(compiler() is None, reason="no C++ compiler to emulate the Metal bodies")
def test_the_real_kernels_pass_their_check(fake_metal, capsys):
    fake_metal(EmulatedKernel)
    got, want = _conv_and_select()
    assert mx.array_equal(got[1], want[1])
    assert mx.allclose(got[0], want[0], atol=1e-5)
    assert metal_kernel.report() == {"two_tap_conv": "ok", "path_select": "ok"}
    assert capsys.readouterr().err == ""
