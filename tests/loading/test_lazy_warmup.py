"""The warm-up runs only when ``block_size="auto"`` needs it: a fixed block never pays for
it; ``auto`` reads the stored table, spot-checked against the machine as it is now, or
measures once; the table's key names the chip, never the host name."""

from __future__ import annotations

import json

import pytest
from cli_helpers import build_pair
from typer.testing import CliRunner

from dflash_mlx.decoding import warmup
from dflash_mlx.loading import diskcache

pytestmark = pytest.mark.spot_check


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(root))
    monkeypatch.delenv("DFLASH_CACHE", raising=False)
    return root


@pytest.fixture
def no_warm_up(monkeypatch):
    """Every way to set the step costs raises: what runs with it never warmed up."""

    def refuse(*a, **k):
        raise AssertionError("warmed up")

    for name in ("warm_up", "spot_check"):
        monkeypatch.setattr(warmup, name, refuse)
    monkeypatch.setattr(diskcache, "read_costs", refuse)


def test_a_fixed_block_size_loads_and_decodes_without_a_warm_up(tiny_dir, cache, no_warm_up):
    from dflash_mlx import generate, load

    model, tok = load(str(tiny_dir / "qwen3"), drafter=str(tiny_dir / "d2_qwen3"))
    assert generate(model, tok, "def f(", max_tokens=8, block_size=4)
    assert model.tuning is None
    with pytest.raises(AssertionError, match="warmed up"):  # auto is what would need it
        generate(model, tok, "def f(", max_tokens=8)


def test_dflash_run_with_a_fixed_block_does_no_warm_up(tmp_path, cache, monkeypatch, no_warm_up):
    from dflash_mlx.cli import app

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pair = build_pair(tmp_path / "pair")
    args = ["run", "--model", pair / "target", "--drafter", pair / "drafter"]
    fixed = CliRunner().invoke(app, [str(a) for a in [*args, "--block-size", "4", "-m", "8", "Hi"]])
    assert fixed.exit_code == 0, fixed.output
    auto = CliRunner().invoke(app, [str(a) for a in [*args, "-m", "8", "Hi"]])
    assert auto.exit_code != 0 and "warmed up" in repr(auto.exception)


def test_auto_measures_at_its_first_request_and_stores_the_table(tiny_dir, cache, monkeypatch):
    from dflash_mlx import generate, load

    calls = []
    real = warmup.warm_up
    monkeypatch.setattr(warmup, "warm_up", lambda m: calls.append(1) or real(m))
    model, tok = load(str(tiny_dir / "qwen3"), drafter=str(tiny_dir / "d2_qwen3"))
    assert model.tuning is None and not calls and not (cache / "costs").exists()
    generate(model, tok, "def f(", max_tokens=8)
    generate(model, tok, "def g(", max_tokens=8)
    assert len(calls) == 1 and model.tuning is not None
    stored = json.loads(next((cache / "costs").glob("*/costs.json")).read_text())
    assert stored["seconds"]["1"] == model.tuning.measured.seconds[1]


def _stored_pair(tiny_dir, monkeypatch, plain: float, ratio: float, **load_kw):
    """A freshly loaded pair (``load(**load_kw)``) whose stored table has a plain step of
    ``plain`` seconds and block B at ``ratio`` plain steps, and a spot check that finds 10 ms
    and 1.5."""
    from dflash_mlx import load

    model, _ = load(str(tiny_dir / "qwen3"), drafter=str(tiny_dir / "d2_qwen3"), **load_kw)
    B = model.block_size
    seconds = {1: plain, **{b: plain * ratio for b in range(2, B + 1)}}
    diskcache.write_costs(model, {"seconds": seconds, "lookup_seconds": dict(seconds)})
    monkeypatch.setattr(warmup, "spot_check", lambda m: (0.010, 1.5))
    calls = []
    monkeypatch.setattr(warmup, "warm_up", lambda m: calls.append(1) or _fake_warm_up(m))
    return model, calls


