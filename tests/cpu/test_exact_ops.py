"""The exact vectorised SiLU, softmax, RMSNorm and attention (exact_ops.py, cpu/exact_ops.cpp): the
same bits as MLX's CPU ops on every input tried, loaded where a C++ compiler is, used by the
target's layers, and MLX's own ops where the kernels do not apply."""

import io
import shutil
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import base
from mlx_lm.models.activations import swiglu

from dflash_mlx.cpu import exact_ops
from dflash_mlx.cpu import target as cpu_target
from dflash_mlx.decoding import tree
from dflash_mlx.model import target

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or shutil.which(exact_ops.compiler() or "") is None,
    reason="the extension is built on Linux with a C++ compiler",
)

SPECIAL = [0.0, -0.0, 1e-45, -1e-45, 1e-30, 0.5, -0.5, 87.9, 88.0, 88.01, -88.0, -88.01]
SPECIAL += [-87.33654, 100.0, -100.0, 3.4e38, -3.4e38, float("inf"), -float("inf")]


@pytest.fixture(scope="module")
def ops():
    module = exact_ops.load()
    assert module is not None, exact_ops.status()["error"]
    return module


def same_bits(a, b) -> bool:
    a, b = np.array(a), np.array(b)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_exp_has_mlx_bits_over_a_sweep_of_float32(ops):
    # Every 509th bit pattern (all signs, exponents, NaNs), plus a dense run where exp is
    # neither 0 nor inf; the whole 2^32 were checked once (docs/algorithm.md §6).
    x = np.arange(0, 1 << 32, 509, dtype=np.uint64).astype(np.uint32).view(np.float32)
    dense = np.linspace(-90, 90, 1 << 20, dtype=np.float32)
    x = np.concatenate([x, dense, np.array(SPECIAL, np.float32)])
    out = np.empty_like(x)
    ops.exp_buffer(x.ctypes.data, out.ctypes.data, x.size)
    assert same_bits(out, mx.exp(mx.array(x)))


def test_exp_kernel_is_not_plain_expf(ops):
    # The check above must be able to fail: libm's correctly rounded expf differs from
    # MLX's polynomial in the last bit for many inputs.
    x = np.linspace(-20, 20, 4096, dtype=np.float32)
    out = np.empty_like(x)
    ops.exp_buffer(x.ctypes.data, out.ctypes.data, x.size)
    assert not same_bits(out, np.exp(x))


@pytest.mark.parametrize("shape", [(1, 1, 1536), (1, 8, 1536), (3, 7), (2, 5, 129)])
def test_silu_mul_has_swiglu_bits(ops, shape):
    g = mx.random.normal(shape, key=mx.random.key(1)) * 9.0
    u = mx.random.normal(shape, key=mx.random.key(2))
    assert same_bits(ops.silu_mul(g, u), swiglu(g, u))


def test_silu_mul_has_swiglu_bits_on_special_values(ops):
    g = mx.array(SPECIAL + [float("nan")])
    u = mx.ones_like(g) * 1.5
    assert same_bits(ops.silu_mul(g, u), swiglu(g, u))


def test_silu_mul_reads_strided_and_broadcast_inputs(ops):
    g = mx.random.normal((257, 8), key=mx.random.key(3)).T * 6.0  # transposed view
    u = mx.broadcast_to(mx.random.normal((1, 257), key=mx.random.key(4)), (8, 257))
    assert same_bits(ops.silu_mul(g, u), swiglu(g, u))


@pytest.mark.parametrize("shape", [(1, 8, 576), (1, 10, 3, 64), (33, 17), (1, 1, 2880)])
def test_rms_norm_has_mlx_bits(ops, shape):
    # rows of the drafter's norms, more rows than the kernel's block of 16, an odd width
    for i, scale in enumerate((1e-3, 1.0, 300.0)):
        x = mx.random.normal(shape, key=mx.random.key(i)) * scale
        w = mx.random.normal(shape[-1:], key=mx.random.key(9))
        assert same_bits(ops.rms_norm(x, w, 1e-6), mx.fast.rms_norm(x, w, 1e-6))
    out = io.StringIO()
    mx.export_to_dot(out, ops.rms_norm(x, w, 1e-6))
    assert "DflashRmsNorm" in out.getvalue()  # the kernel ran, not MLX's ops
    assert exact_ops.status()["active"] and exact_ops._state["rms_norm"]  # checked at load


