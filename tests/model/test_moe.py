"""Mixture-of-experts targets (model/moe.py): every MoE family the adapter lists decodes
mlx-lm's own tokens with speculation exercised (blocks, selector, trees, lookup, the hybrid's
tape rollback, 8-bit KV, batched rows) and samples the target's law; the grouped verify
equals mlx-lm's experts bit for bit; the experts a forward reads are counted.

A family added to ``model/target.py``'s SUPPORTED is one more entry in ``FAMILIES``."""

import json

import mlx.core as mx
import numpy as np
import pytest
from laws import assert_law, draw, exact_law
from mlx import nn
from mlx_lm.generate import generate_step
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP
from oracle import OracleDrafter
from references import reference
from scripted import Scripted
from tiny_models import EXPERTS, TOP_K, build_drafter, build_target

from dflash_mlx.decoding.acceptance import SamplingParams
from dflash_mlx.decoding.loop import DecodeOptions, decode
from dflash_mlx.errors import DFlashError
from dflash_mlx.model import moe
from dflash_mlx.model.qmm_choice import Chooser
from dflash_mlx.model.target import SUPPORTED

FAMILIES = ("qwen3_moe", "qwen3_5_moe", "gpt_oss")
PROMPT = "def parse_args(argv):\n"


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory):
    """(model, tokenizer) per family: head_dim 32, so 8-bit KV has a group to quantize by."""
    from dflash_mlx import load

    root, cache = tmp_path_factory.mktemp("moe"), {}

    def get(kind):
        if kind not in cache:
            build_target(root / kind, kind, hidden=128, seed=3)
            build_drafter(root / f"d_{kind}", root / kind, block_size=8)
            cache[kind] = load(str(root / kind), drafter=str(root / f"d_{kind}"))
        return cache[kind]

    get.root = root
    return get


@pytest.fixture(autouse=True)
def grouped_verify(monkeypatch):
    """Every verify of 2..16 rows takes the grouped path (plain steps take mlx-lm's)."""
    monkeypatch.setenv(moe.ENV, "1")


def _decode(model, ids, n, block, drafter=None, **kw):
    """Tokens and cycles of our decode (the drafter swapped for ``drafter`` if given)."""
    real, out, cycles = model.drafter, [], []
    model.drafter = drafter or real
    try:
        opts = DecodeOptions(max_tokens=n, block_size=block, **kw)
        for c in decode(model, ids, model.make_cache(), SamplingParams(), opts):
            out += c.tokens
            cycles.append(c)
    finally:
        model.drafter = real
    return out[:n], cycles


def test_every_family_listed_is_supported_and_routes_through_wrapped_experts(moe_pair):
    for kind in FAMILIES:
        model, _ = moe_pair(kind)
        assert kind in SUPPORTED and model.adapter.experts is not None
        assert (model.adapter.experts.experts, model.adapter.experts.top_k) == (EXPERTS, TOP_K)


@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_matches_mlx_lm_with_full_partial_and_no_acceptance(moe_pair, kind):
    model, tok = moe_pair(kind)
    ids = tok.encode(PROMPT)
    ref = reference(model, ids, 48)
    partial = 0
    for block, wrong, selector in ((2, (), False), (4, (3,), True), (8, (5,), True), (8, (1,), False)):  # fmt: skip
        oracle = OracleDrafter(model.drafter, ids + ref + [0] * 20, wrong_at=wrong)
        got, cycles = _decode(model, ids, 40, block, oracle, use_selector=selector)
        assert got == ref[:40], (block, wrong, selector)
        partial += sum(0 < c.accepted < c.drafted for c in cycles)
    assert partial > 0  # rolled back past accepted drafts
    if model.adapter.is_hybrid:  # the Gated DeltaNet layers rewound from the verify's tape
        assert not model.adapter.replays


@pytest.mark.parametrize("kind", FAMILIES)
def test_trees_commit_siblings_where_the_family_can_verify_them(moe_pair, kind):
    model, tok = moe_pair(kind)
    ids = tok.encode(PROMPT)
    ref = reference(model, ids, 40)
    oracle = OracleDrafter(model.drafter, ids + ref + [0] * 20, second_at=(1,))
    got, cycles = _decode(model, ids, 32, 4, oracle, lookup=False, tree=True)
    assert got == ref[:32]
    taken = sum(c.sibling > 0 for c in cycles)
    # qwen3_moe verifies trees; a hybrid or windowed family runs the path alone
    assert (taken > 5) == model.adapter.can_tree(model.make_cache().target)


