"""The compiled drafter step (CPU backend) gives the bits of the uncompiled one, for every
block width, with and without DFlash 2's conv, windowed or not, and sees weight updates."""

import mlx.core as mx
import pytest

from dflash_mlx.cpu import draft_step
from dflash_mlx.model.checkpoint import drafter_config, random_drafter

H, NT = 64, 2


def make(dflash2=True, window=2048, taps=2):
    cfg = drafter_config(
        hidden_size=H,
        vocab_size=300,
        num_target_layers=4,
        target_layer_ids=[0, 2],
        mask_token_id=1,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        dflash2=dflash2,
        sliding_window=window,
        conv_kernel_size=taps,
        selector_rank=8,
    )
    d = random_drafter(cfg, seed=3)
    cache = d.make_cache()
    d.append_context(mx.random.normal((1, 30, NT * H), key=mx.random.key(0)), cache)
    return d, cache


@pytest.mark.parametrize(
    "dflash2,window,taps", [(True, 2048, 2), (True, None, 2), (False, 2048, 2), (True, 2048, 3)]
)
def test_compiled_step_gives_the_uncompiled_bits_at_every_width(dflash2, window, taps):
    d, cache = make(dflash2, window, taps)
    with mx.stream(mx.cpu):
        for L in (2, 5, 8, 3):
            emb = mx.random.normal((1, L, H), key=mx.random.key(L))
            ref = d.step(emb, cache)
            out = draft_step.step(d, emb, cache, compiled=True)
            assert out.shape == (1, L, H)
            assert mx.array_equal(out, ref).item(), (L, mx.abs(out - ref).max().item())
            assert cache[0].offset == 30 and cache[0].size == 30  # block rows not kept


def test_compiled_step_sees_new_weights():
    d, cache = make()
    emb = mx.random.normal((1, 4, H), key=mx.random.key(9))
    with mx.stream(mx.cpu):
        before = draft_step.step(d, emb, cache, compiled=True)
        mlp = d.layers[0].mlp
        mlp.down_proj.weight = mlp.down_proj.weight * 2.0
        after = draft_step.step(d, emb, cache, compiled=True)
        assert not mx.array_equal(before, after).item()
        assert mx.array_equal(after, d.step(emb, cache)).item()


def test_only_the_cpu_backend_compiles_by_default(monkeypatch):
    d, cache = make()
    emb = mx.random.normal((1, 4, H), key=mx.random.key(1))
    monkeypatch.setattr(draft_step.fastmath, "on_cpu", lambda: False)
    draft_step.step(d, emb, cache)
    assert getattr(d, "_compiled_step", None) is None  # a GPU keeps the uncompiled twin
    monkeypatch.setattr(draft_step.fastmath, "on_cpu", lambda: True)
    draft_step.step(d, emb, cache)
    assert isinstance(d._compiled_step, draft_step.CompiledStep)
