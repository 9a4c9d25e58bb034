"""The compiled drafter step (CPU backend) gives the bits of the uncompiled one, for every
block width, with and without DFlash 2's conv, windowed or not, and sees weight updates."""

import io

import mlx.core as mx
import pytest

from dflash_mlx.cpu import draft_step, exact_ops
from dflash_mlx.model.checkpoint import drafter_config, random_drafter

H, NT = 64, 2


def make(dflash2=True, window=2048, taps=2, layers=2, rope_scaling=None):
    cfg = drafter_config(
        hidden_size=H,
        vocab_size=300,
        num_target_layers=4,
        target_layer_ids=[0, 2],
        mask_token_id=1,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        dflash2=dflash2,
        sliding_window=window,
        conv_kernel_size=taps,
        selector_rank=8,
    )
    cfg["rope_scaling"] = rope_scaling
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
    assert d._compiled_step._table.rope is not None  # the shared RoPE table's path
    if dflash2 and taps == 2 and exact_ops.load() is not None:  # the exact kernels ran
        graph = io.StringIO()
        mx.export_to_dot(graph, draft_step.step(d, emb, cache, compiled=True))
        assert all(n in graph.getvalue() for n in ("DflashTwoTap", "DflashRmsNorm"))


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}
LLAMA3 |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("layers,scaling", [(1, None), (3, LLAMA3)])
def test_compiled_step_gives_the_uncompiled_bits_for_any_depth_and_rope(layers, scaling):
    # one layer (no stage between two), three (two between), and a RoPE that is not
    # nn.RoPE (no shared table: each layer's own RoPE), with new rows projected in the pass
    d, cache = make(layers=layers, rope_scaling=scaling)
    _, eager = make(layers=layers, rope_scaling=scaling)
    f = mx.random.normal((1, 2, NT * H), key=mx.random.key(2))
    d.append_context(f, cache)
    d.append_context(f, eager, lazy=False)
    with mx.stream(mx.cpu):
        for L in (8, 3):
            emb = mx.random.normal((1, L, H), key=mx.random.key(L))
            out = draft_step.step(d, emb, cache, compiled=True)
            assert mx.array_equal(out, d.step(emb, eager)).item(), L
    assert (d._compiled_step._table.rope is None) == (scaling is not None)


def test_a_bfloat16_drafter_takes_the_ops_where_the_kernels_take_float32_only():
    # as `dflash doctor`'s tiny pair loads it (a bfloat16 checkpoint): same bits, no error
    d, cache = make()
    d.set_dtype(mx.bfloat16)
    _, eager = make()  # the same context, for the uncompiled step
    with mx.stream(mx.cpu):
        for L in (8, 3):
            emb = mx.random.normal((1, L, H), key=mx.random.key(L))
            out = draft_step.step(d, emb, cache, compiled=True)
            assert mx.array_equal(out, d.step(emb, eager)).item(), L


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


def held(cache):
    return [(c.offset, c.size, *c.held()) for c in cache]


@pytest.mark.parametrize("dflash2,window", [(True, 6), (True, None), (False, 6)])
def test_new_context_rows_projected_with_the_block_give_the_flushed_bits(dflash2, window):
    # n pending rows go through the block's projection when n + L fit the few-row kernel
    # (n + L > 16 flushes first); the hidden states and the rows kept are the eager bits
    with mx.stream(mx.cpu):
        for n, L in ((1, 8), (3, 4), (8, 8), (12, 8)):
            d, folded = make(dflash2, window)
            _, eager = make(dflash2, window)
            f = mx.random.normal((1, n, NT * H), key=mx.random.key(n))
            emb = mx.random.normal((1, L, H), key=mx.random.key(L))
            d.append_context(f, folded)
            d.append_context(f, eager, lazy=False)
            out = draft_step.step(d, emb, folded, compiled=True)
            ref = draft_step.step(d, emb, eager, compiled=True)
            assert mx.array_equal(out, ref).item(), (n, L, mx.abs(out - ref).max().item())
            assert not folded[0].pending and folded[0].offset == 30 + n
            for a, b in zip(held(folded), held(eager)):
                assert a[:2] == b[:2] and all(mx.array_equal(x, y).item() for x, y in zip(a, b))
            again = mx.random.normal((1, L, H), key=mx.random.key(99))  # the next draft too
            out = draft_step.step(d, again, folded, compiled=True)
            assert mx.array_equal(out, draft_step.step(d, again, eager, compiled=True)).item()


@pytest.mark.parametrize(
    "kind,block,temp", [("qwen3", 8, 0.0), ("qwen3_5", 6, 0.0), ("qwen3", 8, 1.0)]
)
def test_decoding_drafts_the_same_with_the_append_in_the_draft_pass(
    pairs, monkeypatch, kind, block, temp
):
    # every draft's hidden states (so every drafted token) and the text, with the kept rows'
    # K/V projected in the next draft's pass against appending them right after the verify
    from dflash_mlx import ops, stream_generate

    model, tok = pairs(kind)
    real = ops.draft_step

    def run(append):
        monkeypatch.setattr(ops, "append_context", append)
        seen = []

        def record(drafter, emb, cache):
            seen.append((cache[0].offset, cache[0].pending_rows, real(drafter, emb, cache)))
            return seen[-1][2]

        monkeypatch.setattr(ops, "draft_step", record)
        rs = stream_generate(
            model,
            tok,
            "def parse_args(argv):",
            raw=True,
            max_tokens=24,
            block_size=block,
            temperature=temp,
            seed=3,
            lookup=False,
        )
        toks = [t for r in rs for t in r.tokens]
        return toks, seen

    toks, folded = run(draft_step.append_context)
    ref_toks, eager = run(lambda d, f, c: d.append_context(f, c, lazy=False))
    assert toks == ref_toks and len(folded) == len(eager) > 3
    # the prefill leaves the prompt's rows pending either way; then only the fold does
    assert sum(p > 0 for _, p, _ in folded) > sum(p > 0 for _, p, _ in eager) == 1
    for (o, p, h), (o2, p2, h2) in zip(folded, eager):
        assert o + p == o2 + p2 and mx.array_equal(h, h2).item()


def test_bench_times_the_convs_the_compiled_step_runs():
    # bench's conv share times the compiled step's convs (the exact kernel on the CPU),
    # which give the module's conv values
    from dflash_mlx.bench.runner import conv_seconds

    d, cache = make()
    x = mx.random.normal((1, 6, H), key=mx.random.key(4))
    with mx.stream(mx.cpu):
        draft_step.step(d, x, cache, compiled=True)
        got = d._compiled_step.convs(x)
        want = []
        for layer in d.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                u, d1 = conv.prepare(x, 6)
                want.append(conv.finish(u, d1, 6))
        assert len(got) == 4 and all(mx.array_equal(a, b).item() for a, b in zip(got, want))
        assert conv_seconds(d, 6, reps=2) > 0