@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_with_copied_drafts_matches_mlx_lm(moe_pair, kind):
    model, tok = moe_pair(kind)
    first = tok.encode(PROMPT)
    ids = first + reference(model, first, 24) + first  # the target's own text, to copy from
    policy = Scripted([4], plain=1, copy=True)  # copy after every match, 1-token ones too
    got, cycles = _decode(model, ids, 40, None, lookup=True, policy=policy)
    assert got == reference(model, ids, 40)
    assert sum(c.lookup > 0 for c in cycles) > 3


@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_with_8_bit_kv_matches_mlx_lm_with_the_same_quantization(moe_pair, kind):
    model, tok = moe_pair(kind)
    ids = tok.encode(PROMPT)
    if kind == "gpt_oss":  # attention sinks: mlx-lm's quantized attention refuses them
        with pytest.raises(DFlashError, match="attends with sinks"):
            _decode(model, ids, 8, 4, kv=(8, 32, 0))
        return
    start = len(ids) + 5  # converted during generation
    gen = generate_step(
        mx.array(ids), model.target, max_tokens=32, kv_bits=8, kv_group_size=32,
        quantized_kv_start=start,
    )  # fmt: skip
    ref = [t for t, _ in gen]
    oracle = OracleDrafter(model.drafter, ids + ref + [0] * 20, wrong_at=(4,))
    got, _ = _decode(model, ids, 32, 8, oracle, kv=(8, 32, start))
    assert got == ref


@pytest.mark.parametrize("kind", FAMILIES)
def test_batched_rows_equal_each_row_alone(moe_pair, kind):
    from dflash_mlx import generate
    from dflash_mlx.batching import batch_generate
    from dflash_mlx.settings import GenerationConfig

    model, tok = moe_pair(kind)
    prompts = [PROMPT, "import os\nfor i in", "x"]
    configs = [GenerationConfig(max_tokens=20, block_size=b) for b in (4, 8, 2)]
    out = batch_generate(model, tok, prompts, configs=configs, max_batch=3, raw=True)
    for p, c, text in zip(prompts, configs, out.texts):
        assert text == generate(model, tok, p, config=c, raw=True)


@pytest.fixture(scope="module")
def eight_token(tmp_path_factory):
    """Per family, a tiny target with an 8-token vocabulary and its drafter (block 4)."""
    from mlx_lm.utils import load_model

    from dflash_mlx.decoding.state import DFlashModel
    from dflash_mlx.model.checkpoint import load_drafter
    from dflash_mlx.model.target import TargetAdapter

    root, cache = tmp_path_factory.mktemp("moe8"), {}

    def get(kind):
        if kind not in cache:
            build_target(root / kind, kind, tokenizer=False, vocab_size=8, seed=5, layers=2)
            build_drafter(root / f"d{kind}", root / kind, block_size=4, seed=7)
            target = load_model(root / kind)[0]
            drafter = load_drafter(root / f"d{kind}", mx.float32)
            ad = TargetAdapter(target, drafter.args.target_layer_ids)
            cache[kind] = DFlashModel(target, drafter, ad)
        return cache[kind]

    return get


@pytest.mark.parametrize("kind", FAMILIES)
def test_sampling_follows_the_target_law(eight_token, kind):
    model, prompt, n = eight_token(kind), [2, 5, 1, 7], 3  # 3 tokens: marginals and a pair
    law = exact_law(model, prompt, n, 1.0, 1.0, 0, 0.0)
    samples, accepted = draw(model, prompt, SamplingParams(1.0), n, 1000, True, 13)
    assert accepted > 200  # drafts really were accepted
    assert_law(samples, law, n)


def _glu(kind: str, bits: int | None) -> nn.Module:
    """A routed-experts module of 8 experts (D 64 -> 96): SwiGLU, gpt-oss's biased
    SwiGLU, or a GELU MLP; quantized to ``bits`` when given."""
    from mlx_lm.models.gpt_oss import SwigluOAI

    mx.random.seed(11)
    if kind == "mlp":
        m = SwitchMLP(64, 96, 8)
    elif kind == "oai":
        m = SwitchGLU(64, 96, 8, activation=SwigluOAI(), bias=True)
        m.update({k: {"bias": mx.random.normal(v.bias.shape)} for k, v in m.children().items() if hasattr(v, "bias")})  # fmt: skip
    else:
        m = SwitchGLU(64, 96, 8)
    if bits:
        nn.quantize(m, group_size=32, bits=bits)
    mx.eval(m.parameters())
    return m


