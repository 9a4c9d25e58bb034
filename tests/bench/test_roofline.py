"""``dflash roofline``'s cost model (bench/roofline.py): its parameter counts equal the
real modules' (mlx-lm's targets, our drafter), and on the Qwen3.8-27B pair a 4-bit
drafter with a tape rollback and a 16k draft vocabulary reads at most 12% of the verify."""

import json

import pytest
from mlx.utils import tree_flatten
from tiny_models import target_config

from dflash_mlx.bench import roofline as rl
from dflash_mlx.bench import roofline_data as data
from dflash_mlx.model.checkpoint import drafter_config


def params(model, skip=()) -> int:
    return sum(
        v.size
        for k, v in tree_flatten(model.parameters())
        if v.ndim >= 2 and not any(s in k for s in skip)
    )


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_the_verify_weights_are_the_targets_matrices_but_its_embedding(kind):
    from mlx_lm.utils import _get_classes

    cfg = target_config(kind, 320)
    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    assert rl.target_weights(cfg) == params(model, skip=("embed_tokens",))


def test_the_drafter_parts_count_the_drafters_own_matrices():
    from dflash_mlx.model.config import DrafterArgs
    from dflash_mlx.model.drafter import DFlashDrafter

    cfg = drafter_config(
        hidden_size=64,
        vocab_size=320,
        num_target_layers=4,
        target_layer_ids=[0, 2],
        mask_token_id=1,
        num_hidden_layers=2,
        selector_rank=32,
    )
    drafter = DFlashDrafter(DrafterArgs.from_dict(cfg))
    parts = rl.drafter_parts(rl.Inputs(target={}, drafter=cfg, draft_quant=0), head_bytes=2.0)
    layers = sum(params(la, skip=("kernel_projection", "base_kernel")) for la in drafter.layers)
    dense = params(drafter, skip=("layers.", "codebook")) + sum(
        v.size for k, v in tree_flatten(drafter.parameters()) if "kernel_projection" in k
    )
    assert parts["drafter layers (16-bit)"] == 2 * layers
    assert parts["drafter fc, conv, selector (16-bit)"] == 2 * dense
    assert parts["drafter head (320 rows)"] == 2 * 320 * 64


def qwen27(**kw) -> rl.Report:
    arch = data.ARCHS["Qwen3.8-27B"]
    return rl.estimate(rl.Inputs(arch["target"], arch["drafter"], **kw))


def test_a_4bit_drafter_with_a_tape_and_16k_vocab_reads_at_most_12_percent_of_the_verify():
    got = rl.summary(qwen27(draft_quant=4, draft_vocab=16384, rollback="tape"), 273.0)
    assert got["drafter_and_rollback_share"] <= 0.12
    bf16 = rl.summary(qwen27(draft_quant=0, rollback="replay"), 273.0)
    assert bf16["drafter_and_rollback_share"] > 0.3  # the starting point (~30% + replay)
    # the 4-bit target's weights a verify reads: ~14.4 GB by an independent tensor count
    assert 14.0e9 < qwen27().parts["target weights (verify)"] < 14.8e9


def test_quantizing_the_drafter_and_a_draft_vocabulary_shrink_their_parts_in_proportion():
    dense, q4, q8 = qwen27(draft_quant=0), qwen27(draft_quant=4), qwen27(draft_quant=8)
    layers = dense.parts["drafter layers (16-bit)"]
    assert q4.parts["drafter layers (4-bit)"] == pytest.approx(layers * (0.5 + 4 / 64) / 2)
    assert q8.parts["drafter layers (8-bit)"] == pytest.approx(layers * (1 + 4 / 64) / 2)
    small = qwen27(draft_vocab=16384).parts["drafter head (16,384 rows)"]
    assert small == pytest.approx(dense.parts["drafter head (248,320 rows)"] * 16384 / 248320)


def test_the_tape_reads_less_than_the_replay_and_a_dense_target_has_no_rollback():
    tape, replay = qwen27(rollback="tape"), qwen27(rollback="replay")
    assert tape.group("rollback") < replay.group("rollback") / 5
    assert tape.other[0] == "replay" and tape.other[1] == replay.group("rollback")
    arch = data.ARCHS["Qwen3-8B"]
    dense = rl.estimate(rl.Inputs(arch["target"], arch["drafter"]))
    assert dense.group("rollback") == 0 and not dense.hybrid and dense.other is None


@pytest.mark.parametrize("block,chunks", [(5, 1), (6, 2), (8, 2), (16, 4)])
def test_verify_rows_are_chunked_to_keep_mlxs_fused_vector_attention(block, chunks):
    rep = qwen27(block=block)  # 24 heads over 4 KV heads: 6 query rows per KV head
    assert rep.rows_per_chunk == 5 and rep.chunks == chunks
    assert rep.rows_per_chunk * 24 // 4 <= 32


def test_chips_are_found_by_name_and_an_unknown_one_is_a_key_error():
    assert data.chip("m4 pro")[:2] == ("M4 Pro", 273.0)
    assert data.chip("Apple  M3 Max")[0] == "M3 Max"
    with pytest.raises(KeyError):
        data.chip("M9 Hyper")


def test_the_command_prints_a_table_and_json(capsys):
    from dflash_mlx.cli.roofline import roofline

    args = {"quant": "4bit", "chip": "M4 Pro", "context": 4096, "block": None, "drafter": None}
    args |= {"draft_quant": "4", "hosts": 1, "link": "tb5-rdma", "shard": "tensor"}
    args["moe_correlation"] = None
    roofline(model="qwen3.8-27b", draft_vocab=16384, rollback="tape", json_out=True, **args)
    out = json.loads(capsys.readouterr().out)
    assert out["estimated"] and out["block"] == 8 and out["fused_attention_chunks"] == 2
    assert out["drafter_and_rollback_share"] <= 0.12 and out["other_rollback"]["kind"] == "replay"
    roofline(model="Qwen3.8-27B", draft_vocab=0, rollback="replay", json_out=False, **args)
    text = capsys.readouterr().out
    assert "rollback (replay)" in text and "on M4 Pro (273 GB/s, estimated)" in text


