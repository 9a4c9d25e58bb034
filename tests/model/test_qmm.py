"""The few-row quantized matmul (model/qmm.py, metal/few_row_qmm.metal) against its twin,
MLX's own ``quantized_matmul``, through the CPU emulator of the Metal body.

Every emulated launch runs its threads forward and in reverse and raises on a difference
(metal_emu), so each case here is checked in both thread orders.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for metal_emu

from metal_emu.emulator import EmulatedKernel, compiler

from dflash_mlx import ops
from dflash_mlx.model import metal_kernel, qmm, qmm_choice

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C++ compiler to emulate Metal")
EPS = {mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8, mx.float32: 2.0**-24}


def _emulated(source: str | None = None, count=(), header: str = ""):
    """The kernel built with the emulator (optionally from another body, or with a header)."""

    def factory(**kw):
        if source is not None:
            kw["source"] = source
        return EmulatedKernel(**kw, header=header, count_reads=count)

    return metal_kernel.build(qmm.KERNEL, factory)


def _case(M, K, N, bits, gs, dtype, seed=0):
    key = mx.random.key(seed)
    kx, kw = mx.random.split(key)
    x = mx.random.normal((M, K), key=kx).astype(dtype)
    w, s, b = mx.quantize(mx.random.normal((N, K), key=kw), group_size=gs, bits=bits)
    return x, w, s.astype(dtype), b.astype(dtype)


def _f64(a):
    return np.array(a.astype(mx.float32)).astype(np.float64)


@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    M=st.integers(2, 16),
    groups=st.integers(1, 4),
    N=st.integers(1, 9),
    bits=st.sampled_from([4, 8]),
    gs=st.sampled_from([32, 64, 128]),
    dtype=st.sampled_from([mx.float16, mx.bfloat16]),
)
def test_the_emulated_kernel_equals_the_twin_within_the_dtypes_rounding(
    M, groups, N, bits, gs, dtype
):
    x, w, s, b = _case(M, groups * gs, N, bits, gs, dtype, seed=M * 31 + N)
    got, want = (
        _f64(qmm.qmm_kernel(_emulated(), x, w, s, b, gs, bits)),
        _f64(qmm.qmm_ops(x, w, s, b, gs, bits)),
    )
    deq = _f64(
        mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=gs, bits=bits)
    )
    exact, mag = _f64(x) @ deq.T, np.abs(_f64(x)) @ np.abs(deq).T
    eps = EPS[dtype]
    # the kernel adds in float32 and rounds once; MLX's CPU twin rounds its dequantized
    # weights and partial sums to the dtype, so it may stray by a few of its ulps
    assert np.all(np.abs(got - exact) <= eps * np.abs(exact) + 1e-5 * mag)
    assert np.all(np.abs(got - want) <= 4 * eps * mag + eps * np.abs(want))


ONE_ROW = Path(__file__).resolve().parents[1] / "metal_emu" / "qmv_one_row.metal"
_ONE_ROW_KERNELS = {}


def _one_row(x, w, s, b, gs, bits):
    """Each row of x alone through the emulated one-row kernel (MLX's qmv_fast, our code)."""
    if "k" not in _ONE_ROW_KERNELS:
        _ONE_ROW_KERNELS["k"] = EmulatedKernel(
            "qmv_one_row", list(qmm.KERNEL.inputs), ["out"], ONE_ROW.read_text()
        )
    N = w.shape[0]
    rows = []
    for i in range(x.shape[0]):
        (out,) = _ONE_ROW_KERNELS["k"](
            inputs=[x[i : i + 1], w, s, b],
            template=[("T", x.dtype), ("BITS", bits), ("GS", gs)],
            grid=(32, 2 * -(-N // 8), 1),
            threadgroup=(32, 2, 1),
            output_shapes=[(1, N)],
            output_dtypes=[x.dtype],
        )
        rows.append(out)
    return mx.concatenate(rows)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    M=st.integers(2, 16),
    K=st.sampled_from([512, 1024]),  # MLX runs qmv_fast for K a multiple of 512
    N=st.integers(1, 13),
    bits=st.sampled_from([4, 8]),
    gs=st.sampled_from([32, 64, 128]),
    dtype=st.sampled_from([mx.float16, mx.bfloat16, mx.float32]),
)
@example(M=16, K=1024, N=13, bits=8, gs=128, dtype=mx.float32)  # float32: nothing rounds away
@example(M=5, K=512, N=8, bits=4, gs=32, dtype=mx.float32)
def test_each_row_of_the_kernel_equals_the_emulated_one_row_qmv_fast_bit_for_bit(
    M, K, N, bits, gs, dtype
):
    x, w, s, b = _case(M, K, N, bits, gs, dtype, seed=M * 7 + N)
    rows = qmm.qmm_kernel(_emulated(), x, w, s, b, gs, bits)
    assert mx.array_equal(rows, _one_row(x, w, s, b, gs, bits))


REVERSED = "static const bool reversed = (emu::lane_sum_reversed = true);"  # emulator hook
SUM_8 = "        sum += xt[i];\n"


@pytest.mark.parametrize("variant", ["simd_sum reversed", "8-bit x summed by fours"])
def test_a_kernel_reordering_its_sums_differs_from_the_one_row_kernel(variant):
    bits = 8 if "8-bit" in variant else 4
    x, w, s, b = _case(6, 1024, 8, bits, 64, mx.float32, seed=5)  # float32: no rounding hides
    body, header = metal_kernel.source(qmm.KERNEL.name), ""
    if variant == "simd_sum reversed":
        header = REVERSED
    else:  # the old body's order: the four x's of a word added first, then into the sum
        assert SUM_8 in body
        body = body.replace(
            SUM_8, "        sum += (i % 4 == 3) ? xt[i-3] + xt[i-2] + xt[i-1] + xt[i] : 0.0f;\n"
        )
    want = _one_row(x, w, s, b, 64, bits)
    assert mx.array_equal(qmm.qmm_kernel(_emulated(), x, w, s, b, 64, bits), want)
    other = qmm.qmm_kernel(_emulated(body, header=header), x, w, s, b, 64, bits)
    np.testing.assert_allclose(np.array(other), np.array(want), rtol=1e-5, atol=1e-4)
    assert not mx.array_equal(other, want)


@pytest.mark.parametrize("bits", [4, 8])
def test_the_kernel_reads_each_weight_word_once_whatever_the_rows(bits):
    reads = {}
    for M in (2, 16):
        kernel = _emulated(count=("w", "scales"))
        x, w, s, b = _case(M, 384, 10, bits, 128, mx.bfloat16)
        qmm.qmm_kernel(kernel, x, w, s, b, 128, bits)
        assert np.all(kernel.reads["w"] == 1)  # one pass: 4 * w.size bytes, no repeat per row
        reads[M] = kernel.reads["scales"]
    assert np.array_equal(reads[2], reads[16])  # scales: per lane chunk, not per row


@pytest.fixture
def fake_metal(monkeypatch):
    """use_metal() true with the emulated kernel; a clean kernel cache."""
    monkeypatch.setattr(metal_kernel, "use_metal", lambda: True)
    monkeypatch.setattr(metal_kernel, "_cache", {})
    monkeypatch.setattr(metal_kernel, "_problems", {})
    monkeypatch.setattr(metal_kernel, "factory", EmulatedKernel)
    # the emulator is slower than MLX's CPU qmm: here the kernel wins every timing
    chooser = qmm_choice.Chooser(timer=lambda kind, fn: 0.0 if kind == "kernel" else 1.0)
    monkeypatch.setattr(qmm_choice, "CHOOSER", chooser)


def test_the_dispatch_takes_2_to_16_rows_and_leaves_one_row_and_prefill_to_mlx(fake_metal):
    x, w, s, b = _case(17, 128, 8, 4, 64, mx.float32)
    launches = []
    for M in (1, 4, 17):
        got = qmm.qmm(x[:M], w, s, b, 64, 4)
        want = qmm.qmm_ops(x[:M], w, s, b, 64, 4)
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-4)
        launches.append(metal_kernel._cache[qmm.KERNEL.name].calls)
        assert M == 4 or mx.array_equal(got, want)  # the twin itself
    assert launches == [2, 3, 3]  # the first use's self-check (2 launches), then M = 4 only
    assert qmm.report() in (
        "ok",
        "not applicable (no Metal GPU; the CPU backend has its own few-row kernel)",
    )
    assert metal_kernel.report() == {qmm.KERNEL.name: "ok"}


def test_off_metal_and_with_reference_kernels_the_twin_runs(monkeypatch):
    x, w, s, b = _case(8, 128, 8, 4, 64, mx.bfloat16)
    assert mx.array_equal(qmm.qmm(x, w, s, b, 64, 4), qmm.qmm_ops(x, w, s, b, 64, 4))
    monkeypatch.setattr(metal_kernel, "_metal_available", True)
    monkeypatch.setenv(metal_kernel.REFERENCE_ENV, "1")
    assert not metal_kernel.use_metal()
    assert qmm.report().startswith(("not applicable", "off"))


def test_a_kernel_that_fails_its_check_warns_once_and_the_twin_runs(
    fake_metal, monkeypatch, capsys
):
    monkeypatch.setattr(metal_kernel, "factory", lambda **kw: _WrongNumbers())
    x, w, s, b = _case(8, 128, 8, 8, 32, mx.float16)
    for _ in range(2):
        assert mx.array_equal(qmm.qmm(x, w, s, b, 32, 8), qmm.qmm_ops(x, w, s, b, 32, 8))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: the few_row_qmm Metal kernel failed")
    assert metal_kernel.report()[qmm.KERNEL.name].startswith("failed: 4-bit")


class _WrongNumbers:
    def __call__(self, *, output_shapes, output_dtypes, **kw):
        return [mx.ones(sh, dtype=d) for sh, d in zip(output_shapes, output_dtypes, strict=True)]


def test_a_wrapped_quantized_linear_uses_the_kernel_for_a_verify_and_mlx_for_one_row(fake_metal):
    from mlx import nn

    block = nn.Sequential(nn.Linear(64, 32, bias=True), nn.Linear(32, 16, bias=False))
    nn.quantize(block, group_size=32, bits=4)
    x = mx.random.normal((1, 5, 64), key=mx.random.key(2))
    want_rows, want_one = block(x), block(x[:, :1])
    assert qmm.wrap_tree(block) == 2 and qmm.wrap_tree(block) == 0  # idempotent
    assert all(isinstance(layer, qmm.FewRowLinear) for layer in block.layers)
    np.testing.assert_allclose(np.array(block(x)), np.array(want_rows), rtol=1e-4, atol=1e-4)
    assert mx.array_equal(block(x[:, :1]), want_one)  # one row: MLX's own kernel, same bits
    assert metal_kernel._cache[qmm.KERNEL.name].calls > 2


def test_prepare_target_wraps_quantized_projections_only_on_a_metal_gpu(monkeypatch):
    from mlx import nn

    monkeypatch.setattr(ops, "prepare_target", ops._DEFAULTS["prepare_target"])
    layers = [nn.QuantizedLinear(64, 64, group_size=64, bits=4) for _ in range(2)]
    holder = [nn.Sequential(layer) for layer in layers]
    assert ops.prepare_target(holder) == 0  # Linux: nothing changes
    monkeypatch.setattr(qmm, "on_metal", lambda: True)
    assert ops.prepare_target(holder) == 2
    assert all(isinstance(h.layers[0], qmm.FewRowLinear) for h in holder)


def test_with_reference_kernels_a_wrapped_target_gives_mlxs_bits(monkeypatch):
    """DFLASH_MLX_REFERENCE_KERNELS=1 on a Mac: the wrapper runs MLX's own quantized_matmul,
    so a verify's logits keep their bits (greedy parity and sampling law unchanged)."""
    from mlx import nn

    monkeypatch.setattr(metal_kernel, "_metal_available", True)
    monkeypatch.setenv(metal_kernel.REFERENCE_ENV, "1")
    block = nn.Sequential(nn.Linear(128, 64, bias=True), nn.Linear(64, 32, bias=False))
    nn.quantize(block, group_size=64, bits=8)
    x = mx.random.normal((1, 6, 128), key=mx.random.key(4)).astype(mx.bfloat16)
    want = block(x)
    assert qmm.wrap_tree(block) == 2
    assert mx.array_equal(block(x), want)


def test_mlx_keeps_the_shapes_where_it_is_faster(fake_metal, monkeypatch):
    """Never slower than MLX: a shape whose timing MLX wins goes to MLX's qmm."""
    x, w, s, b = _case(8, 128, 8, 4, 64, mx.float32)
    timed = []

    def timer(kind, fn):
        mx.eval(fn())  # both thunks run the product
        timed.append(kind)
        return 1.0 if kind == "kernel" else 0.5  # MLX wins

    monkeypatch.setattr(qmm_choice, "CHOOSER", qmm_choice.Chooser(timer=timer))
    got = qmm.qmm(x, w, s, b, 64, 4)
    assert mx.array_equal(got, qmm.qmm_ops(x, w, s, b, 64, 4))  # MLX's own bits
    assert qmm_choice.CHOOSER.table == {qmm_choice.shape_key(x, w, 64, 4): False}
    qmm.qmm(x, w, s, b, 64, 4)
    assert timed == ["kernel", "mlx"]  # timed once per shape


def _quantized_target(tied: bool):
    """A tiny qwen3 target, 4-bit group 32, its head a QuantizedLinear or (tied) the
    QuantizedEmbedding's ``as_linear``."""
    from mlx import nn
    from mlx_lm.utils import _get_classes
    from tiny_models import target_config

    cfg = {**target_config("qwen3", 96, hidden=64, layers=2), "tie_word_embeddings": tied}
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(3)
    model = model_cls(args_cls.from_dict(cfg))
    nn.quantize(model, group_size=32, bits=4)
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_a_verify_head_takes_the_kernel_for_2_to_16_rows_and_mlx_for_one_row(
    fake_metal, monkeypatch, tied
):
    from dflash_mlx.model.draft_vocab import DraftHead
    from dflash_mlx.model.target import TargetAdapter

    model = _quantized_target(tied)
    monkeypatch.setattr(ops, "prepare_target", lambda layers: 0)  # the head alone
    head = (lambda h: model.model.embed_tokens.as_linear(h)) if tied else model.lm_head
    ids = mx.array([[5, 9, 2, 40, 7]])
    h = mx.random.normal((1, 5, 64), key=mx.random.key(6))
    want, want_one, want_logits = head(h), head(h[:, :1]), model(ids)
    embeds = model.model.embed_tokens(ids)
    TargetAdapter(model, [0])  # off Metal: nothing changes
    assert type(model.model.embed_tokens).__name__ == "QuantizedEmbedding"
    assert tied or type(model.lm_head).__name__ == "QuantizedLinear"
    widths = []
    launch = qmm.qmm_kernel

    def spy(kernel, x, w, *rest):
        widths.append(w.shape[0])
        return launch(kernel, x, w, *rest)

    monkeypatch.setattr(qmm, "qmm_kernel", spy)
    monkeypatch.setattr(qmm, "on_metal", lambda: True)
    TargetAdapter(model, [0])
    adapter = TargetAdapter(model, [0])  # a second adapter wraps nothing twice
    wrapped = model.model.embed_tokens if tied else model.lm_head
    assert isinstance(wrapped, qmm.FewRowEmbedding if tied else qmm.FewRowLinear)
    assert type(wrapped.inner).__name__ in ("QuantizedEmbedding", "QuantizedLinear")
    np.testing.assert_allclose(np.array(adapter.lm_head(h)), np.array(want), rtol=1e-4, atol=1e-4)
    assert widths.count(96) == 1  # the 5-row head went through the kernel
    assert mx.array_equal(adapter.lm_head(h[:, :1]), want_one)  # one row: MLX's own bits
    assert widths.count(96) == 1
    logits, _ = adapter(ids, adapter.make_cache())  # a verify forward: the model's own head
    np.testing.assert_allclose(np.array(logits), np.array(want_logits), rtol=1e-4, atol=1e-4)
    assert widths.count(96) == 2
    assert mx.array_equal(adapter.embed(ids), embeds)  # token lookups are the inner's
    assert DraftHead(adapter, np.arange(10))._quant is not None  # it still sees the quantized head


SMALL = ((256, 8), (128, 12))  # (K, N): the emulator is slow; doctor's shapes are larger
ROWS = r"verify rows = plain rows: (yes|no \(max diff \S+\))"


class _RowByRow:
    """A stand-in kernel computing each row alone with MLX's one-row quantized matmul."""

    def __call__(self, *, inputs, template, **kw):
        x, w, s, b = inputs
        t = dict(template)
        one = [qmm.qmm_ops(x[i : i + 1], w, s, b, t["GS"], t["BITS"]) for i in range(len(x))]
        return [mx.concatenate(one)]


def test_rows_match_says_yes_for_rows_reduced_alone_and_no_for_a_broken_body():
    assert qmm.rows_match(_RowByRow(), SMALL) == "verify rows = plain rows: yes"
    # here MLX's CPU qmm is the plain row: the emulated body gets whichever answer is true
    assert re.fullmatch(ROWS, qmm.rows_match(_emulated(), SMALL))
    body = metal_kernel.source(qmm.KERNEL.name)
    store = "static_cast<T>(total)"
    assert store in body
    broken = body.replace(store, "static_cast<T>(1.01f * total)")
    line = qmm.rows_match(_emulated(broken), SMALL)
    assert re.fullmatch(ROWS, line) and line.startswith("verify rows = plain rows: no")


def test_doctor_says_whether_verify_rows_equal_plain_rows(fake_metal, monkeypatch):
    from dflash_mlx import doctor

    monkeypatch.setattr(qmm, "ROW_SHAPES", SMALL)
    monkeypatch.setattr(metal_kernel, "factory", lambda **kw: _RowByRow())
    line = doctor.metal_kernels().value
    assert "few_row_qmm ok" in line and line.endswith("; verify rows = plain rows: yes")
    monkeypatch.setattr(qmm, "qmm_kernel", _raises)
    line = doctor.metal_kernels().value
    assert line.endswith("; verify rows = plain rows: not checked (RuntimeError: no launch)")
    monkeypatch.setattr(metal_kernel, "use_metal", lambda: False)
    monkeypatch.setattr(doctor, "_is_mac", lambda: False)
    line = doctor.metal_kernels().value
    assert line.endswith("verify rows = plain rows: the check needs a Mac")


def _raises(*args):
    raise RuntimeError("no launch")
