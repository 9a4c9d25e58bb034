"""`dflash doctor`: every line passes on this install, `--json` is one object, and a failing
check (the parity check, a Metal kernel, a check that raises) exits 1 naming it."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dflash_mlx import doctor
from dflash_mlx.cli import app
from dflash_mlx.model import metal_kernel

runner = CliRunner()


@pytest.fixture(autouse=True)
def _own_hub_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)


def invoke(*args):
    return runner.invoke(app, list(args))


def test_doctor_passes_here_and_names_every_part():
    r = invoke("doctor")
    assert r.exit_code == 0, r.output
    for name in doctor.ORDER:
        assert any(line.startswith(name) for line in r.stdout.splitlines()), name
    assert r.stdout.strip().endswith("all checks passed")
    assert "16 greedy tokens equal plain decoding's" in r.stdout


def test_doctor_json_is_one_object():
    r = invoke("doctor", "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["ok"] is True and list(rep["checks"]) == list(doctor.ORDER)
    assert all(c["ok"] and c["value"] for c in rep["checks"].values())


def test_a_parity_mismatch_exits_1_naming_the_token(monkeypatch):
    monkeypatch.setattr(
        "dflash_mlx.tiny_pair.greedy_parity",
        lambda pair, prompt, n: ([1] * n, [1, 1, 2] + [1] * (n - 3)),
    )
    r = invoke("doctor")
    assert r.exit_code == 1
    assert "parity" in r.stdout and "differs from plain decoding at token 2 of 16" in r.stdout
    assert r.stdout.strip().endswith("failed: parity")


@pytest.mark.parametrize("gap,code", [(1e-6, 0), (0.3, 1)])
def test_off_the_exact_backend_a_near_tie_is_allowed(monkeypatch, gap, code):
    """Metal's guarantee (docs/algorithm.md §4.2.1): outputs may part only at a near-tie."""
    monkeypatch.setattr(
        "dflash_mlx.tiny_pair.greedy_parity",
        lambda pair, prompt, n: ([1] * n, [1, 2] + [1] * (n - 2)),
    )
    monkeypatch.setattr(doctor, "_bit_exact_backend", lambda: False)
    monkeypatch.setattr("dflash_mlx.tiny_pair.tie_gap", lambda *a: gap)
    r = invoke("doctor")
    assert r.exit_code == code, r.output
    line = next(x for x in r.stdout.splitlines() if x.startswith("parity"))
    assert "at token 1 of 16" in line
    assert ("near-tie" in line and "allowed" in line) if code == 0 else "not at a near-tie" in line


def test_tie_gap_is_zero_for_the_same_token_and_positive_otherwise(tmp_path):
    from dflash_mlx import tiny_pair

    pair = tiny_pair.load_pair(*tiny_pair.write_pair(tmp_path))
    prompt = doctor.PARITY_PROMPT
    plain, _ = tiny_pair.greedy_parity(pair, prompt, 4)
    assert tiny_pair.tie_gap(pair, prompt, plain, plain, 2) == 0
    other = plain[:2] + [(plain[2] + 1) % tiny_pair.VOCAB]
    assert tiny_pair.tie_gap(pair, prompt, plain, other, 2) > doctor.TIE_GAP


def test_a_failing_metal_kernel_exits_1_naming_it(monkeypatch, capsys):
    def build_fails(**kw):
        raise RuntimeError("cannot compile")

    monkeypatch.setattr(metal_kernel, "use_metal", lambda: True)
    monkeypatch.setattr(metal_kernel, "_cache", {})
    monkeypatch.setattr(metal_kernel, "_problems", {})
    monkeypatch.setattr(metal_kernel, "factory", build_fails)
    monkeypatch.setitem(doctor.CHECKS, "parity", lambda: doctor.Check("parity", "skipped"))
    r = invoke("doctor", "--json")
    assert r.exit_code == 1
    rep = json.loads(r.stdout)
    kernels = rep["checks"]["metal kernels"]
    assert rep["ok"] is False and kernels["ok"] is False
    assert "two_tap_conv failed: RuntimeError: cannot compile" in kernels["value"]


@pytest.mark.parametrize("name", ["memory", "caches"])
def test_a_check_that_raises_is_a_failing_line(monkeypatch, name):
    def broken():
        raise OSError("disk gone")

    monkeypatch.setitem(doctor.CHECKS, name, broken)
    monkeypatch.setitem(doctor.CHECKS, "parity", lambda: doctor.Check("parity", "skipped"))
    r = invoke("doctor")
    assert r.exit_code == 1
    line = next(x for x in r.stdout.splitlines() if x.startswith(name))
    assert "check failed (OSError: disk gone)" in line and line.endswith("<- FAILED")
