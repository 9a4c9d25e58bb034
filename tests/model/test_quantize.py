"""A quantized drafter (docs/format.md §2.5): quantized at load with MLX's affine
quantization, written and read back pre-quantized, refused in one line when its scales do
not fit its weights; and greedy output still equals plain decoding (the drafter only
proposes)."""

import json

import mlx.core as mx
import pytest
from mlx import nn
from mlx.utils import tree_flatten
from references import PROMPTS, reference
from refusals import refused

from dflash_mlx import load, stream_generate
from dflash_mlx.model import quantize as qz
from dflash_mlx.model.checkpoint import load_drafter, save_drafter
from dflash_mlx.model.config import parse_draft_quant


def quantized_paths(drafter) -> list[str]:
    return sorted(p for p, m in drafter.named_modules() if isinstance(m, nn.QuantizedLinear))


@pytest.mark.parametrize("bits", [4, 8])
def test_draft_quant_quantizes_the_layer_projections_and_keeps_fc_dense(tiny_dir, bits):
    model, _ = load(
        str(tiny_dir / "qwen3"), drafter=str(tiny_dir / "d2_qwen3"), draft_quant=bits, warmup=False
    )
    paths = quantized_paths(model.drafter)
    assert len(paths) == 2 * 7  # two layers x (q, k, v, o, gate, up, down)
    assert all(".self_attn." in p or ".mlp." in p for p in paths)
    assert qz.bits_of(model.drafter) == bits and model.drafter.fc.weight.dtype == mx.float32
    layer = model.drafter.layers[0].mlp.up_proj
    assert layer.group_size == qz.GROUP_SIZE and layer.weight.dtype == mx.uint32


@pytest.mark.parametrize("bits", [4, 8])
def test_greedy_text_with_a_quantized_drafter_equals_plain_decoding(tiny_dir, bits):
    for kind in ("qwen3", "qwen3_5"):
        model, tok = load(
            str(tiny_dir / kind),
            drafter=str(tiny_dir / f"d2_{kind}"),
            draft_quant=bits,
            warmup=False,
        )
        assert qz.bits_of(model.drafter) == bits
        for prompt in PROMPTS:
            ids = tok.encode(prompt)
            rs = list(stream_generate(model, tok, ids, max_tokens=40, block_size=8))
            toks = [t for r in rs for t in r.tokens]
            ref = reference(model, ids, 40)
            cut = next((i for i, t in enumerate(ref) if t in tok.eos_token_ids), 40)
            assert toks == ref[:cut] and rs[-1].cycles > 0


def test_auto_keeps_the_drafter_dense_on_the_cpu_and_quantizes_beside_a_quantized_target():
    assert qz.default_bits(target_quantized=True, on_gpu=False) == 0
    assert qz.default_bits(target_quantized=False, on_gpu=True) == 0
    assert qz.default_bits(target_quantized=True, on_gpu=True) == 4


def test_a_checkpoint_written_quantized_loads_back_with_the_same_tensors(tiny_dir, tmp_path):
    dense = load_drafter(tiny_dir / "d2_qwen3")
    out = save_drafter(tmp_path / "q4", dense, _config(tiny_dir), quantize=4)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 64, "bits": 4}
    assert quantized_paths(dense) == []  # writing a quantized copy leaves the model alone
    back = load_drafter(out)
    assert len(quantized_paths(back)) == 14 and qz.bits_of(back) == 4
    want = load_drafter(tiny_dir / "d2_qwen3")
    qz.quantize(want, 4)
    got, ref = dict(tree_flatten(back.parameters())), dict(tree_flatten(want.parameters()))
    assert set(got) == set(ref)
    for k, v in ref.items():  # bf16 storage: scales and dense tensors to bf16, words exact
        assert mx.array_equal(got[k], v.astype(got[k].dtype)).item(), k


def test_a_pre_quantized_checkpoint_is_dequantized_for_none_and_requantized_for_other_bits(
    tiny_dir, tmp_path
):
    out = save_drafter(
        tmp_path / "q8", load_drafter(tiny_dir / "d2_qwen3"), _config(tiny_dir), quantize=8
    )
    target = load(str(tiny_dir / "qwen3"), drafter=str(out), draft_quant=8, warmup=False)[0].target
    q8 = load_drafter(out)
    for bits, want in ((None, 0), (0, 0), (8, 8), (4, 4)):  # auto on the CPU: dense
        d = load_drafter(out, quant=(bits, target))
        assert qz.bits_of(d) == want, bits
    d = load_drafter(out, quant=(0, target))
    w = d.layers[0].mlp.up_proj.weight
    m = q8.layers[0].mlp.up_proj
    exact = mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits)
    assert mx.array_equal(w, exact.astype(w.dtype)).item()


