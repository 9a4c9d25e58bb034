"""``--draft-quant`` on the commands, ``dflash convert`` and ``dflash roofline``: output
unchanged by a quantized drafter, a converted checkpoint that loads pre-quantized, and bad
input as one ``error:`` line with exit code 2."""

from __future__ import annotations

import json

import pytest
from cli_helpers import build_pair
from typer.testing import CliRunner

from dflash_mlx.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("dq"))


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_error_line(r, needle: str) -> None:
    assert r.exit_code == 2, (r.exit_code, r.stdout, r.stderr, r.exception)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr
    assert "Traceback" not in r.stdout + r.stderr


def model_args(root, drafter="drafter"):
    return ["--model", root / "target", "--drafter", root / drafter]


def test_run_prints_the_same_text_with_a_4bit_drafter(pair):
    args = [
        "run",
        *model_args(pair),
        "--max-tokens",
        "24",
        "--ignore-chat-template",
        "-q",
        "def parse_args(",
    ]
    dense = invoke(*args, "--draft-quant", "none")
    q4 = invoke(*args, "--draft-quant", "4")
    assert dense.exit_code == 0 and q4.exit_code == 0, (dense.stderr, q4.stderr)
    assert q4.stdout == dense.stdout and dense.stdout.strip()


@pytest.mark.parametrize("command", ["run", "serve", "bench"])
def test_a_draft_quant_not_offered_is_one_line_on_every_command(pair, command):
    extra = ["hi"] if command == "run" else []
    r = invoke(command, *model_args(pair), "--draft-quant", "3", *extra)
    one_error_line(r, "--draft-quant must be one of auto, none, 8, 4 (got '3')")


def test_convert_writes_a_checkpoint_that_loads_pre_quantized_and_decodes_alike(pair, tmp_path):
    from dflash_mlx.model import quantize
    from dflash_mlx.model.checkpoint import load_drafter

    out = tmp_path / "d4"
    r = invoke("convert", "--drafter", pair / "drafter", "--out", out, "--draft-quant", "4")
    assert r.exit_code == 0 and "4-bit layers" in r.stderr, r.stderr
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == 4
    assert quantize.bits_of(load_drafter(out)) == 4
    (pair / "d4").symlink_to(out, target_is_directory=True)
    args = ["run", "--max-tokens", "24", "--ignore-chat-template", "-q", "def parse_args("]
    pre = invoke(*args, *model_args(pair, "d4"), "--draft-quant", "4")
    dense = invoke(*args, *model_args(pair), "--draft-quant", "none")
    assert pre.exit_code == 0 and pre.stdout == dense.stdout, pre.stderr
    one_error_line(
        invoke("convert", "--drafter", pair / "drafter", "--out", out), "already holds a checkpoint"
    )
    one_error_line(
        invoke("convert", "--drafter", tmp_path, "--out", tmp_path / "x"), "has no config.json"
    )


def test_a_drafter_whose_scales_do_not_fit_its_weights_is_one_line(pair, tmp_path):
    out = tmp_path / "bad"
    assert invoke("convert", "--drafter", pair / "drafter", "--out", out).exit_code == 0
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization"]["group_size"] = 32
    (out / "config.json").write_text(json.dumps(cfg))
    r = invoke("run", "--model", pair / "target", "--drafter", out, "-q", "hi")
    one_error_line(r, "the scales do not match the weights")


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--chip", "M9 Hyper"], "--chip 'M9 Hyper' is unknown; use one of: M1, M1 Pro"),
        (["--draft-quant", "3"], "--draft-quant must be one of"),
        (["--quant", "3bit"], "--quant 3bit is not one of 4bit, 8bit, bf16, mxfp8"),
        (["--context", "0"], "--context must be at least 1"),
        (["--rollback", "undo"], "--rollback must be tape or replay"),
    ],
)
def test_roofline_bad_input_is_one_line(args, needle):
    one_error_line(invoke("roofline", "--model", "Qwen3.8-27B", *args), needle)


def test_roofline_of_a_model_whose_shapes_are_unknown_offline_names_the_fix(tmp_path):
    r = invoke("roofline", "--model", "Muse-Glimmer-30B")  # an alias without built-in shapes
    one_error_line(r, "its shapes are not known offline")


def test_roofline_reads_a_local_pairs_configs(pair):
    r = invoke("roofline", *model_args(pair), "--json")
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["block"] == 8 and out["quant"] == "4bit" and out["cycle_bytes"] > 0
