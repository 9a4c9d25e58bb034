"""The training entry points (distill, drafter, rounds) on bad input: one ``error:`` line,
exit 2, no traceback, before any work; Ctrl-C / SIGTERM save and exit 130 / 143; an
interrupted distillation resumes."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import build_target

from dflash_mlx.loading.loader import load_target
from dflash_mlx.train import checks, distill, drafter, rounds
from dflash_mlx.train.drafter import TrainConfig, train

PROMPTS = ["def parse_args(argv):", "Explain import os.", "class Foo:", "Hello world!"] * 2
TINY_SHAPE = {
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 64,
    "block_size": 4,
    "selector_rank": 8,
    "mask_token_id": 1,
}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(root, target dir, distill folder with train/ and heldout/)."""
    root = tmp_path_factory.mktemp("entry")
    build_target(root / "t", "qwen3")
    target, tok = load_target(str(root / "t"))
    for split in ("train", "heldout"):
        distill.run(
            target,
            tok,
            root / "data",
            [0, 2, 3],
            split,
            8,
            4,
            4,
            prompts=PROMPTS,
            log=lambda m: None,
        )
    return root, root / "t", root / "data"


def _refused(main, argv, capsys, code=2) -> str:
    """Run main(argv) in-process; assert exit code, one error line, no traceback."""
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert e.value.code == code, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


def _drafter_args(tiny, out, *more):
    _root, t, data = tiny
    base = ["--target", t, "--data", data, "--out", out, "--mask-token", "<|mask|>"]
    return base + ["--layers", "1", "--seqs", "2", "--blocks", "2", *more]


@pytest.mark.parametrize(
    ("more", "says"),
    [
        (["--minutes", "0"], "--minutes: must be a finite number > 0"),
        (["--minutes", "-1"], "--minutes: must be a finite number > 0"),
        (["--minutes", "nan"], "--minutes"),
        (["--minutes", "1e300"], "--minutes"),
        (["--steps", "0"], "--steps: must be an integer >= 1"),
        (["--seqs", "0"], "--seqs: must be an integer >= 1"),
        (["--blocks", "0"], "--blocks"),
        (["--layers", "0"], "--layers"),
        (["--rank", "0"], "--rank"),
        (["--vocab-cap", "4"], "--vocab-cap: must be an integer >= 16"),
        (["--lr", "-1"], "--lr"),
        (["--lr", "inf"], "--lr"),
        (["--eval-every", "-1"], "--eval-every"),
        (["--seqs", "two"], "'two' is not an integer"),
        (["--bogus"], "unrecognized arguments"),
    ],
)
def test_drafter_refuses_out_of_range_options(tiny, tmp_path, capsys, more, says):
    line = _refused(drafter.main, _drafter_args(tiny, tmp_path / "o", *more), capsys)
    assert says in line and "--help" in line
    assert not (tmp_path / "o").exists()  # refused before any work


def test_drafter_refuses_missing_or_empty_data_and_a_file_as_out(tiny, tmp_path, capsys):
    _root, t, data = tiny
    args = ["--target", t, "--out", tmp_path / "o"]
    line = _refused(drafter.main, [*args, "--data", tmp_path / "nowhere"], capsys)
    assert "no such folder" in line and "dflash_mlx.train.distill" in line
    (tmp_path / "empty" / "train").mkdir(parents=True)
    line = _refused(drafter.main, [*args, "--data", tmp_path / "empty"], capsys)
    assert "no finished shards" in line and "--split train" in line
    (tmp_path / "half").mkdir()
    os.symlink(data / "train", tmp_path / "half" / "train")
    line = _refused(drafter.main, [*args, "--data", tmp_path / "half"], capsys)
    assert "heldout" in line and "--split heldout" in line
    (tmp_path / "afile").write_text("x")
    line = _refused(drafter.main, _drafter_args(tiny, tmp_path / "afile"), capsys)
    assert "is a file" in line


def test_drafter_refuses_an_unknown_mask_token(tiny, tmp_path, capsys):
    args = _drafter_args(tiny, tmp_path / "o", "--mask-token", "<nope>", "--steps", "1")
    line = _refused(drafter.main, args, capsys)
    assert "--mask-token '<nope>' is not a token" in line


def test_drafter_refuses_data_another_target_made(tiny, tmp_path, capsys):
    build_target(tmp_path / "wide", "qwen3", hidden=32)
    args = _drafter_args(tiny, tmp_path / "o", "--steps", "1")
    args[1] = tmp_path / "wide"
    line = _refused(drafter.main, args, capsys)
    assert "features 192 wide" in line and "--target" in line


