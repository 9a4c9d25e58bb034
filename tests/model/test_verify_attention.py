"""A verify's attention in row chunks (model/verify_attention.py) equals the unchunked one:
causal masks, tree masks and quantized KV included, and wrapped attention modules of every
known family give their module's outputs. Pure MLX on the CPU (the fused kernel the chunks
keep exists on Metal only)."""

import copy
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import base
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import _get_classes
from tiny_models import target_config

from dflash_mlx import ops
from dflash_mlx.model import verify_attention as va
from dflash_mlx.model.target import TargetAdapter

SDPA = base.scaled_dot_product_attention


def _qkv(L=8, S=40, hq=6, hkv=1, D=64, seed=0):
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((1, hq, L, D), key=k1)  # [B, Hq, L, D]
    k = mx.random.normal((1, hkv, S, D), key=k2)  # [B, Hkv, S, D]
    v = mx.random.normal((1, hkv, S, D), key=k3)
    return q, k, v


def _tree_mask(L, S, seed=1):
    """A tree-like bool mask [L, S]: every row sees the context, itself and a random set of
    earlier block rows."""
    rng = np.random.default_rng(seed)
    block = np.tril(rng.random((L, L)) < 0.5) | np.eye(L, dtype=bool)
    return mx.array(np.concatenate([np.ones((L, S - L), bool), block], axis=1))


def test_fused_rows_keeps_rows_times_gqa_within_32_and_at_most_8():
    assert va.fused_rows(32, 8) == 8  # GQA 4: an 8-row verify fits one call
    assert va.fused_rows(24, 4) == 5  # GQA 6: 5 rows (25 <= 32)
    assert va.fused_rows(14, 2) == 4  # GQA 7
    assert va.fused_rows(16, 16) == 8  # no GQA: still at most 8 rows
    assert va.fused_rows(64, 1) == 1  # GQA 64: no row count fits; one row per call


@pytest.mark.parametrize("rows", [1, 3, 5])
@pytest.mark.parametrize("mask", ["causal", "tree", "additive", None])
def test_chunked_attention_equals_unchunked(rows, mask):
    q, k, v = _qkv()
    m = {"causal": "causal", "tree": _tree_mask(8, 40), None: None}.get(mask)
    if mask == "additive":
        m = mx.where(_tree_mask(8, 40, seed=2), 0.0, -1e9)[None, None]  # [1, 1, L, S]
    want = SDPA(q, k, v, cache=None, scale=0.125, mask=m)
    got = va.chunked_sdpa(SDPA, q, k, v, None, 0.125, m, rows)
    assert got.shape == want.shape == (1, 6, 8, 64)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("mask", ["causal", "tree"])
def test_chunked_attention_equals_unchunked_on_quantized_keys(bits, mask):
    q, k, v = _qkv(seed=3)
    cache = SimpleNamespace(bits=bits, group_size=32)  # mlx-lm's quantized path
    qk, qv = mx.quantize(k, 32, bits), mx.quantize(v, 32, bits)  # (data, scales, biases)
    m = "causal" if mask == "causal" else _tree_mask(8, 40, seed=4)
    got = va.chunked_sdpa(SDPA, q, qk, qv, cache, 0.125, m, 3)
    want = SDPA(q, qk, qv, cache=cache, scale=0.125, mask=m)  # scales q in place: last
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)


def _model(kind: str):
    cfg = target_config(kind if kind != "llama" and kind != "qwen2" else "qwen3", 97)
    cfg["model_type"] = kind
    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    mx.eval(model.parameters())
    return model


def _attns(model):
    return [la.self_attn for la in model.layers if hasattr(la, "self_attn")]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "qwen3_next"])