def test_the_demo_is_read_from_its_files_with_its_own_draft_vocabulary(capsys):
    from dflash_mlx.cli.roofline import roofline

    args = {"quant": None, "chip": "M1", "context": 1024, "block": None, "drafter": None}
    args |= {"hosts": 1, "link": "tb5-rdma", "shard": "tensor", "moe_correlation": None}
    roofline(
        model="demo", draft_quant="none", draft_vocab=None, rollback="tape", json_out=True, **args
    )
    out = json.loads(capsys.readouterr().out)
    assert out["draft_vocab"] == 8192 and out["block"] == 8 and out["rollback"] is None
    assert out["parts"]["drafter head (8,192 rows)"]["bytes"] == 8192 * 576 * (0.5 + 4 / 64)
    assert out["fused_attention_chunks"] == 1  # 9 heads over 3 KV heads: 8 rows a chunk


# ------------------------------------------------------------------ compute per row


def test_mlxs_row_cost_is_the_cited_figures_and_never_falls_with_more_rows():
    assert data.mlx_qmm_ratio("M4 Pro", 8) == pytest.approx(2.7)  # mlx #3839
    assert data.mlx_qmm_ratio("M3 Ultra", 8) == pytest.approx(6.1)  # mlx #4265
    assert data.mlx_qmm_ratio("M5 Pro", 4) == pytest.approx(6.3 / 5.7)
    assert data.mlx_qmm_ratio("M5 Pro", 5) == pytest.approx(7.4 / 5.7)  # the cliff after 4
    for chip in data.CHIPS:
        costs = [data.mlx_qmm_ratio(chip, m) for m in range(1, 17)]
        assert costs[0] == 1.0 and costs == sorted(costs), chip
    assert "M4 Pro" in data.qmm_rows("M4 Max")[1]  # a borrowed figure names its donor


def test_the_few_row_kernel_costs_one_pass_plus_a_small_term_and_never_more_than_mlx():
    for chip in data.CHIPS:
        few = [data.few_row_ratio(chip, m) for m in range(1, 17)]
        assert few == sorted(few) and few[0] == 1.0, chip
        assert all(f <= data.mlx_qmm_ratio(chip, m) for m, f in enumerate(few, 1)), chip
        assert data.few_row_ratio(chip, 17) == data.mlx_qmm_ratio(chip, 17)  # past its rows
    assert data.few_row_ratio("M4 Pro", 8) == pytest.approx(1 + 7 * (6.3 / 5.7 - 1) / 3)


def test_mlxs_row_cost_moves_the_m4_pro_break_even_near_3_and_the_kernel_wins_it_back():
    inp = rl.Inputs(data.ARCHS["Qwen3.8-27B"]["target"], data.ARCHS["Qwen3.8-27B"]["drafter"])
    rep = rl.estimate(inp)
    c = rl.compute(rep, inp, "M4 Pro", 273.0)
    even = {k: c[k]["break_even_tau"] for k in ("bytes_only", "mlx_qmm", "few_row")}
    assert even["bytes_only"] == pytest.approx(rl.summary(rep, 273.0)["break_even_tau"])
    assert even["bytes_only"] < even["few_row"] < 1.6
    assert 2.6 < even["mlx_qmm"] < 3.2  # the "closer to 3"
    for k, e in even.items():
        assert c[k]["speedup_at_tau_4.8"] == pytest.approx(4.8 / e)
    assert 1.5 < c["mlx_qmm"]["speedup_at_tau_4.8"] < 1.8  # the "~1.6x"
    dense = rl.compute(rep, rl.Inputs(inp.target, inp.drafter, quant="bf16"), "M4 Pro", 273.0)
    assert dense["mlx_qmm"]["rows_ratio"] == dense["few_row"]["rows_ratio"] == 1.0
    four = rl.Inputs(inp.target, inp.drafter, block=4)
    short = rl.compute(rl.estimate(four), four, "M1", 68.25)
    assert short["mlx_qmm"]["speedup_at_tau_4.8"] is None  # 4.8 tokens need a block over 4


def test_the_command_prints_mlxs_qmm_and_the_few_row_kernel_with_their_break_even(capsys):
    from dflash_mlx.cli.roofline import roofline

    args = {"quant": "4bit", "chip": "M4 Pro", "context": 4096, "block": None, "drafter": None}
    args |= {"hosts": 1, "link": "tb5-rdma", "shard": "tensor", "moe_correlation": None}
    roofline(
        model="Qwen3.8-27B", draft_quant="4", draft_vocab=0, rollback="tape", json_out=False, **args
    )
    text = capsys.readouterr().out
    assert "MLX qmm" in text and "few-row" in text and "mlx #3839" in text
    line = next(x for x in text.splitlines() if x.startswith("break-even tokens per cycle"))
    bytes_only, mlx, few = map(float, line.split()[-3:])
    assert bytes_only < few < mlx and 2.6 < mlx < 3.2
    assert "speedup at tau 3" in text and "speedup at tau 4.8" in text and "(estimated)" in text
    roofline(
        model="Qwen3.8-27B", draft_quant="4", draft_vocab=0, rollback="tape", json_out=True, **args
    )
    out = json.loads(capsys.readouterr().out)
    assert out["compute"]["mlx_qmm"]["break_even_tau"] == pytest.approx(mlx, abs=0.01)