def test_scales_that_do_not_match_their_weights_are_one_line(tiny_dir, tmp_path):
    out = save_drafter(
        tmp_path / "bad", load_drafter(tiny_dir / "d2_qwen3"), _config(tiny_dir), quantize=4
    )
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(
        json.dumps(cfg | {"quantization": {"group_size": 32, "bits": 4}})
    )
    refused(lambda: load_drafter(out), "scales do not match the weights", "quantization")
    weights = mx.load(str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    weights["layers.0.mlp.up_proj.scales"] = weights["layers.0.mlp.up_proj.scales"][:-1]
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    refused(lambda: load_drafter(out), "layers.0.mlp.up_proj.scales", "scales do not match")
    (out / "config.json").write_text(
        json.dumps({k: v for k, v in cfg.items() if k != "quantization"})
    )
    refused(lambda: load_drafter(out), '.scales tensors but its config.json has no "quantization"')
    (out / "config.json").write_text(
        json.dumps(cfg | {"quantization": {"bits": 7, "group_size": 64}})
    )
    refused(lambda: load_drafter(out), "is not MLX affine quantization", "dflash convert")


@pytest.mark.parametrize("value", [3, "3", "16", True, "int4", -1])
def test_a_draft_quant_that_is_not_offered_is_one_line_naming_the_choices(tiny_dir, value):
    refused(lambda: parse_draft_quant(value), "auto, none, 8, 4")
    refused(
        lambda: load(
            str(tiny_dir / "qwen3"), drafter=str(tiny_dir / "d2_qwen3"), draft_quant=value
        ),
        "draft_quant must be one of",
    )


def test_the_offered_draft_quants_parse_to_bits():
    assert [parse_draft_quant(v) for v in (None, "auto", "none", 0, "8", 8, 4, " 4 ")] == [
        None,
        None,
        0,
        0,
        8,
        8,
        4,
        4,
    ]


def _config(tiny_dir) -> dict:
    return json.loads((tiny_dir / "d2_qwen3" / "config.json").read_text())


def test_the_memory_plan_counts_a_quantized_drafters_bytes_as_mlx_holds_them(tiny_dir, tmp_path):
    from dflash_mlx.loading.footprint import drafter_size

    def held(d) -> int:
        return sum(v.nbytes for _, v in tree_flatten(d.parameters()))

    src = tiny_dir / "d2_qwen3"
    dense = load_drafter(src, mx.float32)
    assert drafter_size(src, 16, 4, cpu=False)[0] == held(dense)
    qz.quantize(dense, 4)  # quantized at load (draft_quant=4)
    assert drafter_size(src, 16, 4, cpu=False, bits=4)[0] == held(dense)
    out = save_drafter(tmp_path / "q8", load_drafter(src), _config(tiny_dir), quantize=8)
    pre = load_drafter(out, mx.float32)  # pre-quantized: packed words as stored
    assert qz.bits_of(pre) == 8 and drafter_size(out, 16, 4, cpu=False)[0] == held(pre)


def test_batched_rows_with_a_quantized_drafter_equal_each_request_alone(tiny_dir):
    from dflash_mlx import batch_generate, generate

    model, tok = load(
        str(tiny_dir / "qwen3"), drafter=str(tiny_dir / "d2_qwen3"), draft_quant=4, warmup=False
    )
    dense, _ = load(
        str(tiny_dir / "qwen3"), drafter=str(tiny_dir / "d2_qwen3"), draft_quant=0, warmup=False
    )
    out = batch_generate(model, tok, PROMPTS, max_tokens=24, block_size=4, raw=True)
    for prompt, text in zip(PROMPTS, out.texts, strict=True):
        assert text == generate(model, tok, prompt, max_tokens=24, block_size=4, raw=True)
        assert text == generate(dense, tok, prompt, max_tokens=24, block_size=4, raw=True)


def test_a_checkpoint_quantized_the_mlx_lm_way_loads_with_fc_dense_again(tiny_dir, tmp_path):
    d = load_drafter(tiny_dir / "d2_qwen3")
    nn.quantize(d, group_size=64, bits=4)  # every Linear whose width allows, fc included
    assert isinstance(d.fc, nn.QuantizedLinear)
    f32 = [d.fc.scales.astype(mx.float32), d.fc.biases.astype(mx.float32)]
    exact = mx.dequantize(d.fc.weight, *f32, 64, 4)  # as loaded in float32
    out = save_drafter(tmp_path / "all4", d, _config(tiny_dir))
    back = load_drafter(out, mx.float32)
    assert isinstance(back.fc, nn.Linear) and back.fc.weight.dtype == mx.float32
    assert mx.array_equal(back.fc.weight, exact.astype(mx.float32)).item()
    assert qz.bits_of(back) == 4 and len(quantized_paths(back)) > 14  # conv, selector too
    model, tok = load(str(tiny_dir / "qwen3"), drafter=str(out), draft_quant=4, warmup=False)
    ids = tok.encode(PROMPTS[0])
    toks = [t for r in stream_generate(model, tok, ids, max_tokens=24) for t in r.tokens]
    assert toks == reference(model, ids, 24)[: len(toks)] and toks