def test_rms_norm_has_mlx_bits_on_special_values_and_strided_input(ops):
    x = mx.array([SPECIAL + [float("nan")], [0.0] * 20, [1e-20] * 20, [3e19] * 20])
    w = mx.linspace(-2, 2, 20)
    assert same_bits(ops.rms_norm(x, w, 1e-5), mx.fast.rms_norm(x, w, 1e-5))
    t = mx.random.normal((64, 9), key=mx.random.key(5)).T  # transposed view
    w = mx.ones((64,))
    assert same_bits(ops.rms_norm(t, w, 1e-6), mx.fast.rms_norm(t, w, 1e-6))


def test_rms_norm_stands_in_for_an_rmsnorm_module_only(ops):
    from mlx import nn

    x = mx.random.normal((2, 3, 32), key=mx.random.key(6))
    norm, layer = nn.RMSNorm(32, eps=1e-5), nn.LayerNorm(32)
    assert same_bits(exact_ops.rms_norm(norm, x), norm(x))
    assert same_bits(exact_ops.rms_norm(layer, x), layer(x))  # not an RMSNorm: its own call


@pytest.mark.parametrize("B,L,H,G", [(1, 8, 576, 36), (1, 1, 64, 4), (2, 5, 48, 3)])
def test_two_tap_conv_has_the_bits_of_the_drafter_ops(ops, B, L, H, G):
    from dflash_mlx.cpu import draft_step
    from dflash_mlx.model.conv import TwoTapConv

    conv = TwoTapConv(H, 2, H // G)
    conv.base_kernel = mx.random.normal((2, 2, H), key=mx.random.key(4))
    x = mx.random.normal((B, L, H), key=mx.random.key(5)) * 7.0
    d = mx.random.normal((B, L, 2, 2, G), key=mx.random.key(6))  # both sides' coefficients
    for side in (0, 1):
        want = draft_step._conv_ops(conv, x, side, d[:, :, side])
        assert same_bits(ops.two_tap(x, conv.base_kernel, d, side), want)
    assert not same_bits(ops.two_tap(x, conv.base_kernel, d, 0), want)  # sides differ
    assert same_bits(ops.two_tap(x[-1], conv.base_kernel, d[-1], 1), want[-1])  # [L, H] rows
    t = mx.random.normal((B, H, L), key=mx.random.key(7)).swapaxes(1, 2)  # a strided x
    want = draft_step._conv_ops(conv, t, 1, d[:, :, 1])
    assert same_bits(ops.two_tap(t, conv.base_kernel, d, 1), want)
    with pytest.raises(ValueError, match="two_tap"):
        ops.two_tap(x, conv.base_kernel, d[:, :, :, :1], 0)  # one tap: not the kernel's


def pow2_softmax_ops(s):
    p = mx.power(2.0, s - s.max(axis=-1, keepdims=True))  # cpu/fastmath.py's attention
    return p / p.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("shape", [(1, 3, 24, 210), (2, 1, 7, 1), (1, 1, 3, 4097)])
def test_pow2_softmax_has_the_bits_of_the_drafter_ops(ops, shape):
    for scale in (1.0, 40.0, 400.0):  # 2^(x - max) from ~1 down to underflow
        s = mx.random.normal(shape, key=mx.random.key(int(scale))) * scale
        assert same_bits(ops.pow2_softmax(s), pow2_softmax_ops(s))


def test_pow2_softmax_has_the_drafter_bits_on_special_values(ops):
    row = [v for v in SPECIAL if abs(v) < 1e38] + [-149.5, -150.0, -126.2, 1e-7]
    s = mx.array([row, [-float("inf")] + row[1:], [3.0] * len(row)])
    assert same_bits(ops.pow2_softmax(s), pow2_softmax_ops(s))
    dense = mx.linspace(-160.0, 0.0, 1 << 16).reshape(1, -1)  # every exponent powf meets
    assert same_bits(ops.pow2_softmax(dense), pow2_softmax_ops(dense))


@pytest.mark.parametrize("m", [1, 2, 7, 128, 301])
def test_softmax_has_mlx_bits(ops, m):
    x = mx.random.normal((2, 9, 8, m), key=mx.random.key(m)) * 15.0
    assert same_bits(ops.softmax(x), mx.softmax(x, axis=-1, precise=True))


def test_softmax_has_mlx_bits_on_masked_and_special_rows(ops):
    low = float(mx.finfo(mx.float32).min)
    rows = [
        [0.0, low, low, 1.0],
        [-float("inf"), 2.0, -float("inf"), 2.0],
        [3.4e38, 3.4e38, 0.0, -3.4e38],
        [float("nan"), 1.0, 2.0, 3.0],
        [low, low, low, low],
        [-0.0, 0.0, -0.0, 0.0],
    ]
    x = mx.array(rows)
    assert same_bits(ops.softmax(x), mx.softmax(x, axis=-1, precise=True))
    xt = mx.random.normal((300, 9), key=mx.random.key(5)).T * 10.0  # strided
    assert same_bits(ops.softmax(xt), mx.softmax(xt, axis=-1, precise=True))


def _masks(length, keys, key):
    masks = [None, "causal"] if length > 1 else [None]
    masks.append(mx.random.uniform(shape=(length, keys), key=key) > 0.3)  # boolean
    masks.append(mx.random.normal((length, keys), key=key))  # additive
    return masks


def _qkv(b, h, hk, length, keys, d, seed):
    ks = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((b, h, length, d), key=ks[0])
    k = mx.random.normal((b, hk, keys, d), key=ks[1])
    v = mx.random.normal((b, hk, keys, d), key=ks[2])
    return q, k, v


@pytest.mark.parametrize(
    "b,h,hk,length,keys,d",
    [(1, 9, 3, 1, 120, 64), (1, 9, 3, 8, 128, 64), (1, 4, 4, 5, 37, 32), (2, 8, 2, 16, 300, 64)]
    + [(1, 9, 3, 9, 1500, 64), (1, 6, 2, 3, 70, 136)],
)
def test_decode_attention_is_fast_sdpa_within_rounding(ops, b, h, hk, length, keys, d):
    """Decode widths (1-16 rows) run the decode kernel: its own summation order, so MLX's
    result to float32 rounding, with every mask kind."""
    q, k, v = _qkv(b, h, hk, length, keys, d, length * keys)
    for mask in _masks(length, keys, mx.random.key(keys)):
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=d**-0.5, mask=mask)
        got = exact_ops.attention(q, k, v, None, d**-0.5, mask)
        assert got.shape == want.shape and got.dtype == mx.float32
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("keys", [40, 1500])  # past 1,024 keys MLX's graph gave OpenBLAS P @ V
@pytest.mark.parametrize("length", [2, 8, 16])
def test_a_verify_rows_attention_has_the_bits_of_that_row_alone(ops, keys, length):
    """What greedy parity rests on: row l of an L-row causal verify equals, bit for bit, a
    one-row step over the keys it sees, at short and long contexts, on a cache's sliced K/V."""
    q, k, v = _qkv(1, 9, 3, length, keys + 64, 64, keys)
    k, v = k[:, :, :keys], v[:, :, :keys]  # a KVCache's view: rows beyond the offset unused
    rows = exact_ops.attention(q, k, v, None, 0.125, "causal")
    for i in range(length):
        n = keys - length + i + 1
        alone = exact_ops.attention(q[:, :, i : i + 1], k[:, :, :n], v[:, :, :n], None, 0.125, None)
        assert same_bits(rows[:, :, i : i + 1], alone), f"row {i}"
    contiguous = exact_ops.attention(
        q, mx.array(np.array(k)), mx.array(np.array(v)), None, 0.125, "causal"
    )
    assert same_bits(rows, contiguous)


