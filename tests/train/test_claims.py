"""Shard claims: a live holder's claim is left alone, a dead one's is taken over at once on
this host (or after STALE_S elsewhere), an interrupted generation releases its own."""

import json
import os
import subprocess
import sys
import time

import pytest

from dflash_mlx.train import claims


def _fake_claim(path, **owner):
    tmp = claims.tmp_dir(path)
    tmp.mkdir(parents=True)
    if owner:
        (tmp / claims.OWNER).write_text(json.dumps({**claims.me(), **owner}))
    return tmp


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _age(tmp, seconds):
    t = time.time() - seconds
    os.utime(tmp, (t, t))


def test_a_claim_records_its_holder_and_blocks_others(tmp_path):
    path = tmp_path / "shard_0000"
    assert claims.claim(path)
    rec = claims.owner(claims.tmp_dir(path))
    assert rec["pid"] == os.getpid() and rec["host"] == claims.me()["host"]
    assert not list(tmp_path.glob(".*"))  # no private or dead folders left behind
    (path).mkdir()
    assert not claims.claim(path)  # finished


def test_a_dead_processs_claim_is_taken_over_at_once(tmp_path):
    path = tmp_path / "shard_0001"
    _fake_claim(path, pid=_dead_pid())
    assert claims.holder(path) is None
    assert claims.claim(path)
    assert claims.owner(claims.tmp_dir(path))["pid"] == os.getpid()


def test_a_live_processs_claim_is_left_to_it_until_it_goes_stale(tmp_path):
    path = tmp_path / "shard_0002"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        tmp = _fake_claim(path, pid=live.pid)
        assert claims.holder(path)["pid"] == live.pid
        assert not claims.claim(path)
        assert claims.owner(tmp)["pid"] == live.pid  # untouched
        _age(tmp, claims.STALE_S + 1)  # a reused pid: the claim's age decides
        assert claims.claim(path)
    finally:
        live.kill()
        live.wait()


@pytest.mark.parametrize(
    "owner", [{"host": "another-machine", "pid": 1}, None], ids=["other host", "no record"]
)
def test_a_claim_of_unknown_liveness_is_dead_when_stale(tmp_path, owner):
    path = tmp_path / "shard_0003"
    tmp = _fake_claim(path, **(owner or {}))
    assert not claims.claim(path)
    _age(tmp, claims.STALE_S + 1)
    assert claims.claim(path)
    assert claims.owner(claims.tmp_dir(path))["pid"] == os.getpid()


def test_this_processs_own_leftover_is_taken_and_release_frees_only_its_own(tmp_path):
    path = tmp_path / "shard_0004"
    _fake_claim(path, pid=os.getpid())
    assert claims.claim(path)
    claims.release(path)
    assert not claims.tmp_dir(path).exists()
    other = tmp_path / "shard_0005"
    _fake_claim(other, pid=os.getppid())
    claims.release(other)
    assert claims.tmp_dir(other).exists()
