"""Exact 16-bit weights in the few-row kernel (half_weights.py, small_gemm.register): the
same bits as the float32 product, at half the bytes, and nothing registered that would
round."""

import sys

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx.cpu import half_weights, small_gemm

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not small_gemm.has_kernel(),
    reason="the few-row kernel is loaded on Linux with a C compiler",
)


def rounded(a: np.ndarray, kind: str) -> np.ndarray:
    if kind == "bf16":
        return ((a.view(np.uint32) >> 16) << 16).view(np.float32)
    return a.astype(np.float16).astype(np.float32)


def test_exact_words_tell_bfloat16_float16_and_neither():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((5, 7)).astype(np.float32)
    words, kind = small_gemm.exact_words(rounded(a, "bf16"))
    assert kind == small_gemm.BF16 and words.dtype == np.uint16
    assert np.array_equal((words.astype(np.uint32) << 16).view(np.float32), rounded(a, "bf16"))
    words, kind = small_gemm.exact_words(rounded(a, "f16"))
    assert kind == small_gemm.F16
    assert np.array_equal(words.view(np.float16).astype(np.float32), rounded(a, "f16"))
    assert small_gemm.exact_words(a) is None  # full float32 precision: never rounded


@pytest.mark.parametrize("kind", ["bf16", "f16"])
@pytest.mark.parametrize("n,k", [(300, 64), (520, 576), (33, 37), (1536, 100)])
def test_registered_weights_give_the_same_bits_from_their_words(kind, n, k):
    rng = np.random.default_rng(n + k)
    w = mx.array(rounded(rng.standard_normal((n, k)).astype(np.float32), kind))
    assert half_weights.register([w]) == 1
    for m in (1, 3, 8, 16):
        x = mx.array(rng.standard_normal((m, k)).astype(np.float32))
        before = small_gemm.half_calls()
        fast = np.array(x @ w.T)
        assert small_gemm.half_calls() > before, "the product did not read the words"
        small_gemm.use_halves(False)
        try:
            plain = np.array(x @ w.T)
        finally:
            small_gemm.use_halves(True)
        assert np.array_equal(fast, plain), (m, n, k)


def test_inexact_or_non_weight_arrays_are_not_registered():
    rng = np.random.default_rng(3)
    full = mx.array(rng.standard_normal((64, 32)).astype(np.float32))
    vec = mx.array(rounded(rng.standard_normal((64,)).astype(np.float32), "bf16"))
    half = mx.array(rng.standard_normal((64, 32)).astype(np.float32)).astype(mx.float16)
    assert half_weights.register([full, vec, half]) == 0
    x = mx.array(rng.standard_normal((4, 32)).astype(np.float32))
    before = small_gemm.half_calls()
    mx.eval(x @ full.T)
    assert small_gemm.half_calls() == before


def test_loading_registers_a_bfloat16_drafter_and_decoding_reads_it(pairs):
    """Drafter checkpoints are stored in bfloat16: every matrix of the loaded drafter is
    registered, and a decode's drafter products read the words."""
    from dflash_mlx.cpu import draft_step
    from dflash_mlx.decoding.acceptance import SamplingParams
    from dflash_mlx.decoding.steps import prefill

    model, _ = pairs("qwen3", "d2")
    assert half_weights.register_drafter(model) > 0  # already registered: counted again
    cache = model.make_cache()
    prefill(model, list(range(3, 40)), cache, SamplingParams(), mx.random.key(0))
    emb = model.embed_block(mx.array([5], mx.uint32), 8)
    before = small_gemm.half_calls()
    fast = np.array(draft_step.step(model.drafter, emb, cache.drafter))
    assert small_gemm.half_calls() > before
    small_gemm.use_halves(False)
    try:
        plain = np.array(draft_step.step(model.drafter, emb, cache.drafter))
    finally:
        small_gemm.use_halves(True)
    assert np.array_equal(fast, plain)