def _fake_warm_up(model):
    from dflash_mlx.decoding.schedule import CostTable, Tuning

    tables = [CostTable(model.block_size) for _ in range(2)]
    for t in tables:
        t.seconds = {1: 0.010, model.block_size: 0.015}
    model.tuning = Tuning(*tables)
    return model.tuning


def test_a_stored_table_the_spot_check_agrees_with_is_used_as_stored(tiny_dir, cache, monkeypatch):
    model, calls = _stored_pair(tiny_dir, monkeypatch, plain=0.011, ratio=1.6)
    warmup.ensure(model)
    assert not calls and model.tuning.measured.seconds[1] == 0.011


def test_a_table_stored_on_a_busy_machine_is_measured_again(tiny_dir, cache, monkeypatch):
    notes = []
    model, calls = _stored_pair(tiny_dir, monkeypatch, plain=0.011, ratio=4.0)  # blocks dear
    warmup.ensure(model, notes.append)
    assert calls == [1] and model.tuning.measured.seconds[model.block_size] == 0.015
    B = model.block_size
    why = f"put block {B} at 4.00 plain steps, 1.50 now"
    assert notes == [f"note: the stored warm-up costs {why}; measuring them again"]
    assert diskcache.read_costs(model)["seconds"][model.block_size] == 0.015  # replaced


def test_a_stored_plain_step_far_from_the_spot_checks_is_measured_again():
    B, table = 8, {1: 0.030, 8: 0.045}
    stored = {"seconds": table, "lookup_seconds": table}
    assert warmup.disagreement(stored, 0.010, 1.5, B).startswith("put a plain step at 30.0 ms")
    assert warmup.disagreement(stored, 0.025, 1.6, B) is None  # within 1.3x: trusted
    assert warmup.disagreement(stored, 0.030, 1.1, B).startswith("put block 8 at 1.50")
    assert warmup.disagreement({"seconds": {1: 0.03}}, 0.03, 1.5, B).startswith("lack")


def test_the_costs_key_names_the_chip_not_the_host_name(tmp_path, cache, monkeypatch):
    import platform

    import mlx.core as mx

    t, d = tmp_path / "t", tmp_path / "d"
    t.write_text("target")
    d.write_text("drafter")
    before = diskcache.costs_file(str(t), str(d))
    monkeypatch.setattr(platform, "node", lambda: "Johns-MacBook-Pro.local")
    assert diskcache.costs_file(str(t), str(d)) == before
    monkeypatch.setattr(mx, "device_info", lambda: {"device_name": "Apple M3 Max"})
    assert "Apple M3 Max" in diskcache.chip()
    assert diskcache.costs_file(str(t), str(d)) != before


def test_the_stale_table_note_goes_to_loads_log_and_nowhere_when_quiet(
    tiny_dir, cache, monkeypatch, capsys
):
    logged = []
    model, calls = _stored_pair(tiny_dir, monkeypatch, 0.011, 4.0, log=logged.append)
    warmup.ensure(model)  # as auto's first request calls it: without a log of its own
    assert calls == [1] and len(logged) == 1 and "measuring them again" in logged[0]
    model, calls = _stored_pair(tiny_dir, monkeypatch, 0.011, 4.0, quiet=True)
    warmup.ensure(model)
    assert calls == [1] and capsys.readouterr().err == ""


def test_costs_check_off_keeps_a_stored_table_the_spot_check_would_refuse(
    tiny_dir, cache, monkeypatch
):
    monkeypatch.setenv("DFLASH_COSTS_CHECK", "0")
    model, calls = _stored_pair(tiny_dir, monkeypatch, plain=0.011, ratio=4.0)  # would refuse
    monkeypatch.setattr(warmup, "spot_check", lambda m: pytest.fail("spot-checked"))
    warmup.ensure(model)
    assert not calls and model.tuning.measured.seconds[1] == 0.011
