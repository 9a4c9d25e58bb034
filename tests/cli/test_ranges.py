"""Every number ranged: memory, prompt-cache GB, context, KV and draft-vocabulary settings
on the command line (one ``error:`` line naming the flag, exit 2) and in ``load`` (a
``DFlashError``): finite, within sane bounds, and the prompt-cache pool inside
``--max-memory``."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from dflash_mlx import load
from dflash_mlx.cli import app
from dflash_mlx.errors import DFlashError

runner = CliRunner()


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No network, and ``serve`` records its server's settings instead of serving."""
    from dflash_mlx import server

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    seen = {}

    def fake_run_server(m, tok, name, **kw):
        seen["model"], seen["gb"] = m, kw["cache_gb"]
        kw["sock"].close()

    monkeypatch.setattr(server, "run_server", fake_run_server)
    return seen


def refused(args: list[str], needle: str) -> str:
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr
    assert "Traceback" not in r.output
    return lines[0]


def pair_args(tiny_dir) -> list[str]:
    return ["--model", str(tiny_dir / "qwen3"), "--drafter", str(tiny_dir / "d2_qwen3")]


@pytest.mark.parametrize("command", ["run", "serve"])
@pytest.mark.parametrize("value", ["1e300", "1e7"])
def test_a_huge_max_memory_is_one_error_line_not_an_overflow(command, value, tiny_dir):
    refused([command, *pair_args(tiny_dir), "--max-memory", value], "--max-memory")


def test_a_huge_prompt_cache_gb_is_one_error_line_not_an_overflow(tiny_dir):
    refused(["serve", *pair_args(tiny_dir), "--prompt-cache-gb", "1e300"], "--prompt-cache-gb")


def test_a_tiny_max_memory_is_a_budget_refused_with_the_figure_not_unknown(tiny_dir):
    line = refused(["run", *pair_args(tiny_dir), "--max-memory", "1e-12", "hi"], "needs ~")
    assert "--max-memory 1e-12 GB" in line


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"max_memory": 1e300}, "max_memory must be"),
        ({"max_memory": 1e-12}, "needs ~"),
        ({"max_context": 10**15}, "max_context must be"),
        ({"kv": "8bit"}, "kv must be"),
        ({"kv": (3, 64, 0)}, "kv must be"),
        ({"kv": (8, 48, 0)}, "kv must be"),
        ({"kv": (8, 64, -1)}, "kv must be"),
    ],
)
def test_load_refuses_numbers_out_of_range_with_a_dflash_error(tiny_dir, kwargs, needle):
    with pytest.raises(DFlashError, match=needle):
        load(str(tiny_dir / "qwen3"), drafter=str(tiny_dir / "d2_qwen3"), **kwargs)


def test_load_takes_a_valid_kv():
    from dflash_mlx.loading.memory import check_kv

    for kv in (None, (8, 64, 0), [4, 32, 100]):
        check_kv(kv)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--draft-vocab", "999999999"], "--draft-vocab 999999999 is past"),
        (["--context", str(10**15)], f"--context {10**15} is past"),
    ],
)
def test_roofline_refuses_sizes_past_the_model(tiny_dir, args, needle):
    refused(["roofline", *pair_args(tiny_dir), *args], needle)
    refused(["roofline", "--model", "Qwen3.8-27B", *args], needle)


def test_serve_sizes_the_prompt_cache_inside_max_memory(tiny_dir, offline):
    from dflash_mlx.server.prompt_cache import weight_bytes

    seen = offline
    r = runner.invoke(app, ["serve", *pair_args(tiny_dir), "--port", "0", "--max-memory", "0.5"])
    assert r.exit_code == 0, (r.output, r.exception)
    expect = (0.5e9 - weight_bytes(seen["model"])) * 0.25 / 1e9
    assert seen["gb"] == pytest.approx(expect, rel=1e-6) and seen["gb"] < 0.125


def test_a_prompt_cache_gb_past_max_memory_is_refused(pairs):
    from dflash_mlx.server.prompt_cache import pool_gb

    model, _ = pairs("qwen3", "d2")
    with pytest.raises(DFlashError, match=r"--prompt-cache-gb 8 does not fit in --max-memory 0\.5"):
        pool_gb(model, 8, 0.5)
    assert pool_gb(model, 0.01, 0.5) == 0.01 and pool_gb(model, 8, None) == 8
