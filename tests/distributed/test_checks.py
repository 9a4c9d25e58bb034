"""Without a launch: rank 0's ``auto`` decisions reach the other ranks (``policy.Follow``,
over a simulated wire), the cost tables survive the trip, and the start-up handshake
refuses ranks started with other versions, flags or model files."""

import json

import pytest
from launch import FakeGroup as _Group

from dflash_mlx import DFlashError
from dflash_mlx.decoding.policy import Choice
from dflash_mlx.distributed import handshake, policy


class _Wire:
    """``policy.broadcast`` between a rank 0 that runs first and a rank 1 that runs after."""

    def __init__(self):
        self.sent = []

    def __call__(self, values, group, dtype=None):
        if group.rank() == 0:
            self.sent.append([int(v) for v in values])
            return self.sent[-1]
        return self.sent.pop(0)


class _Decides:
    def __init__(self):
        self.recorded, self.tree = [], False

    def choose(self, budget, match=0):
        return Choice(3, 2.0, probe=True, reason="why", lookup=True, siblings=1)

    def plain_run(self):
        return 7

    def copy_pays(self, match):
        return match > 2

    def record(self, block, cycle, seconds):
        self.recorded.append(block)

    def observe(self, block, seconds):
        pass


class _MustNotDecide(_Decides):
    def choose(self, budget, match=0):
        raise AssertionError("a rank other than 0 chose for itself")

    plain_run = copy_pays = choose


def test_every_rank_takes_rank_zeros_auto_decisions(monkeypatch):
    monkeypatch.setattr(policy, "broadcast", _Wire())
    lead = policy.follow(_Decides(), _Group(rank=0))
    other = policy.follow(_MustNotDecide(), _Group(rank=1))
    said = [lead.choose(8, 3), lead.plain_run(), lead.copy_pays(3), lead.copy_pays(1)]
    heard = [other.choose(8, 3), other.plain_run(), other.copy_pays(3), other.copy_pays(1)]
    assert said[1:] == heard[1:] == [7, True, False]
    c = heard[0]
    assert (c.block, c.lookup, c.siblings, c.probe) == (3, True, 1, True)
    other.tree = True  # the loop's setting reaches the wrapped policy
    other.record(3, None, 0.1)
    assert other.policy.tree and other.policy.recorded == [3]
    assert policy.follow(lead.policy, None) is lead.policy  # one process: as is


def test_cost_tables_arrive_whole():
    from types import SimpleNamespace

    import mlx.core as mx

    model = SimpleNamespace(block_size=4)
    one = mx.distributed.init()  # not launched: a group of one, rank 0
    tables = {"seconds": {1: 0.5, 2: 0.75, 4: 1.25}, "lookup_seconds": {1: 0.5, 3: 0.625}}
    assert policy.send_tables(tables, model, one) == tables


def _rows():
    row = handshake.facts([], ["dflash", "run", "--model", "demo"])
    other = dict(row, mlx="0.31.0", files="0" * 12, host="mac-b")
    return [row, row, other]


def test_the_handshake_names_each_rank_started_differently_and_what_differs():
    rows = _rows()
    assert handshake.differences(rows[:2]) == []
    (diff,) = handshake.differences(rows)
    assert diff.startswith("rank 2 (mac-b) has other mlx version (0.31.0 vs ")
    assert "model files" in diff and "flags" not in diff and "mlx-lm" not in diff
    last = handshake.table(rows).splitlines()[3].split()
    assert last[:2] == ["2", "mac-b"] and last[3] == "0.31.0"


def test_ranks_started_with_other_flags_are_refused_in_one_line(monkeypatch):
    rows = _rows()[:2]
    rows[1] = dict(rows[1], flags=handshake.facts([], ["dflash", "run", "-b", "4"])["flags"])
    monkeypatch.setattr(handshake, "gather", lambda row, group: rows)
    with pytest.raises(DFlashError, match=r"rank 1 \(.*\) has other command-line flags; start"):
        handshake.check(_Group(), [])
    assert handshake.check(None, []) == []  # one process: nothing to check


def test_facts_round_trip_and_compare_paths_by_name_and_files_by_size(tmp_path):
    import mlx.core as mx

    for host in ("a", "b"):
        (tmp_path / host / "m").mkdir(parents=True)
        (tmp_path / host / "m" / "model.safetensors").write_bytes(b"x" * 10)
    here, there = (
        handshake.facts([tmp_path / h / "m"], ["p", str(tmp_path / h / "m")]) for h in "ab"
    )
    assert here["flags"] == there["flags"] and here["files"] == there["files"]
    (tmp_path / "b" / "m" / "model.safetensors").write_bytes(b"x" * 11)
    assert handshake.facts([tmp_path / "b" / "m"])["files"] != here["files"]
    assert handshake.gather(here, mx.distributed.init()) == [here]


@pytest.fixture
def launched_doctor(monkeypatch):
    """``dflash doctor`` as rank 0 of a group (MLX's group of one, as ``init`` gives it
    unlaunched), its own checks reduced to one line: only the group's are under test."""
    import mlx.core as mx
    from typer.testing import CliRunner

    from dflash_mlx import distributed, doctor
    from dflash_mlx.cli import app

    monkeypatch.setattr(distributed, "group", lambda given=None: mx.distributed.init())
    monkeypatch.setattr(doctor, "run_checks", lambda: [doctor.Check("device", "here")])
    return lambda *a: CliRunner().invoke(app, ["doctor", *a])


def test_doctor_under_a_group_checks_it_and_prints_a_line_per_rank(launched_doctor):
    r = launched_doctor()
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[1].startswith("group") and "1 ranks answer (an all_sum in" in lines[1]
    assert "same versions and demo files on every rank" in lines[1]
    assert lines[3].split()[0] == "rank" and lines[4].split()[0] == "0"


def test_doctor_names_an_unreachable_group_and_a_rank_that_differs(launched_doctor, monkeypatch):
    answers = handshake.reachable
    monkeypatch.setattr(handshake, "reachable", lambda group, timeout: None)
    r = launched_doctor()
    assert r.exit_code == 1 and "did not complete in 30 s: a rank is down" in r.stdout
    monkeypatch.setattr(handshake, "reachable", answers)
    rows = _rows()
    monkeypatch.setattr(handshake, "gather", lambda row, group: rows)
    r = launched_doctor("--json")
    out = json.loads(r.stdout)
    assert r.exit_code == 1 and not out["checks"]["group"]["ok"] and len(out["ranks"]) == 3
    assert "rank 2 (mac-b) has other mlx version" in out["checks"]["group"]["value"]
