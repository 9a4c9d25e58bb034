"""``dflash roofline`` on mixture-of-experts targets (bench/roofline_moe.py): attention,
dense and shared weights counted once, the routed experts as the union a verify's rows
reach (uniform, times the measured correlation), as MLX's SwitchGLU and the grouped verify
read them; the 35B-A3B aliases break even later than the dense 27B at every block."""

import json

import pytest
from mlx.utils import tree_flatten
from tiny_models import target_config

from dflash_mlx.bench import roofline as rl
from dflash_mlx.bench import roofline_data as data
from dflash_mlx.bench import roofline_moe as moe_model
from dflash_mlx.errors import DFlashError


def moe_config(kind: str) -> dict:
    """A tiny qwen3_moe (every other layer dense) or qwen3_5_moe (shared experts) config."""
    if kind == "qwen3_moe":
        cfg = {**target_config("qwen3", 320), "model_type": "qwen3_moe"}
        cfg |= {"decoder_sparse_step": 1, "mlp_only_layers": [1, 3], "norm_topk_prob": True}
    else:
        cfg = {**target_config("qwen3_5", 320), "model_type": "qwen3_5_moe"}
        cfg["shared_expert_intermediate_size"] = 48
    return cfg | {"num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 32}


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_5_moe"])
def test_dense_weights_and_every_expert_are_the_targets_matrices_but_its_embedding(kind):
    from mlx_lm.utils import _get_classes

    cfg = moe_config(kind)
    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    params = sum(
        v.size for k, v in tree_flatten(model.parameters()) if v.ndim >= 2 and "embed" not in k
    )
    m = moe_model.moe_of(cfg)
    assert m.layers == (2 if kind == "qwen3_moe" else 4) and (m.experts, m.top_k) == (16, 4)
    assert rl.target_weights(cfg) + m.layers * m.experts * m.expert == params


def test_the_uniform_union_is_the_issues_table_and_the_default_is_lucebox_measured_one():
    def uniform(E, k, B):
        return moe_model.union(moe_model.MoE(1, E, k, 1, 0), B, correlation=1.0)

    assert round(uniform(128, 8, 8)) == 52  # Qwen3-30B-A3B (moe-facts table)
    assert (round(uniform(256, 8, 8)), round(uniform(256, 8, 16))) == (57, 102)
    assert (round(uniform(32, 4, 8)), round(uniform(32, 4, 16))) == (21, 28)  # gpt-oss-20b
    m = moe_model.moe_of(data.ARCHS["Qwen3.6-35B-A3B"]["target"])
    assert moe_model.union(m, 8) == pytest.approx(39.4, abs=0.5)  # lucebox PR #501, 8 rows
    counts = [moe_model.union(m, b) for b in range(1, 65)]
    assert counts[0] == 8 and counts == sorted(counts) and counts[-1] <= 256


@pytest.mark.parametrize("rows,mlx_reads", [(2, 16), (4, 32), (7, 56), (8, None), (16, None)])
def test_mlx_reads_one_expert_per_row_and_slot_below_64_pairs_the_grouped_verify_each_once(
    rows, mlx_reads
):
    m = moe_model.moe_of(data.ARCHS["Qwen3.6-35B-A3B"]["target"])
    union = moe_model.union(m, rows)
    assert moe_model.reads(m, rows, "grouped") == union < rows * m.top_k
    assert moe_model.reads(m, rows, "mlx") == (mlx_reads or union)  # sorted from 64 pairs
    assert moe_model.rows_per_read(m, rows, "mlx") == (1 if mlx_reads else round(rows * 8 / union))


def estimate(alias: str, **kw) -> tuple[rl.Inputs, rl.Report]:
    arch = data.ARCHS[alias]
    inp = rl.Inputs(arch["target"], arch["drafter"], **kw)
    return inp, rl.estimate(inp)


def test_a_plain_step_reads_k_experts_and_a_verify_the_union_shared_weights_once():
    rep = estimate("Qwen3.6-35B-A3B", block=8, context=1)[1]
    m, per = rep.moe, data.QUANT_BYTES["4bit"]
    assert rep.expert_bytes == m.layers * m.expert * per
    routed = rep.group("target routed experts")
    assert routed == pytest.approx(moe_model.union(m, 8) * rep.expert_bytes)
    dense = rep.parts["target weights (verify)"]
    kv = rep.group("target KV") * (rep.chunks - 1) / rep.chunks  # one chunk in a plain step
    assert rep.plain == pytest.approx(rep.group("target") - kv - routed + 8 * rep.expert_bytes)
    assert 1.0e9 < dense < 1.2e9 and 0.5e9 < 8 * rep.expert_bytes < 0.6e9  # 4-bit, by hand
    uniform = estimate("Qwen3.6-35B-A3B", block=8, context=1, correlation=1.0)[1]
    assert uniform.group("target routed experts") == pytest.approx(routed / 0.69, rel=1e-3)


def test_the_35b_a3b_breaks_even_later_than_the_dense_27b_at_every_block_and_kernel():
    moe = rl.by_block(estimate("Qwen3.6-35B-A3B", block=16)[0], "M4 Pro", 273.0)
    dense = {r["block"]: r for r in rl.by_block(estimate("Qwen3.8-27B")[0], "M4 Pro", 273.0)}
    assert [r["block"] for r in moe] == list(rl.BLOCKS)  # the drafter's block 16 and below
    for r in moe:
        d = dense.get(r["block"])
        for kernel in ("mlx", "ours"):
            assert d is None or r[kernel]["break_even_tau"] > d[kernel]["break_even_tau"]
        assert r["ours"]["break_even_tau"] < r["mlx"]["break_even_tau"]
    # the grouped verify gains most where MLX re-reads an expert per (row, slot)
    gain = {r["block"]: r["mlx"]["break_even_tau"] / r["ours"]["break_even_tau"] for r in moe}
    assert gain[6] > gain[8]
    # wide blocks lose on the MoE with MLX's kernels (z-lab #151: block 16 slower than 5)
    tau = {r["block"]: r["mlx"]["speedup_at_tau_4.8"] for r in moe}
    assert tau[16] < tau[5]


ARGS = {"drafter": None, "quant": None, "chip": "M4 Pro", "context": 4096, "block": None}
ARGS |= {"draft_quant": "4", "draft_vocab": None, "rollback": "tape", "hosts": 1}
ARGS |= {"link": "tb5-rdma", "shard": "tensor"}


def test_the_command_shows_the_union_and_each_blocks_break_even(capsys):
    from dflash_mlx.cli.roofline import roofline

    roofline(model="qwen3.6-35b-a3b", moe_correlation=None, json_out=True, **ARGS)
    out = json.loads(capsys.readouterr().out)
    assert out["estimated"] and out["block"] == 16
    assert out["moe"]["union"] == pytest.approx(0.69 * out["moe"]["uniform_union"])
    assert out["moe"]["experts"] == 256 and out["moe"]["mlx_sorts"]
    assert out["blocks"][2]["block"] == 4 and out["blocks"][2]["mlx_expert_reads"] == 32
    roofline(model="Qwen3-Coder-30B-A3B", moe_correlation=1.0, json_out=False, **ARGS)
    text = capsys.readouterr().out
    assert "routed experts: 128 a layer, top 8, in 48 layers" in text
    assert "per block (estimated" in text and "MLX reads" in text
    roofline(model="Qwen3.8-27B", moe_correlation=None, json_out=True, **ARGS)
    dense = json.loads(capsys.readouterr().out)
    assert dense["moe"] is None and dense["blocks"][-1]["union"] is None


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5])
def test_a_correlation_outside_0_to_1_is_one_line(bad):
    from dflash_mlx.cli.roofline import roofline

    with pytest.raises(DFlashError, match="--moe-correlation must be above 0 and at most 1"):
        roofline(model="Qwen3.6-35B-A3B", moe_correlation=bad, json_out=True, **ARGS)
