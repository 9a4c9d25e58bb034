"""Target adapter: layer capture and exact rollback of hybrid (Gated DeltaNet) state."""

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn
from mlx_lm.models.cache import ArraysCache, make_prompt_cache
from oracle import OracleDrafter
from references import reference

from dflash_mlx.decoding.acceptance import SamplingParams
from dflash_mlx.decoding.loop import DecodeOptions, decode
from dflash_mlx.decoding.steps import prefill
from dflash_mlx.errors import UnsupportedModelError
from dflash_mlx.model.target import TargetAdapter


def test_captured_features_are_the_tapped_layer_outputs(pairs):
    model, tok = pairs("qwen3", "d2")
    ids = mx.array(tok.encode("def parse_args("))[None]
    logits, feats = model.adapter(ids, model.adapter.make_cache())
    inner = model.target.model
    h = inner.embed_tokens(ids)
    outs = []
    for layer in inner.layers:
        h = layer(h, "causal", None)
        outs.append(h)
    want = mx.concatenate([outs[i] for i in model.drafter.args.target_layer_ids], axis=-1)
    assert feats.shape == (1, ids.shape[1], 2 * 64)
    assert mx.allclose(feats, want, atol=1e-5)
    assert mx.allclose(logits, model.target(ids), atol=1e-5)


@pytest.mark.parametrize("wrong", [(2,), (5,), (1, 4)])
def test_hybrid_state_after_every_cycle_equals_decoding_only_committed_tokens(pairs, wrong):
    model, tok = pairs("qwen3_5", "d2")
    ids = tok.encode("import os\nfor i in")
    ref = reference(model, ids, 60)
    cache = model.make_cache()
    shadow = make_prompt_cache(model.target)  # fed only the committed tokens
    fed = 0
    real = model.drafter
    model.drafter = OracleDrafter(real, ids + ref, wrong_at=wrong)
    partial = 0
    try:
        for c in decode(
            model, ids, cache, SamplingParams(), DecodeOptions(max_tokens=48, block_size=8)
        ):
            new = cache.tokens[fed:]
            model.target(mx.array(new)[None], cache=shadow)
            fed = len(cache.tokens)
            partial += 0 < c.accepted < c.drafted
            n_checked = 0
            for mine, theirs in zip(cache.target, shadow):
                if isinstance(mine, ArraysCache):
                    for a, b in zip(mine.cache, theirs.cache):
                        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)
                        n_checked += 1
                else:
                    assert mine.offset == theirs.offset
            assert n_checked == 4  # two recurrent layers x (conv state, recurrent state)
    finally:
        model.drafter = real
    assert partial > 3 if min(wrong) > 1 else partial == 0


def test_unsupported_architecture_is_named():
    class Fake:
        model_type = "mamba"
        model = None

    with pytest.raises(UnsupportedModelError, match="'mamba' is not supported"):
        TargetAdapter(Fake(), [0])


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_compiled_target_modules_give_mlx_lms_bits(tiny_dir, kind):
    """On the CPU the adapter compiles RoPE, the RMSNorms and the MLP of every layer; the
    target's logits stay the bits of the untouched mlx-lm model, prefill and decode steps."""
    from mlx_lm.utils import load as mlx_lm_load

    from dflash_mlx.cpu import target as cpu_target

    plain, _ = mlx_lm_load(str(tiny_dir / kind))
    wrapped, _ = mlx_lm_load(str(tiny_dir / kind))
    with mx.stream(mx.cpu):
        n = cpu_target.compile_layers(wrapped.model.layers)
        assert n >= 2 * len(wrapped.model.layers)  # the norms at least; RoPE where there is one
        ids = mx.array([[5, 17, 3, 99, 42, 7, 11, 64, 2]])
        c_plain, c_wrapped = make_prompt_cache(plain), make_prompt_cache(wrapped)
        for chunk in (ids, ids[:, :1], ids[:, 1:9], ids[:, 4:5]):  # prefill, 1 row, 8 rows
            a, b = plain(chunk, cache=c_plain), wrapped(chunk, cache=c_wrapped)
            assert mx.array_equal(a, b).item(), mx.abs(a - b).max().item()
        wrapped.model.layers[0].input_layernorm.inner.weight *= 2.0  # updates are seen
        plain.model.layers[0].input_layernorm.weight *= 2.0
        assert mx.array_equal(plain(ids), wrapped(ids)).item()


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_last_row_head_gives_the_last_row_of_the_full_logits(pairs, kind):
    model, tok = pairs(kind, "d2")
    adapter = model.adapter
    assert adapter.last_only
    ids = mx.array(tok.encode("def parse_args(argv):\n    parser = "))[None]
    full, f_full = adapter(ids, adapter.make_cache())
    last, f_last = adapter(ids, adapter.make_cache(), last=True)
    assert last.shape == (1, 1, full.shape[-1])
    assert mx.allclose(last[:, 0], full[:, -1], atol=1e-5).item()
    assert mx.argmax(last[:, 0]).item() == mx.argmax(full[:, -1]).item()
    assert mx.array_equal(f_last, f_full).item()  # the features are every row's
    again, _ = adapter(ids, adapter.make_cache())  # the flag lasts one forward
    assert again.shape == full.shape


class _Spy(nn.Module):
    """The target's final norm, recording how many rows each call passes to the head."""

    def __init__(self, norm, rows):
        super().__init__()
        self.norm = norm
        object.__setattr__(self, "rows", rows)

    def __call__(self, x):
        self.rows.append(x.shape[1])
        return self.norm(x)


def test_prefill_runs_the_head_on_the_last_prompt_row_only(pairs):
    """A 600-token prompt in three chunks: no chunk builds a [chunk, vocab] product."""
    model = pairs("qwen3", "d2")[0]
    prompt = [5 + (i * 7) % 300 for i in range(600)]
    rows: list[int] = []
    last_row = model.adapter.inner.norm  # the head multiplies what the final norm returns
    norm = last_row.inner
    last_row.inner = _Spy(norm, rows)
    try:
        cycle, _ = prefill(model, prompt, model.make_cache(), SamplingParams(), mx.random.key(0))
    finally:
        last_row.inner = norm
    assert rows == [1, 1, 1]
    want = model.target(mx.array(prompt)[None])[0, -1]
    assert cycle.tokens == [mx.argmax(want).item()]
