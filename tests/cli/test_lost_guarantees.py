"""No silent loss of a guarantee: when the CPU backend's few-row kernel or exact ops cannot
be built or cached, the model commands say so in one ``note:`` line, once; a documented
switch (``DFLASH_SMALL_GEMM=0``, ``DFLASH_EXACT_OPS=0``) is reported by ``dflash doctor``
as off, not as a failure."""

from __future__ import annotations

import subprocess
import sys

import pytest
from cli_helpers import REPO_ROOT, cli_env

from dflash_mlx import doctor, ops
from dflash_mlx.cli import common
from dflash_mlx.loading import backend

BUILT = {"active": True, "path": "/k.so", "error": None, "off": False}
OFF = {"active": False, "path": None, "error": "turned off (DFLASH_SMALL_GEMM=0)", "off": True}
FAILED = {"active": False, "path": None, "error": "[Errno 30] Read-only file system: '/c'"}


def status(small_gemm: dict, exact_ops: dict) -> dict:
    out = {"enabled": True, "blas": "/b.so", "blas_in_use": "OpenBLAS", "host_select": True}
    return out | {"small_gemm": small_gemm, "exact_ops": exact_ops}


def test_an_unwritable_cache_dir_is_one_note_line_naming_the_loss_and_the_fix(tiny_dir, tmp_path):
    (tmp_path / "file").write_text("x")  # a folder under a file cannot be made, even by root
    env = cli_env(DFLASH_CACHE_DIR=tmp_path / "file" / "cache")
    pair = ["--model", tiny_dir / "qwen3", "--drafter", tiny_dir / "d2_qwen3"]
    argv = [sys.executable, "-m", "dflash_mlx.cli", "run", *pair, "--max-tokens", "4", "hi"]
    r = subprocess.run(
        [str(a) for a in argv],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    notes = [ln for ln in r.stderr.splitlines() if ln.startswith("note:")]
    assert len(notes) == 1, r.stderr
    assert "few-row kernel" in notes[0] and "no longer bit-identical" in notes[0]
    assert "DFLASH_CACHE_DIR" in notes[0] and "Traceback" not in r.stderr


def test_the_note_is_said_once_and_not_for_a_switch(monkeypatch, capsys):
    monkeypatch.setattr(common, "_noted", set())
    monkeypatch.setattr(ops, "backend_status", lambda: status(OFF, {**OFF, "error": "off"}))
    common.note_lost_kernels()
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(ops, "backend_status", lambda: status(BUILT, FAILED))
    common.note_lost_kernels()
    common.note_lost_kernels()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("note: the exact ops could not be built")


@pytest.mark.parametrize("which", ["small_gemm", "exact_ops"])
def test_doctor_reports_a_switched_off_kernel_as_off_not_failed(monkeypatch, which):
    parts = {"small_gemm": BUILT, "exact_ops": BUILT, which: OFF}
    monkeypatch.setattr(backend, "install", lambda pair=None: True)
    monkeypatch.setattr(ops, "backend_status", lambda: status(**parts))
    check = doctor.cpu_backend()
    assert check.ok and " off (turned off (DFLASH_SMALL_GEMM=0))" in check.value
    assert "failed" not in check.value


def test_doctor_still_fails_a_kernel_that_could_not_be_built(monkeypatch):
    monkeypatch.setattr(backend, "install", lambda pair=None: True)
    monkeypatch.setattr(ops, "backend_status", lambda: status(FAILED, BUILT))
    check = doctor.cpu_backend()
    assert not check.ok and "few-row kernel failed" in check.value
