"""dflash bench's parity report: per prompt, whether each method's greedy tokens equal plain
decoding's and where they first differ. The run below holds bit-identity on MLX's Linux CPU
backend with the few-row kernel (docs/algorithm.md §4.2.1), which is what CI runs."""

import json

from dflash_mlx.bench.parity import first_difference, parity_report, summary_line
from dflash_mlx.bench.runner import run_bench
from dflash_mlx.cli.bench import print_report, write_json


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2  # a shorter output differs at its end
    assert first_difference([], []) is None


def test_report_and_line_name_the_method_and_the_first_differing_token():
    outputs = [
        {"autoregressive": [1, 2, 3, 4], "dflash2": [1, 2, 3, 4], "auto": [1, 2, 9, 4]},
        {"autoregressive": [5, 6], "dflash2": [5, 6], "auto": [5, 6]},
    ]
    rep = parity_report(outputs, 0.0, decode=lambda t: " ".join(map(str, t)))
    assert rep["prompts"][0]["auto"] == {
        "identical": False,
        "text_equal": False,
        "first_diff": 2,
        "tokens": 4,
    }
    assert rep["prompts"][1]["dflash2"]["identical"] and rep["prompts"][1]["auto"]["text_equal"]
    assert rep["summary"]["auto"] == {"identical": 1, "of": 2, "first_diffs": [2]}
    assert summary_line(rep) == (
        "greedy parity with plain decoding: dflash2 2/2 identical · "
        "auto 1/2 identical (first differs at token 2)"
    )
    assert parity_report(outputs, 0.7) == {"greedy": False}
    assert "not measured (sampled run)" in summary_line({"greedy": False})
    assert summary_line(None) is None


def test_bench_reports_greedy_parity_per_prompt(pairs, tmp_path):
    from rich.console import Console

    model, tok = pairs("qwen3", "d2")
    prompts = ["def parse_args(", "import os\n"]
    rep = run_bench(model, tok, prompts, max_tokens=24, block_size=8)
    parity = rep["parity"]
    assert parity["greedy"] and len(parity["prompts"]) == 2
    methods = set(rep["methods"]) - {"autoregressive"}
    for row in parity["prompts"]:
        assert set(row) == methods
        for m, r in row.items():
            assert r == {"identical": True, "text_equal": True, "first_diff": None, "tokens": 24}, m
    with open(tmp_path / "out.txt", "w") as fh:
        print_report(rep, Console(file=fh, width=200))
    text = (tmp_path / "out.txt").read_text()
    assert "greedy parity with plain decoding: dflash1 2/2 identical" in text
    write_json(rep, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())["parity"]["summary"]["auto"]["of"] == 2