def test_a_tree_rows_attention_has_the_bits_of_its_path_alone(ops):
    """A tree verify's masked keys add nothing: each row equals a one-row step over only the
    keys its mask lets it see, in order (a sibling sees the context, the anchor, itself)."""
    q, k, v = _qkv(1, 9, 3, 8, 1200, 64, 6)
    mask = tree.mask(1192, 5, 8)
    rows = exact_ops.attention(q, k, v, None, 0.125, mask)
    for i in range(8):
        seen = mx.array(np.flatnonzero(np.array(mask[i])))
        ki, vi = mx.take(k, seen, axis=2), mx.take(v, seen, axis=2)
        alone = exact_ops.attention(q[:, :, i : i + 1], ki, vi, None, 0.125, None)
        assert same_bits(rows[:, :, i : i + 1], alone), f"row {i}"


def test_prefill_attention_keeps_fast_sdpa_bits(ops):
    """More rows than a decode width (a prefill) take MLX's own graph, op for op."""
    q, k, v = _qkv(1, 9, 3, 17, 40, 64, 17)
    for mask in _masks(17, 40, mx.random.key(4)):
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
        assert same_bits(exact_ops.attention(q, k, v, None, 0.125, mask), want)


def test_attention_leaves_what_it_does_not_cover_to_mlx_lm(ops, monkeypatch):
    seen = []
    real = base.scaled_dot_product_attention
    monkeypatch.setattr(
        base, "scaled_dot_product_attention", lambda *a, **k: seen.append(1) or real(*a, **k)
    )
    q = mx.random.normal((1, 4, 2, 16)).astype(mx.float16)
    exact_ops.attention(q, q, q, None, 0.25, None)  # float16
    q = q.astype(mx.float32)
    exact_ops.attention(q, q, q, None, 0.25, None, sinks=mx.zeros((4,)))  # sinks
    with pytest.raises(ValueError):  # a mask mode it does not know: mlx-lm's error
        exact_ops.attention(q, q, q, None, 0.25, "window")
    exact_ops.attention(q, q, q, None, 0.25, None)  # covered: not handed on
    assert len(seen) == 3