def test_wrapped_family_gives_its_modules_outputs_over_a_verify(kind, monkeypatch):
    """Prefill 12 tokens, then an 8-row verify on the cache: the model with its attention
    in 2-row chunks gives the plain model's logits, and every attention layer was wrapped
    and ran in chunks."""
    chunk_calls = []
    real = va.chunked_sdpa
    monkeypatch.setattr(va, "chunked_sdpa", lambda *a: chunk_calls.append(a[-1]) or real(*a))
    plain = _model(kind)
    chunked = copy.deepcopy(plain)
    n = va.wrap_layers(chunked.layers, rows=2)
    assert n == len(_attns(plain)) > 0
    assert all(isinstance(a, va.ChunkedAttention) for a in _attns(chunked))
    chunk_calls.clear()  # the wrap-time probes ran unchunked
    prompt = mx.array([[5, 9, 13, 2, 7, 44, 81, 3, 19, 23, 60, 11]])
    block = mx.array([[8, 16, 31, 4, 4, 90, 12, 1]])
    outs = []
    for model in (plain, chunked):
        cache = make_prompt_cache(model)
        model(prompt, cache=cache)
        outs.append(np.array(model(block, cache=cache)))
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    assert chunk_calls == [2] * (2 * n)  # each layer: the prefill and the verify


def test_a_tree_verify_through_the_adapter_equals_the_unchunked_one():
    """The adapter's tree mask and per-row positions reach the chunked attention."""
    plain = _model("qwen3")
    chunked = copy.deepcopy(plain)
    adapters = [TargetAdapter(m, [1, 3]) for m in (plain, chunked)]
    assert va.wrap_layers(adapters[1].inner.layers, rows=3) == 4
    assert all(a.tree_ok for a in adapters)
    prompt = mx.array([[5, 9, 13, 2, 7, 44, 81, 3, 19, 23]])
    tree_ids = mx.array([[8, 16, 31, 4, 70, 71, 72]])  # a chain of 4, then 3 siblings
    outs = []
    for adapter in adapters:
        cache = adapter.make_cache()
        adapter(prompt, cache)
        logits, feats = adapter(tree_ids, cache, chain=4)
        outs.append((np.array(logits), np.array(feats)))
    for got, want in zip(outs[1], outs[0]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_one_row_and_short_calls_run_the_module_itself():
    model = _model("qwen3")
    (attn, *_) = _attns(model)
    wrapped = va.wrap(attn, rows=4)
    calls = []
    wrapped.forward = lambda *a: calls.append(a)  # instance attribute: the chunked path
    x = mx.random.normal((1, 4, 64))
    assert mx.array_equal(wrapped(x, mask="causal"), attn(x, mask="causal"))
    assert not calls


def test_past_8_rows_a_head_dim_of_the_full_kernel_runs_the_module_itself():
    """At head dim 64 (GQA 6) a 16-row call is one fused full-kernel call on Metal: not
    split; an 8-row one is (into 5 + 3 rows)."""
    cfg = target_config("qwen3", 97, hidden=384)
    cfg.update(num_attention_heads=6, num_key_value_heads=1, head_dim=64)
    model_cls, args_cls = _get_classes(cfg)
    attn = model_cls(args_cls.from_dict(cfg)).layers[0].self_attn
    wrapped = va.wrap(attn)
    assert wrapped is not None and wrapped.rows == 5
    calls = []
    wrapped.forward = lambda x, mask, cache, rows: calls.append((x.shape[1], rows))
    wrapped(mx.zeros((1, 16, 384)), mask="causal")
    wrapped(mx.zeros((1, 8, 384)), mask="causal")
    assert calls == [(8, 5)]


def test_default_wrapping_skips_what_one_fused_call_already_takes():
    """GQA 2 with head dim 16 (the tiny model): no fused kernel at that head dim, nothing
    wrapped; an unknown class is never wrapped, whatever the rows."""
    model = _model("qwen3")
    assert va.wrap_layers(model.layers) == 0
    assert va.wrap(model.layers[0].mlp, rows=2) is None


def test_plain_mlx_prepare_target_wraps_only_on_a_metal_gpu(monkeypatch):
    monkeypatch.setattr(va, "wrap_layers", lambda layers, rows=None: 7)
    monkeypatch.setattr(ops, "prepare_target", ops._DEFAULTS["prepare_target"])
    monkeypatch.setattr(va, "enabled", lambda: False)
    assert ops.prepare_target([]) == 0
    monkeypatch.setattr(va, "enabled", lambda: True)
    assert ops.prepare_target([]) == 7
    monkeypatch.undo()
    monkeypatch.setattr(va, "_on_metal", lambda: True)
    assert va.enabled()
    monkeypatch.setenv(va.ENV, "0")
    assert not va.enabled()
    monkeypatch.setattr(va, "_on_metal", lambda: False)
    monkeypatch.delenv(va.ENV)
    assert not va.enabled()  # the CPU: no fused kernel to keep