@pytest.mark.parametrize("kind,bits", [("glu", None), ("glu", 4), ("glu", 8), ("oai", None), ("mlp", 4)])  # fmt: skip
def test_grouped_experts_equal_mlx_lm_s_bit_for_bit(kind, bits):
    m = _glu(kind, bits)
    for rows, k in ((2, 2), (5, 2), (8, 4), (16, 4), (16, 8)):  # 128 pairs: mlx-lm sorts
        x = mx.random.normal((1, rows, 64), key=mx.random.key(rows))
        score = mx.random.uniform(shape=(1, rows, 8), key=mx.random.key(k))
        idx = mx.argpartition(score, kth=-k, axis=-1)[..., -k:].astype(mx.uint32)
        want, got = m(x, idx), moe.grouped(m, x, idx)
        assert got.shape == want.shape and mx.array_equal(got, want).item(), (rows, k)
        assert len(set(np.array(idx).reshape(-1).tolist())) < rows * k  # experts shared


def test_the_experts_read_are_counted_per_verify_and_per_plain_step(moe_pair):
    model, tok = moe_pair("qwen3_moe")
    count = model.adapter.experts
    ids = tok.encode(PROMPT)
    seen = []  # (kind of forward, its routing) of every MoE layer call
    real = count.record
    count.record = lambda idx: (seen.append((count.phase, np.array(idx))), real(idx))
    try:
        count.reset()
        _decode(model, ids, 24, None, policy=Scripted([8, 1], plain=2), lookup=False)
        got = count.summary()
    finally:
        count.reset(on=False)
        del count.record
    verifies = [s for kind, s in seen if kind == "verify"]
    assert verifies and all(s.size == TOP_K for kind, s in seen if kind == "plain")
    want = np.mean([np.unique(s).size for s in verifies])
    assert got["per_verify"] == round(want, 3) and TOP_K < got["per_verify"] <= EXPERTS
    assert got["verify_rows"] == round(np.mean([s.size / TOP_K for s in verifies]), 3)
    assert got["per_plain_step"] == TOP_K
    assert got["moe_layers"] == 4 and not count.on


def test_the_grouped_path_is_kept_only_where_it_was_faster(monkeypatch):
    monkeypatch.delenv(moe.ENV)
    timed = []

    def timer(kind, fn):
        timed.append(kind)
        return {"kernel": 1.0, "mlx": 2.0}[kind] if len(timed) <= 2 else {"kernel": 2.0, "mlx": 1.0}[kind]  # fmt: skip

    monkeypatch.setattr(moe, "CHOOSER", Chooser(timer=timer))
    m = moe.Experts(_glu("glu", None), moe.ExpertCount(8, 2, 1))
    assert m._use_grouped(4, 2, mx.float32) and not m._use_grouped(8, 2, mx.float32)
    assert m._use_grouped(4, 2, mx.float32) and len(timed) == 4  # each shape timed once


def test_bench_and_run_report_experts_per_verify_against_a_plain_step(moe_pair):
    from rich.console import Console
    from typer.testing import CliRunner

    from dflash_mlx.bench.runner import run_bench
    from dflash_mlx.cli import app
    from dflash_mlx.cli.bench import print_report

    model, tok = moe_pair("qwen3_moe")
    rep = run_bench(model, tok, ["def f("], max_tokens=12, block_size=4, lookup=False, auto=False)
    plain, spec = (rep["methods"][m]["experts"] for m in ("autoregressive", "dflash2"))
    assert plain["per_plain_step"] == TOP_K and plain["per_verify"] is None
    assert TOP_K < spec["per_verify"] <= EXPERTS and 1 < spec["verify_rows"] <= 4
    con = Console(width=200, record=True)
    print_report(rep, con)
    text = con.export_text()
    assert "experts/layer: verify (plain step)" in text
    assert f"{spec['per_verify']:.1f} @ {spec['verify_rows']:.1f} rows ({TOP_K})" in text
    root = moe_pair.root
    pair = ["--model", str(root / "qwen3_moe"), "--drafter", str(root / "d_qwen3_moe")]
    res = CliRunner().invoke(app, ["run", *pair, "-m", "12", "--block-size", "4", "--json", "x"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)["experts"]
    assert got["num_experts"] == EXPERTS and TOP_K < got["per_verify"] <= EXPERTS


def test_a_dense_target_reports_no_experts(pairs, tiny_dir):
    from typer.testing import CliRunner

    from dflash_mlx.bench import experts
    from dflash_mlx.cli import app

    model, _ = pairs("qwen3", "d2")
    assert model.adapter.experts is None and experts.row(model, [], "dflash2") is None
    pair = ["--model", str(tiny_dir / "qwen3"), "--drafter", str(tiny_dir / "d2_qwen3")]
    res = CliRunner().invoke(app, ["run", *pair, "-m", "4", "--block-size", "4", "--json", "x"])
    assert res.exit_code == 0 and json.loads(res.stdout)["experts"] is None
