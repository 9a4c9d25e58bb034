"""Other target kinds: soft-capped sliding-window muse_glimmer, tied and quantized heads."""

import json

import mlx.core as mx
import pytest
from mlx import nn
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from oracle import OracleDrafter
from tiny_models import build_drafter, build_target

from dflash_mlx import load
from dflash_mlx.decoding.acceptance import SamplingParams
from dflash_mlx.decoding.loop import DecodeOptions, decode


def parity(model, ids, n=64, block=8, wrong=(4,)):
    ref = [t for t, _ in generate_step(mx.array(ids), model.target, max_tokens=n)]
    real = model.drafter
    model.drafter = OracleDrafter(real, ids + ref + [0] * 20, wrong_at=wrong)
    try:
        out, acc = [], 0
        for c in decode(
            model,
            ids,
            model.make_cache(),
            SamplingParams(),
            DecodeOptions(max_tokens=n, block_size=block),
        ):
            out += c.tokens
            acc += c.accepted
    finally:
        model.drafter = real
    assert out == ref
    assert acc > 0
    return ref


def test_muse_glimmer_past_its_sliding_window(tmp_path):
    build_target(tmp_path / "t", "muse_glimmer")
    build_drafter(
        tmp_path / "d",
        tmp_path / "t",
        block_size=8,
        output_multiplier=0.2,
        final_logit_softcapping=20.0,
    )
    model, tok = load(str(tmp_path / "t"), drafter=str(tmp_path / "d"))
    ids = tok.encode("def parse_args(argv):\n")
    assert len(ids) + 64 > 3 * 8  # well past the 8-token window
    parity(model, ids)


def test_tied_embedding_target_lends_its_embedding_as_head(tmp_path):
    build_target(tmp_path / "t", "qwen3")
    cfg = json.loads((tmp_path / "t" / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (tmp_path / "t" / "config.json").write_text(json.dumps(cfg))
    w = mx.load(str(tmp_path / "t" / "model.safetensors"))
    w.pop("lm_head.weight")
    mx.save_safetensors(str(tmp_path / "t" / "model.safetensors"), w)
    build_drafter(tmp_path / "d", tmp_path / "t", block_size=8)
    model, tok = load(str(tmp_path / "t"), drafter=str(tmp_path / "d"))
    assert not hasattr(model.target, "lm_head")
    parity(model, tok.encode("import os\n"))


def test_quantized_target(tmp_path):
    from mlx_lm.utils import load_model, save_config

    build_target(tmp_path / "t", "qwen3", hidden=128)
    model, cfg = load_model(tmp_path / "t")
    nn.quantize(model, group_size=32, bits=4)
    cfg["quantization"] = {"group_size": 32, "bits": 4}
    mx.save_safetensors(
        str(tmp_path / "t" / "model.safetensors"), dict(tree_flatten(model.parameters()))
    )
    save_config(cfg, tmp_path / "t" / "config.json")
    build_drafter(tmp_path / "d", tmp_path / "t", block_size=8)
    dm, tok = load(str(tmp_path / "t"), drafter=str(tmp_path / "d"))
    assert isinstance(dm.target.model.embed_tokens, nn.QuantizedEmbedding)
    parity(dm, tok.encode("import os\n"), n=40)


@pytest.mark.parametrize("kind", ["muse_glimmer"])
def test_sampling_runs_on_soft_capped_target(tmp_path, kind):
    from dflash_mlx import generate

    build_target(tmp_path / "t", kind)
    build_drafter(tmp_path / "d", tmp_path / "t", block_size=4)
    model, tok = load(str(tmp_path / "t"), drafter=str(tmp_path / "d"))
    a = generate(model, tok, "hi", max_tokens=30, temperature=0.8, top_p=0.9, seed=1)
    assert a == generate(model, tok, "hi", max_tokens=30, temperature=0.8, top_p=0.9, seed=1)
