"""dflash bench --context N: prompts made N tokens long with standard-library source, the
model's context respected as ``dflash run`` respects it."""

import json

import pytest
from tiny_models import build_drafter, build_target
from typer.testing import CliRunner

from dflash_mlx import DFlashError
from dflash_mlx.bench.long_prompts import INTRO, source_files, with_context
from dflash_mlx.cli import app
from dflash_mlx.generation import encode_prompt


@pytest.fixture(scope="module")
def short_pair(tmp_path_factory):
    """A tiny qwen3 pair whose target's context is 300 tokens."""
    root = tmp_path_factory.mktemp("ctx300")
    target = build_target(root / "t", "qwen3", context=300)
    return target, build_drafter(root / "d", target, block_size=8)


def bench(pair, *args):
    model = ["--model", str(pair[0]), "--drafter", str(pair[1])]
    return CliRunner().invoke(app, ["bench", *model, *map(str, args)])


def one_error(res, needle):
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    assert "Traceback" not in res.output


@pytest.mark.parametrize("raw", [True, False])
@pytest.mark.parametrize("tokens", [120, 700])
def test_long_prompts_have_exactly_the_asked_length_and_end_with_the_request(pairs, raw, tokens):
    _, tok = pairs("qwen3", "d2")
    asks = ["def parse_args(", "Explain the code above."]
    got = with_context(tok, asks, tokens, raw)
    assert [len(encode_prompt(tok, p, raw)) for p in got] == [tokens, tokens]
    assert all(p.startswith(INTRO) and p.endswith(a) for p, a in zip(got, asks))
    assert got[0][len(INTRO) : len(INTRO) + 200] != got[1][len(INTRO) : len(INTRO) + 200]
    assert len(source_files()) > 1


def test_a_context_too_short_for_the_request_is_refused(pairs):
    _, tok = pairs("qwen3", "d2")
    with pytest.raises(DFlashError, match="--context 5 leaves no room for source"):
        with_context(tok, ["def parse_args(" * 4], 5, True)


def test_bench_context_runs_every_method_at_that_prompt_length(short_pair, tmp_path):
    out = tmp_path / "r.json"
    res = bench(short_pair, "--context", 200, "-p", "def f(", "-m", 16, "--json", out)
    assert res.exit_code == 0, res.output
    rep = json.loads(out.read_text())
    assert rep["config"]["prompt_tokens"] == 200 and rep["config"]["max_tokens"] == 16
    assert {"autoregressive", "dflash2", "auto"} <= set(rep["methods"])
    assert all(s["identical"] == s["of"] == 1 for s in rep["parity"]["summary"].values())


def test_bench_context_beyond_the_models_context_is_one_line(short_pair):
    one_error(bench(short_pair, "--context", 300, "-p", "x"), "--context 300 is beyond")
    one_error(bench(short_pair, "--context", 5000, "-p", "x"), "context (300 tokens)")
    one_error(bench(short_pair, "--context", 0, "-p", "x"), "--context must be")


def test_bench_context_leaving_less_than_max_tokens_clamps_them(short_pair, tmp_path):
    out = tmp_path / "r.json"
    res = bench(short_pair, "--context", 290, "-p", "def f(", "-m", 32, "--json", out)
    assert res.exit_code == 0, res.output
    assert "--max-tokens 32 lowered to 10" in res.stderr
    assert json.loads(out.read_text())["config"]["max_tokens"] == 10


def test_the_long_context_sweep_reports_every_length(tiny_dir, tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "long_context.py"
    spec = importlib.util.spec_from_file_location("long_context", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "sweep.json"
    model = ["--model", str(tiny_dir / "qwen3"), "--drafter", str(tiny_dir / "d2_qwen3")]
    args = ["--lengths", "200,400", "-n", "1", "-m", "12", "--block", "4", "--json", str(out)]
    assert script.main(model + args) == 0
    rep = json.loads(out.read_text())["lengths"]
    assert [rep[n]["config"]["prompt_tokens"] for n in ("200", "400")] == [200, 400]
    for r in rep.values():
        assert {"autoregressive", "dflash2", "auto"} == set(r["methods"])
        assert len(r["positions"]["acceptance_dflash2"]) == 3 and r["latency_split"]["cycle_ms"]
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[0] == "200" and lines[2].split()[-1] == "yes"