def test_without_the_kernels_the_functions_are_mlx_ops(ops, monkeypatch):
    monkeypatch.setitem(exact_ops._state, "module", None)
    g = mx.random.normal((4, 33)) * 5.0
    assert same_bits(exact_ops.silu_mul(g, g), swiglu(g, g))
    assert same_bits(exact_ops.softmax(g), mx.softmax(g, axis=-1, precise=True))
    assert exact_ops.install_attention([]) == 0


def test_target_layers_use_the_kernels_with_the_same_logits(ops, pairs):
    """The tiny qwen3 target's MLPs and attention run the kernels; its logits for a prompt,
    one row and eight rows equal, bit for bit, those with MLX's SiLU; with MLX's attention
    too (its own summation order) they agree to float32 rounding."""
    model, _ = pairs("qwen3", "d2")
    ad = model.adapter
    bases = [x.inner if isinstance(x, target._Tap) else x for x in ad.inner.layers]
    assert all(isinstance(b.mlp, cpu_target._ExactMLP) for b in bases)
    mod = sys.modules[type(bases[0].self_attn).__module__]
    assert mod.scaled_dot_product_attention is exact_ops.attention

    def logits():
        out = []
        cache = ad.make_cache()
        for ids in ([5, 9, 14, 3, 22, 7, 11], [8], [4, 19, 2, 30, 6, 12, 17, 1]):
            lg, _ = ad(mx.array(ids)[None], cache)
            out.append(np.array(lg))
        return out

    fast = logits()
    saved = [b.mlp for b in bases]
    try:
        for b in bases:
            b.mlp = cpu_target._Compiled(b.mlp.inner)
        mlx_silu = logits()
        mod.scaled_dot_product_attention = base.scaled_dot_product_attention
        mlx_ops = logits()
    finally:
        for b, m in zip(bases, saved):
            b.mlp = m
        mod.scaled_dot_product_attention = exact_ops.attention
    assert all(same_bits(a, b) for a, b in zip(fast, mlx_silu))
    for a, b in zip(fast, mlx_ops):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_a_compiler_without_openmp_still_builds_the_extension(ops, tmp_path, monkeypatch):
    """The decode attention's threads are OpenMP's; a C++ compiler without it (e.g. clang
    with no libomp) builds the extension single-threaded instead of losing every kernel."""
    real = exact_ops.compiler()
    wrapper = tmp_path / "cxx"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {tmp_path}/calls\n'
        'case " $* " in *" -fopenmp "*) echo "error: unsupported option -fopenmp" >&2; exit 1;; esac\n'
        f'exec {real} "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    lib = exact_ops.build(tmp_path / "out")
    assert lib.is_file()
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == 2 and "-fopenmp" in calls[0].split()
    assert "-fopenmp" not in calls[1].split()
