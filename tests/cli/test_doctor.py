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
