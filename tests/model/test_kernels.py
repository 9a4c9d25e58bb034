"""Metal kernels vs their MLX references.

Every case runs twice: through the kernel body compiled with g++ against ``metal_emu``'s
shim (needs a C++ compiler, so it runs on Linux CI), and through the real
``mx.fast.metal_kernel`` (needs a Metal GPU). Both go through the same launch helpers in
``dflash_mlx.model.conv`` and ``dflash_mlx.model.selector`` that the package uses on a Mac.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for metal_emu

from metal_emu.emulator import EmulatedKernel, RaceDetected, compiler

from dflash_mlx.model import conv, metal_kernel, selector
from dflash_mlx.model.conv import two_tap_conv_ops as conv_reference
from dflash_mlx.model.selector import select_path_ops as select_reference

HAS_METAL = mx.metal.is_available()
BACKENDS = [
    pytest.param(
        "emulated",
        marks=pytest.mark.skipif(
            compiler() is None, reason="no C++ compiler (g++/c++/$CXX) to emulate the Metal bodies"
        ),
    ),
    pytest.param(
        "metal",
        marks=pytest.mark.skipif(
            not HAS_METAL, reason="mx.metal.is_available() is False: real Metal kernels need a Mac"
        ),
    ),
]
SPECS = {"two_tap_conv": conv.KERNEL, "path_select": selector.KERNEL}
G_ODD = 40  # groups: not a multiple of 32
H = 16 * G_ODD


@pytest.fixture(params=BACKENDS)
def backend(request):
    """(name, factory) where factory builds a kernel object by name."""
    make = (
        metal_kernel.build
        if request.param == "metal"
        else (lambda spec: metal_kernel.build(spec, EmulatedKernel))
    )
    return request.param, lambda name: make(SPECS[name])


def _f32(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


# ----------------------------------------------------------------------------- conv


CONV_CASES = [  # (batch, L, block, taps, dtype)
    (1, 1, 8, 2, mx.bfloat16),  # L = 1: only the anchor row
    (2, 24, 8, 2, mx.bfloat16),  # three blocks: rows 8 and 16 must not see the previous block
    (3, 5, 8, 2, mx.float32),  # one partial block
    (2, 12, 4, 3, mx.float16),  # three taps, three blocks of 4
]


@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: f"B{c[0]}L{c[1]}blk{c[2]}t{c[3]}")
def test_conv_matches_reference(backend, case):
    name, factory = backend
    Bsz, L, block, taps, dtype = case
    kernel = factory("two_tap_conv")
    mx.random.seed(L * 7 + taps)
    x = mx.random.normal((Bsz, L, H)).astype(dtype)  # [B, L, H]
    base = mx.random.normal((taps, H)).astype(dtype)  # [taps, H]
    dyn = (0.5 * mx.random.normal((Bsz, L, taps, G_ODD))).astype(dtype)  # [B, L, taps, G]
    out = conv.two_tap_conv_kernel(kernel, x, base, dyn, block)
    ref = conv_reference(x, base, dyn, block)
    assert out.dtype == dtype and out.shape == (Bsz, L, H)
    got, want = _f32(out), _f32(ref)
    if name == "emulated" or dtype == mx.float32:
        # same float32 operations in the same order; bf16/fp16 round once at the end
        tol = {mx.float32: 1e-5, mx.float16: 1e-3, mx.bfloat16: 8e-3}[dtype]
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    else:  # GPU may contract into fma: allow one output ulp
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    if name == "emulated":
        assert np.mean(got == want) > 0.999  # bit-identical apart from rare rounding ties


def test_conv_taps_stop_at_block_boundary(backend):
    """Huge values in the previous block's last row must not leak into a block's first row."""
    _, factory = backend
    kernel = factory("two_tap_conv")
    x = mx.ones((1, 16, H)).at[:, 7].multiply(1e6)  # [1, 16, H], row 7 ends block 0
    base = mx.ones((2, H))
    dyn = mx.zeros((1, 16, 2, G_ODD))
    out = np.array(conv.two_tap_conv_kernel(kernel, x, base, dyn, 8))
    assert np.all(out[0, 8] == 1.0)  # row 8 starts block 1: tap 1 dropped
    assert np.all(out[0, 9] == 2.0)
    assert np.all(out[0, 7] == 1e6 + 1.0)


@pytest.mark.skipif(compiler() is None, reason="no C++ compiler to emulate the Metal bodies")
def test_conv_one_compiled_library_serves_every_block_width():
    """The block width is read from the input's shape, not a template argument: widths 2, 4,
    8 and 16 (and a partial block) all run the one program compiled for the first, as MLX
    compiles one Metal library per name and template arguments, and each equals the twin."""
    kernel = metal_kernel.build(conv.KERNEL, EmulatedKernel)
    mx.random.seed(11)
    for block, L in ((2, 6), (4, 8), (8, 16), (16, 32), (16, 5)):
        x = mx.random.normal((2, L, H))  # [B, L, H]
        base = mx.random.normal((2, H))  # [taps, H]
        dyn = 0.5 * mx.random.normal((2, L, 2, G_ODD))  # [B, L, taps, G]
        got = conv.two_tap_conv_kernel(kernel, x, base, dyn, block)
        np.testing.assert_allclose(
            _f32(got), _f32(conv_reference(x, base, dyn, block)), rtol=1e-5, atol=1e-5
        )
    assert kernel.calls == 5 and len(kernel.builds) == 1, kernel.builds


def test_conv_rows_that_are_not_whole_blocks_run_the_twin(monkeypatch):
    """L = 12 rows of width-8 blocks (never made by the drafter) take the twin, not a wrong
    launch; the launch itself refuses them."""
    launched = []
    monkeypatch.setattr(metal_kernel, "use_metal", lambda: True)
    monkeypatch.setattr(metal_kernel, "cached", lambda spec, check: launched.append(1) or object())
    x, base, dyn = mx.ones((1, 12, H)), mx.ones((2, H)), mx.zeros((1, 12, 2, G_ODD))
    out = conv.two_tap_conv(x, base, dyn, 8)
    assert mx.array_equal(out, conv_reference(x, base, dyn, 8)) and launched
    with pytest.raises(ValueError, match="block 8"):
        conv.two_tap_conv_kernel(object(), x, base, dyn, 8)


# ------------------------------------------------------------------------- selector


def _selector_inputs(Bsz, L, K=16, R=256, V=997, seed=0, dtype=mx.bfloat16, id_dtype=mx.uint32):
    mx.random.seed(seed)
    U = 2.0 * mx.random.normal((Bsz, L, K))  # [B, L, K] float32
    cand = mx.random.randint(0, V, (Bsz, L, K)).astype(id_dtype)  # [B, L, K]
    anchor = mx.random.randint(0, V, (Bsz,)).astype(id_dtype)  # [B]
    g = mx.random.normal((Bsz, L, R)).astype(dtype)  # [B, L, R]
    A = (0.15 * mx.random.normal((V, R))).astype(dtype)  # [V, R]
    Bc = (0.15 * mx.random.normal((V, R))).astype(dtype)  # [V, R]
    return U, cand, anchor, g, A, Bc


def _check_selection(name, kernel, inputs, temperature=0.0, uniforms=None, lanes=None):
    path, q = selector.select_path_kernel(kernel, *inputs, temperature, uniforms, lanes=lanes)
    ref_path, ref_q = select_reference(*inputs, temperature, uniforms)
    assert path.dtype == mx.int32 and path.shape == ref_path.shape
    np.testing.assert_array_equal(np.array(path), np.array(ref_path))
    if temperature == 0:
        assert q is None and ref_q is None
    else:
        assert q.dtype == mx.float32 and q.shape == ref_q.shape
        np.testing.assert_allclose(np.array(q), np.array(ref_q), atol=2e-6, rtol=1e-5)
    return np.array(path), q


@pytest.mark.parametrize(
    "Bsz,L,lanes", [(3, 7, None), (2, 1, None), (2, 15, 4)], ids=["block8", "L1", "block16-W4"]
)
def test_select_greedy_matches_reference(backend, Bsz, L, lanes):
    name, factory = backend
    inputs = _selector_inputs(Bsz, L, seed=L)
    path, _ = _check_selection(name, factory("path_select"), inputs, lanes=lanes)
    # the pairwise term matters: some rows leave the unary argmax (else the test is vacuous)
    assert (path != np.array(mx.argmax(inputs[0], axis=-1))).any()


def test_select_greedy_exact_ties(backend):
    """Exact ties go to the lowest index: equal unary scores with zero codebooks, and
    duplicated candidate ids whose scores are bit-identical through the pairwise term."""
    name, factory = backend
    kernel = factory("path_select")
    U, cand, anchor, g, A, Bc = _selector_inputs(2, 7, seed=3)
    # (1) S = U, values on a coarse grid: many exact ties, including for the maximum
    Uq = mx.floor(U * 0.5)  # [B, L, K]
    zeros = mx.zeros_like(A)
    path, _ = _check_selection(name, kernel, (Uq, cand, anchor, g, zeros, zeros))
    first_max = np.argmax(np.array(Uq), axis=-1)  # numpy: first occurrence
    np.testing.assert_array_equal(path, first_max)
    # (2) candidates 5 and 11 of every row share a token and a dominant unary score
    cand_np, U_np = np.array(cand), np.array(U)
    cand_np[:, :, 11] = cand_np[:, :, 5]
    U_np[:, :, 5] = U_np[:, :, 11] = 50.0
    inputs = (mx.array(U_np), mx.array(cand_np), anchor, g, A, Bc)
    path, _ = _check_selection(name, kernel, inputs)
    assert np.all(path == 5)


def test_select_int32_ids_and_fp32_codebooks(backend):
    name, factory = backend
    inputs = _selector_inputs(2, 7, R=96, seed=5, dtype=mx.float32, id_dtype=mx.int32)
    _check_selection(name, factory("path_select"), inputs)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_select_sampled_matches_reference(backend, temperature):
    name, factory = backend
    Bsz, L = 3, 7
    inputs = _selector_inputs(Bsz, L, seed=11)
    mx.random.seed(12)
    uniforms = mx.random.uniform(shape=(Bsz, L))  # [B, L]
    uniforms = uniforms.at[0, 0].multiply(0.0)  # u = 0: the first candidate with q > 0
    path, q = _check_selection(name, factory("path_select"), inputs, temperature, uniforms)
    np.testing.assert_allclose(np.array(q.sum(-1)), 1.0, atol=1e-5)
    assert len(np.unique(path)) > 2  # draws spread over candidates


def test_select_sampled_edges_of_the_cdf(backend):
    """u = 0 skips a zero-probability first candidate (cdf[0] = 0 <= u); a uniform at or
    above the final cdf value picks K - 1 (clipped). Uniforms are drawn in [0, 1); 1.5
    forces the clip whatever the rounding of cdf[-1]."""
    name, factory = backend
    U, cand, anchor, g, A, _ = _selector_inputs(1, 3, seed=2)
    U = mx.zeros_like(U).at[..., -1].add(30.0).at[..., 0].add(-200.0)  # q[0] underflows to 0
    zeros = mx.zeros_like(A)
    uniforms = mx.array([[0.0, 0.999999, 1.5]])
    path, q = _check_selection(
        name, factory("path_select"), (U, cand, anchor, g, zeros, zeros), 1.0, uniforms
    )
    assert np.all(np.array(q)[..., 0] == 0.0)
    np.testing.assert_array_equal(path, [[1, 15, 15]])


# ------------------------------------------------------------ dispatch and packaging


def test_sources_are_package_data_with_header_comment():
    for name in SPECS:
        src = metal_kernel.source(name)
        head = src.split("\n\n")[0]
        assert head.startswith("//")
        for word in ("Inputs", "Outputs", "Grid", "Template parameters"):
            assert word in src.split("const ")[0], (name, word)
        assert (metal_kernel.source_dir() / f"{name}.metal").exists()
    # a checkout keeps the bodies in the top-level metal/ (a wheel carries them as package data)
    repo = Path(__file__).resolve().parents[2]
    if (repo / "pyproject.toml").is_file():
        assert metal_kernel.source_dir() == repo / "metal"


def test_reference_fallback_off_metal(monkeypatch):
    """Off Metal (or when forced by the env var) the public functions are the references."""
    if HAS_METAL:
        monkeypatch.setenv(metal_kernel.REFERENCE_ENV, "1")
    assert not metal_kernel.use_metal()
    x = mx.random.normal((1, 8, H))
    base, dyn = mx.random.normal((2, H)), mx.random.normal((1, 8, 2, G_ODD))
    assert mx.array_equal(conv.two_tap_conv(x, base, dyn, 8), conv_reference(x, base, dyn, 8))
    inputs = _selector_inputs(1, 7, R=32, V=50)
    path, q = selector.select_path(*inputs)
    assert mx.array_equal(path, select_reference(*inputs)[0]) and q is None
    if not HAS_METAL:
        assert not metal_kernel._cache  # nothing was built


@pytest.mark.skipif(not HAS_METAL, reason="needs a Metal GPU (mx.metal.is_available())")
def test_public_functions_dispatch_to_kernels_on_metal(monkeypatch):
    monkeypatch.delenv(metal_kernel.REFERENCE_ENV, raising=False)
    assert metal_kernel.use_metal()
    x = mx.random.normal((2, 16, H)).astype(mx.bfloat16)
    base, dyn = mx.random.normal((2, H)), mx.random.normal((2, 16, 2, G_ODD))
    out = conv.two_tap_conv(x, base, dyn, 8)
    np.testing.assert_allclose(
        _f32(out), _f32(conv_reference(x, base, dyn, 8)), rtol=2e-2, atol=2e-2
    )
    inputs = _selector_inputs(2, 7)
    path, q = selector.select_path(*inputs)
    assert mx.array_equal(path, select_reference(*inputs)[0]) and q is None
    assert set(metal_kernel._cache) == {"two_tap_conv", "path_select"}


@pytest.mark.skipif(compiler() is None, reason="no C++ compiler")
def test_module_dispatch_branch_with_emulated_kernels(monkeypatch):
    """The Metal branch of the public functions, as TwoTapConv and PathSelector reach it,
    with the cached kernels replaced by their emulations."""
    from dflash_mlx.model.conv import TwoTapConv
    from dflash_mlx.model.selector import PathSelector

    monkeypatch.setattr(metal_kernel, "use_metal", lambda: True)
    monkeypatch.setattr(
        metal_kernel,
        "_cache",
        {n: metal_kernel.build(spec, EmulatedKernel) for n, spec in SPECS.items()},
    )
    mx.random.seed(4)
    conv = TwoTapConv(H, kernel_size=2, group_size=16)
    conv.kernel_projection.weight = 0.02 * mx.random.normal(conv.kernel_projection.weight.shape)
    conv.base_kernel = mx.random.normal(conv.base_kernel.shape)
    u = mx.random.normal((1, 16, H))  # [B, L, H]
    y0, _d1 = conv.prepare(u, 8)
    d = conv.kernel_projection(u).reshape(1, 16, 2, 2, G_ODD)
    np.testing.assert_allclose(
        np.array(y0),
        np.array(conv_reference(u, conv.base_kernel[0], d[:, :, 0], 8)),
        rtol=1e-5,
        atol=1e-5,
    )
    sel = PathSelector(32, rank=64, vocab_size=300)
    sel.predecessor_codebook = 0.3 * mx.random.normal((300, 64))
    sel.successor_codebook = 0.3 * mx.random.normal((300, 64))
    logits, hidden = mx.random.normal((2, 7, 300)), mx.random.normal((2, 7, 32))
    anchor = mx.array([3, 9])
    _tokens, cand, q, path = sel(logits, hidden, anchor, 16)
    U = mx.take_along_axis(logits, cand.astype(mx.int32), axis=-1)
    g = sel.hidden_projection(hidden)
    ref_path, _ = select_reference(
        U, cand, anchor, g, sel.predecessor_codebook, sel.successor_codebook
    )
    assert q is None and mx.array_equal(path, ref_path)
    assert all(k.calls > 0 for k in metal_kernel._cache.values())


def test_env_var_forces_reference(monkeypatch):
    monkeypatch.setenv(metal_kernel.REFERENCE_ENV, "1")
    assert not metal_kernel.use_metal()
    monkeypatch.setenv(metal_kernel.REFERENCE_ENV, "0")
    assert metal_kernel.use_metal() == (HAS_METAL and mx.default_device().type == mx.DeviceType.gpu)


@pytest.mark.skipif(compiler() is None, reason="no C++ compiler")
def test_emulator_models_threadgroup_memory_and_barriers():
    """Harness self-check: a threadgroup reversal needs shared memory and a barrier; without
    the barrier the result depends on thread order and the harness says so. An element the
    body does not write stays poisoned (NaN)."""
    src = """
    threadgroup float buf[64];
    const uint i = thread_position_in_threadgroup.x;
    const uint n = threads_per_threadgroup.x;
    buf[i] = inp[thread_position_in_grid.x];
    metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
    if (thread_position_in_grid.x != 0) {
      out[thread_position_in_grid.x] = buf[n - 1 - i];
    }
    """
    k = EmulatedKernel("rev", ["inp"], ["out"], src)
    a = mx.arange(100, dtype=mx.float32)
    (out,) = k(
        inputs=[a],
        grid=(100, 1, 1),
        threadgroup=(64, 1, 1),
        output_shapes=[(100,)],
        output_dtypes=[mx.float32],
    )
    want = np.concatenate([np.arange(64)[::-1], 64 + np.arange(36)[::-1]]).astype(np.float32)
    got = np.array(out)
    assert np.isnan(got[0])
    np.testing.assert_array_equal(got[1:], want[1:])
    no_barrier = src.replace("metal::threadgroup_barrier", "// ")
    racy = EmulatedKernel("rev_racy", ["inp"], ["out"], no_barrier)
    with pytest.raises(RaceDetected):
        racy(
            inputs=[a],
            grid=(100, 1, 1),
            threadgroup=(64, 1, 1),
            output_shapes=[(100,)],
            output_dtypes=[mx.float32],
        )
    divergent = EmulatedKernel(
        "div",
        ["inp"],
        ["out"],
        "if (thread_position_in_grid.x % 2) {\n"
        + src.split("if (thread_position_in_grid.x != 0)")[0]
        + "}",
    )
    with pytest.raises(RuntimeError, match="barrier"):  # barrier in divergent control flow
        divergent(
            inputs=[a],
            grid=(100, 1, 1),
            threadgroup=(64, 1, 1),
            output_shapes=[(100,)],
            output_dtypes=[mx.float32],
        )
    with pytest.raises(NotImplementedError):
        EmulatedKernel("s", ["inp"], ["out"], "out[0] = simd_max(inp[0]);")


def _butterfly(v: np.ndarray, offs) -> np.ndarray:
    """Every lane's sum of 32 float32 lanes in the emulator's documented order."""
    a = v.astype(np.float32)
    for off in offs:
        a = a + a[np.arange(32) ^ off]
    return a


@pytest.mark.skipif(compiler() is None, reason="no C++ compiler to emulate Metal")
def test_the_emulated_simd_sum_follows_its_documented_butterfly_in_both_thread_orders():
    src = """
    const uint i = thread_position_in_grid.x;
    out[i] = simd_sum(inp[i]);
    lanes[i] = float(thread_index_in_simdgroup + 100 * simdgroup_index_in_threadgroup);
    """
    rng = np.random.default_rng(3)  # magnitudes 1e-6 .. 1e6: the sum depends on its order
    v = (rng.standard_normal(96) * 10.0 ** rng.uniform(-6, 6, 96)).astype(np.float32)
    k = EmulatedKernel("simd", ["inp"], ["out", "lanes"], src)
    out, lanes = k(  # forward and reverse thread orders agree, or RaceDetected
        inputs=[mx.array(v)],
        grid=(96, 1, 1),
        threadgroup=(64, 1, 1),
        output_shapes=[(96,), (96,)],
        output_dtypes=[mx.float32, mx.float32],
    )
    want = np.concatenate([_butterfly(v[i : i + 32], (16, 8, 4, 2, 1)) for i in (0, 32, 64)])
    assert np.array_equal(np.array(out), want)  # 16, 8, 4, 2, 1: lane l + lane l ^ off
    other = np.concatenate([_butterfly(v[i : i + 32], (1, 2, 4, 8, 16)) for i in (0, 32, 64)])
    assert not np.array_equal(other, want)  # the data tell the orders apart
    assert np.array_equal(np.array(lanes), [i % 32 + 100 * ((i % 64) // 32) for i in range(96)])