def test_drafter_resume_needs_a_saved_run_and_a_fresh_run_never_overwrites_one(
    tiny, tmp_path, capsys
):
    out = tmp_path / "o"
    line = _refused(drafter.main, _drafter_args(tiny, out, "--resume"), capsys)
    assert "nothing to resume" in line and "without --resume" in line
    drafter.main([str(a) for a in _drafter_args(tiny, out, "--steps", "2")])
    capsys.readouterr()
    assert json.loads((out / "train_state" / "state.json").read_text())["step"] == 2
    line = _refused(drafter.main, _drafter_args(tiny, out, "--steps", "3"), capsys)
    assert "holds a saved run" in line and "--resume" in line
    line = _refused(drafter.main, _drafter_args(tiny, out, "--resume", "--layers", "2"), capsys)
    assert "cannot resume" in line  # other options: its weights do not fit
    drafter.main([str(a) for a in _drafter_args(tiny, out, "--steps", "3", "--resume")])
    assert json.loads((out / "train_state" / "state.json").read_text())["step"] == 3
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    (shipped / "config.json").write_text("{}")
    line = _refused(drafter.main, _drafter_args(tiny, shipped), capsys)
    assert "would overwrite" in line


def test_training_saves_every_step_on_ctrl_c_and_resumes_from_it(tiny, tmp_path, monkeypatch):
    root, _t, data = tiny
    target, _tok = load_target(str(root / "t"))
    out, real = tmp_path / "o", drafter.Trainer.step

    def step(self, frac):
        if self.st["step"] == 3:
            raise KeyboardInterrupt
        return real(self, frac)

    monkeypatch.setattr(drafter.Trainer, "step", step)
    cfg = TrainConfig(steps=6, seqs=2, n_blocks=2, eval_seqs=2, warmup=1)
    with pytest.raises(checks.Stop) as e:
        train(target, data, out, cfg, dict(TINY_SHAPE), log=lambda m: None)
    assert e.value.code == 130 and "saved step 3" in e.value.saved
    assert json.loads((out / "train_state" / "state.json").read_text())["step"] == 3
    monkeypatch.setattr(drafter.Trainer, "step", real)
    again = train(target, data, out, cfg, dict(TINY_SHAPE), resume=True, log=lambda m: None)
    assert again["step"] == 6


def _spawn(module, *argv):
    return subprocess.Popen(
        [sys.executable, "-m", module, *map(str, argv)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,  # conftest gave SIGINT its default back: children get it too
    )


def _stop_after(p, first: str, sig) -> tuple:
    """Send sig once the process printed a line starting with ``first``."""
    for line in p.stdout:
        if line.startswith(first):
            break
    p.send_signal(sig)
    _out, err = p.communicate(timeout=120)
    return p.returncode, err


def test_drafter_saves_on_ctrl_c_and_sigterm_and_says_where(tiny, tmp_path):
    out = tmp_path / "o"
    args = _drafter_args(tiny, out, "--minutes", "5")
    rc, err = _stop_after(_spawn("dflash_mlx.train.drafter", *args), "step 20", signal.SIGINT)
    step = json.loads((out / "train_state" / "state.json").read_text())["step"]
    assert rc == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (
        f"interrupted: saved step {step} in {out / 'train_state'}; rerun with --resume to continue"
    )
    assert step >= 20
    p = _spawn("dflash_mlx.train.drafter", *args, "--resume")
    rc, err = _stop_after(p, "step", signal.SIGTERM)
    assert rc == 143 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("terminated: saved step")
    assert json.loads((out / "train_state" / "state.json").read_text())["step"] > step


@pytest.mark.parametrize(
    ("more", "says"),
    [
        (["--batch", "0"], "--batch: must be an integer >= 1"),
        (["--max-new", "0"], "--max-new: must be an integer >= 1"),
        (["--limit", "0"], "--limit"),
        (["--limit", "-1"], "--limit"),
        (["--split", "test"], "invalid choice"),
    ],
)
def test_distill_refuses_out_of_range_options(tiny, tmp_path, capsys, more, says):
    _root, t, _data = tiny
    args = ["--target", t, "--out", tmp_path / "d", *more]
    assert says in _refused(distill.main, args, capsys)
    assert not (tmp_path / "d").exists()


def test_distill_refuses_an_out_it_cannot_write(tiny, tmp_path, capsys):
    _root, t, _data = tiny
    (tmp_path / "afile").write_text("x")
    line = _refused(distill.main, ["--target", t, "--out", tmp_path / "afile"], capsys)
    assert "is a file" in line
    line = _refused(distill.main, ["--target", t, "--out", tmp_path / "afile" / "d"], capsys)
    assert "cannot be written" in line
    if os.geteuid() != 0:  # root writes anywhere
        (tmp_path / "ro").mkdir(mode=0o500)
        line = _refused(distill.main, ["--target", t, "--out", tmp_path / "ro" / "d"], capsys)
        assert "cannot be written" in line
    line = _refused(distill.main, ["--target", tmp_path / "none", "--out", tmp_path], capsys)
    assert "none" in line


def test_distill_refuses_a_folder_of_another_targets_answers(tiny, tmp_path, capsys):
    _root, t, data = tiny
    meta = json.loads((data / "train" / "meta.json").read_text())
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "shard_0000").mkdir()
    (tmp_path / "train" / "meta.json").write_text(json.dumps({**meta, "layer_ids": [0, 1]}))
    line = _refused(distill.main, ["--target", t, "--out", tmp_path, "--limit", "2"], capsys)
    assert "target layers [0, 1]" in line


