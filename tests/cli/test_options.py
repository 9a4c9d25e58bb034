"""The decoding and model options are declared once (``settings.OPTIONS``, ``cli/options.py``):
every command offers them with the same flags, defaults and help, hands its body one validated
``GenerationConfig``, and names a bad value by its flag in one ``error:`` line."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import typer
from typer.main import get_command
from typer.testing import CliRunner

from dflash_mlx.cli import app
from dflash_mlx.cli.options import MODEL, ModelOptions, decoding, expand
from dflash_mlx.settings import FLAGS, MAX_TOKENS, OPTIONS, GenerationConfig

runner = CliRunner()
COMMANDS = ("run", "chat", "serve", "bench")
# What bench declares differently: it samples at --temp alone and runs DFlash 1 and 2 both
# (so no --top-p ... --no-selector), with a fixed seed so runs compare.
BENCH_FIELDS = {"max_tokens", "temperature", "seed", "block_size", "lookup", "tree"}
BENCH_FIELDS |= {"kv_bits", "kv_group_size", "quantized_kv_start"}  # every method quantizes alike
BENCH_DEFAULTS = {"seed": 0}
RUN = decoding("run")


def _options(command: str) -> dict[str, object]:
    """The click options of a command, by their first flag."""
    cmd = get_command(app).commands[command]
    return {p.opts[0]: p for p in cmd.params if p.opts and p.opts[0].startswith("--")}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_decoding_flag_is_on_every_command_with_one_default(command):
    opts = _options(command)
    for flag in OPTIONS:
        if command == "bench" and flag.field not in BENCH_FIELDS:
            assert flag.name not in opts, flag.name
            continue
        opt = opts[flag.name]
        assert opt.opts == [flag.name, *([flag.short] if flag.short else [])]
        assert opt.secondary_opts == []
        want = flag.default
        if flag.field == "max_tokens":
            want = MAX_TOKENS[command]
        elif command == "bench":
            want = BENCH_DEFAULTS.get(flag.field, want)
        assert opt.default == want, (command, flag.name, opt.default)
        if flag.field != "max_tokens" and not (command == "bench" and flag.field == "seed"):
            assert opt.help == flag.help, (command, flag.name)
    for name in ("--model", "--drafter", "--draft-vocab", "--quant", "--offline"):
        assert name in opts, (command, name)


def test_max_tokens_keeps_its_short_option_and_each_command_its_help():
    helps = {"run": "Tokens to generate.", "chat": "Tokens per answer."}
    helps |= {"serve": "Default max tokens.", "bench": "Tokens per prompt."}
    for command, text in helps.items():
        cmd = get_command(app).commands[command]
        (opt,) = [p for p in cmd.params if "--max-tokens" in p.opts]
        assert "-m" in opt.opts and opt.help == text


def test_serve_help_lists_no_tree():
    r = runner.invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "--no-tree" in r.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_a_bad_value_is_one_error_line_naming_the_flag(command, tmp_path):
    r = runner.invoke(app, [command, "--model", str(tmp_path / "none"), "--temp", "-1"])
    assert r.exit_code == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --temp must be >= 0"), r.stderr


def _fake_serve(monkeypatch, args: list[str], hybrid=False) -> tuple[list, list]:
    """Run ``dflash serve`` with a stand-in pair: (run_server's keywords, warm-ups done)."""
    from dflash_mlx import server
    from dflash_mlx.cli import common
    from dflash_mlx.decoding import warmup

    calls, warmed = [], []
    adapter = SimpleNamespace(is_hybrid=hybrid)
    model = SimpleNamespace(name="m", block_size=8, group=None, adapter=adapter, target=None)
    monkeypatch.setattr(common, "load_pair", lambda src, q, v, cfg, **kw: (model, None))
    monkeypatch.setattr(server, "run_server", lambda *a, **k: calls.append((k, list(warmed))))
    monkeypatch.setattr(server, "listen", lambda host, port: None)
    monkeypatch.setattr(warmup, "ensure", lambda m, log=None: warmed.append(m))
    r = runner.invoke(app, ["serve", "--model", "x", *args])
    assert r.exit_code == 0, r.stderr
    return calls, warmed


def test_serve_no_tree_is_the_default_of_requests(monkeypatch):
    calls, _ = _fake_serve(monkeypatch, ["--no-tree", "--no-lookup"])
    assert calls[0][0]["defaults"] == GenerationConfig(max_tokens=512, tree=False, lookup=False)


def test_serve_sets_step_costs_before_serving_under_auto(monkeypatch):
    calls, warmed = _fake_serve(monkeypatch, ["--max-batch", "1"])  # each via stream_generate
    assert len(warmed) == 1 and calls[0][1] == warmed  # before run_server
    calls, warmed = _fake_serve(monkeypatch, [], hybrid=True)  # a batch runs it one at a time
    assert len(warmed) == 1
    calls, warmed = _fake_serve(monkeypatch, [])  # a batch's planner starts from the tables
    assert len(warmed) == 1 and calls[0][1] == warmed
    calls, warmed = _fake_serve(monkeypatch, ["--block-size", "4", "--max-batch", "1"])
    assert warmed == [] and len(calls) == 1


def test_flags_for_messages_come_from_the_table():
    assert FLAGS == {f.field: f.name for f in OPTIONS if not f.negate}
    assert FLAGS["temperature"] == "--temp" and "tree" not in FLAGS
    fields = set(GenerationConfig.__dataclass_fields__)
    assert {f.field for f in OPTIONS} <= fields
    by_name = {f.name: f for f in OPTIONS}
    assert by_name["--no-tree"].value(True) is False and by_name["--no-tree"].default is False
    assert by_name["--block-size"].value("4") == 4 and by_name["--block-size"].default == "auto"


def test_expand_hands_the_command_one_config_and_one_model():
    got = {}
    mini = typer.Typer()

    @mini.command()
    @expand()
    def cmd(src: ModelOptions = MODEL, cfg: GenerationConfig = RUN, x: int = 1):
        got.update(src=src, cfg=cfg, x=x)

    r = runner.invoke(mini, ["--model", "m", "--temp", "0.5", "--no-selector", "--x", "3"])
    assert r.exit_code == 0, r.output
    assert got["src"] == ModelOptions(model="m")
    assert got["cfg"] == GenerationConfig(temperature=0.5, use_selector=False) and got["x"] == 3


def test_an_option_declared_twice_is_refused():
    with pytest.raises(TypeError, match="declared twice"):

        @expand()
        def cmd(cfg: GenerationConfig = RUN, temp: float = 0.0):
            pass