def test_an_interrupted_distillation_resumes(tiny, tmp_path, capsys):
    """A killed run leaves a claim with its dead pid: the rerun redoes that shard at once;
    a stopped run releases its claim, exits 143 and says so."""
    _root, t, _data = tiny
    out = tmp_path / "d"
    args = ["--target", t, "--out", out, "--limit", "6", "--batch", "1", "--max-new", "16"]
    p = _spawn("dflash_mlx.train.distill", *args)
    _stop_after(p, "shard_0000: batch 1", signal.SIGKILL)
    assert (out / "train" / "shard_0000.tmp").is_dir()
    assert not (out / "train" / "shard_0000").exists()
    distill.main([str(a) for a in args])
    said = capsys.readouterr().out
    assert "shard_0000: batch 1," in said and said.endswith("new tokens; shards all done\n")
    assert (out / "train" / "shard_0000").is_dir()
    assert not list((out / "train").glob("*.tmp")) and not list((out / "train").glob(".*"))
    other = tmp_path / "e"
    p = _spawn("dflash_mlx.train.distill", *[other if a == out else a for a in args])
    rc, err = _stop_after(p, "shard_0000: batch 1", signal.SIGTERM)
    assert rc == 143 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (
        f"terminated: {other / 'train' / 'shard_0000'} was not finished and is free again; "
        "rerun the same command to resume"
    )
    assert not (other / "train" / "shard_0000.tmp").exists()


def test_distill_ctrl_c_in_process_releases_the_claim(tiny, tmp_path, monkeypatch):
    root, _t, _data = tiny
    target, tok = load_target(str(root / "t"))

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(distill, "generate_batch", boom)
    with pytest.raises(checks.Stop) as e:
        distill.run(target, tok, tmp_path, [0, 1], "train", 4, 2, 4, prompts=PROMPTS)
    assert e.value.code == 130 and "shard_0000" in e.value.saved
    assert not (tmp_path / "train" / "shard_0000.tmp").exists()


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["run", "--round", "0"], "--round: must be an integer >= 1"),
        (["run", "--round", "1", "--workers", "0"], "--workers"),
        (["run", "--round", "1", "--minutes", "0"], "--minutes"),
        (["run", "--round", "1", "--distill-share", "1.5"], "--distill-share"),
        (["run", "--round", "1", "--distill-share", "-0.1"], "--distill-share"),
        (["_worker", "--round", "1", "--deadline", "nan"], "--deadline"),
        (["fly", "--round", "1"], "invalid choice"),
        (["train"], "--round"),
    ],
)
def test_rounds_refuses_out_of_range_options(tmp_path, capsys, argv, says):
    assert says in _refused(rounds.main, [*argv, "--work", tmp_path / "w"], capsys)


def test_rounds_train_and_export_refuse_a_work_folder_without_answers(tmp_path, capsys):
    work = tmp_path / "w"
    line = _refused(rounds.main, ["train", "--round", "2", "--work", work], capsys)
    assert "no answers of rounds 1..2" in line and f"distill --round 2 --work {work}" in line
    (work / "r01" / "train" / "shard_0000").mkdir(parents=True)
    line = _refused(rounds.main, ["train", "--round", "1", "--work", work], capsys)
    assert "heldout" in line
    line = _refused(rounds.main, ["export", "--round", "3", "--work", work], capsys)
    assert "r03" in line and "distill --round 3" in line
    (tmp_path / "afile").write_text("x")
    line = _refused(rounds.main, ["train", "--round", "1", "--work", tmp_path / "afile"], capsys)
    assert "is a file" in line


def test_a_signal_during_a_save_waits_for_the_save(tmp_path):
    with pytest.raises(checks.Stop) as e, checks.shielded():
        os.kill(os.getpid(), signal.SIGTERM)
        (tmp_path / "saved").write_text("whole")  # still runs
    assert e.value.code == 143 and (tmp_path / "saved").read_text() == "whole"


def test_running_out_of_memory_is_one_line_naming_the_sizes(tiny, tmp_path, capsys, monkeypatch):
    def too_big(*a, **k):
        raise MemoryError

    monkeypatch.setattr(drafter, "train", too_big)
    line = _refused(drafter.main, _drafter_args(tiny, tmp_path / "o"), capsys)
    assert line == "error: out of memory; lower --seqs or --blocks or free some memory"


def test_rounds_distill_reports_failed_workers_in_one_line(tmp_path, capsys, monkeypatch):
    real = subprocess.Popen
    fail = [sys.executable, "-c", "raise SystemExit(3)"]
    monkeypatch.setattr(rounds.subprocess, "Popen", lambda cmd, **kw: real(fail, **kw))
    work = tmp_path / "w"
    line = _refused(rounds.main, ["distill", "--round", "1", "--work", work], capsys)
    assert "workers exited with [3, 3]" in line
    assert json.loads((work / "r01" / "distill.json").read_text())[0]["workers"] == 2
