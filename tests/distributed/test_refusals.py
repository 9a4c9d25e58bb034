"""Hostile starts across ranks, without a launch: a rank whose model directory is missing
is named in one line by every rank; weights of the same names and sizes but other values
are told apart by ``weights.digest`` (cheaply: headers and samples); a rank waiting for a
rank that never joins ends with one line in bounded time; the ranks' prompt-cache disk
tiers agree on each restore, so a rank that cannot write its folder (or lacks an entry
after a restart) never parts the group."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from launch import FakeGroup, launch_with_mlx, needs_launch
from tiny_models import build_target

from dflash_mlx import DFlashError, load
from dflash_mlx.distributed import follow, handshake, join, weights


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """Two tiny targets with the same file names and sizes, other weights (another seed)."""
    root = tmp_path_factory.mktemp("twins")
    return [build_target(root / f"s{seed}" / "m", seed=seed) for seed in (0, 1)]


def test_other_weights_of_the_same_names_and_sizes_get_another_digest(twins, tmp_path):
    a, b = twins
    here, there = handshake.facts([a]), handshake.facts([b])
    assert here["files"] == there["files"]  # what the handshake compared before
    assert here["content"] != there["content"]
    (diff,) = handshake.differences([here, there])
    assert diff.endswith("has other weights (same file names and sizes, other contents)")
    copy = shutil.copytree(a, tmp_path / "copy" / "m")
    assert handshake.facts([copy])["content"] == here["content"]  # the same files: equal


def test_the_digest_sees_a_header_change_and_one_tensor_changed_and_reads_little(
    twins, monkeypatch, tmp_path
):
    path = twins[0] / "model.safetensors"
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    base = weights.digest(path)

    def changed(new: bytes, name: str) -> str:
        p = tmp_path / name  # not beside the twins: the launch below compares their files
        p.write_bytes(new)
        assert p.stat().st_size == path.stat().st_size
        return weights.digest(p)

    # one tensor scaled (a partial fine-tune): its middle sample changes
    name = max(k for k in header if k != "__metadata__")
    start, end = header[name]["data_offsets"]
    values = np.frombuffer(raw[8 + n + start : 8 + n + end], np.float32) * 1.5
    tweaked = raw[: 8 + n + start] + values.tobytes() + raw[8 + n + end :]
    assert changed(tweaked, "tweaked.safetensors") != base
    # the same bytes under another dtype in the header (same length: a re-quantization's)
    retyped = raw[: 8 + n].replace(b'"F32"', b'"I32"', 1) + raw[8 + n :]
    assert changed(retyped, "retyped.safetensors") != base
    # what it reads: the header and 64 bytes a tensor, not the file
    reads = []
    real = open

    class Counting:
        def __init__(self, f):
            self.f = f

        def read(self, k=-1):
            data = self.f.read(k)
            reads.append(len(data))
            return data

        def __getattr__(self, a):
            return getattr(self.f, a)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

    monkeypatch.setattr(weights, "open", lambda p, mode: Counting(real(p, mode)), raising=False)
    weights.digest(path)
    assert sum(reads) <= 8 + n + weights.SAMPLE * len(header) < path.stat().st_size / 4


def test_other_weight_files_are_sampled_and_small_files_hashed_whole(tmp_path):
    big = bytearray(os.urandom(3 * weights.HEAD))
    path = tmp_path / "a.gguf"
    path.write_bytes(big)
    first = weights.digest(path)
    big[2 * weights.HEAD] ^= 1  # between two sampled blocks: not seen (the price of speed)
    path.write_bytes(big)
    assert weights.digest(path) == first
    big[-1] ^= 1  # inside the last block
    path.write_bytes(big)
    assert weights.digest(path) != first
    big[5] ^= 1  # the head (a GGUF's metadata and tensor table)
    (tmp_path / "b.gguf").write_bytes(big)
    assert weights.digest(tmp_path / "b.gguf") != weights.digest(path)
    (tmp_path / "c.json").write_text('{"rope_theta": 10000}')
    (tmp_path / "d.json").write_text('{"rope_theta": 20000}')
    assert weights.digest(tmp_path / "c.json") != weights.digest(tmp_path / "d.json")


def test_a_rank_whose_model_directory_is_missing_is_named_on_every_rank(
    twins, monkeypatch, tmp_path
):
    ok, real_gather = handshake.facts([twins[0]]), handshake.gather
    sent = []

    def gather(row, group):  # rank 1 of 2; rank 0 found its model
        sent.append(row)
        return [ok, row]

    monkeypatch.setattr(handshake, "gather", gather)
    monkeypatch.setattr(handshake, "LINGER_S", 0)
    missing = tmp_path / "nowhere" / "m"
    with pytest.raises(DFlashError) as e:
        load(str(missing), drafter=str(twins[0]), group=FakeGroup(2, rank=1))
    msg = str(e.value)
    assert msg.startswith("a rank cannot start: rank 1 of 2 (") and str(missing) in msg
    assert "\n" not in msg and set(sent[0]) == {"host", "error"}
    # the real gather keeps a long error inside its fixed-size row
    long = handshake.failed(DFlashError("x" * 2000 + " é"))
    (back,) = real_gather(long, mx.distributed.init())
    assert back["error"] == long["error"][: len(back["error"])] and len(back["error"]) > 300
    assert handshake.check(None, (), failure=DFlashError("alone")) == []  # one process


def test_a_lost_rank_during_the_handshake_is_one_line(monkeypatch):
    def lost(row, group):
        raise RuntimeError("[ring] connection to a peer was lost")

    monkeypatch.setattr(handshake, "gather", lost)
    with pytest.raises(DFlashError, match=r"^another rank exited during the start-up check"):
        handshake.check(FakeGroup(), [])


def test_a_rank_waiting_for_one_that_never_joins_stops_with_one_line(tmp_path):
    ports = []
    for _ in range(2):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
    env = dict(os.environ, MLX_RANK="0", MLX_HOSTFILE=str(hosts), DFLASH_JOIN_TIMEOUT="1")
    code = "from dflash_mlx import distributed; distributed.group(); print('joined')"
    t = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    took = time.monotonic() - t
    assert r.returncode != 0 and "joined" not in r.stdout
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == [join.message(0, 2, 1.0)], r.stderr
    assert lines[0].startswith("error: rank 0 of 2 waited 1 s for rank 1 to join")
    assert took < 30
    assert join.waits_for(2, 3) == "rank 0 or rank 1" and join.waits_for(1, 3).startswith(
        "rank 0 (or"
    )


class _Channel:
    """One rank's side of ``follow.agreement``: the other rank's row is given (what it
    reported in its own run); this rank's row is recorded."""

    size = 2

    def __init__(self, rank, other):
        self.rank, self.other, self.sent = rank, other, None

    def _sum(self, a):
        rows = np.array(a)
        self.sent = rows[self.rank].tolist()
        rows[1 - self.rank] = self.other
        return mx.array(rows)


def test_ranks_restore_from_their_disks_only_what_every_rank_restores(pairs, tmp_path, caplog):
    """rank 0's folder holds an entry (saved by an earlier run), rank 1's cannot be written
    (a file where its folder should be): after a restart the ranks agree to restore
    nothing, where rank 0 alone would have restored the prompt; when both hold it, both
    restore it."""
    from dflash_mlx import stream_generate
    from dflash_mlx.server.prompt_cache import PromptPool
    from dflash_mlx.server.prompt_cache_disk import DiskTier

    model, tok = pairs("qwen3", "d2")
    prompt, again = [10 + i * 7 % 300 for i in range(30)], []
    again = prompt + [20, 21, 22, 23]
    root = tmp_path / "pc"
    root.mkdir()
    (root / "blocked").write_text("a file")
    pool = PromptPool(model, 0, DiskTier.open(str(root / "rank0"), model))  # all to disk
    cache = pool.take(prompt)
    for _ in stream_generate(model, tok, prompt, prompt_cache=cache, max_tokens=2, block_size=4):
        pass
    pool.give(cache)

    def restart(folder, rank, other):
        pool = PromptPool(model, 0, DiskTier.open(str(folder), model))
        if other is None:
            return pool.take(again).usable(again), None
        pool.agree = follow.agreement(chan := _Channel(rank, other))
        return pool.take(again).usable(again), chan.sent

    alone, _ = restart(root / "rank0", 0, None)
    assert alone == len(prompt)  # rank 0 by itself restores the prompt
    n0, row0 = restart(root / "rank0", 0, [0, 0])
    n1, row1 = restart(root / "blocked" / "x", 1, [0, alone])
    assert row0 == [0, alone] and row1 == [0, 0]  # what each rank really reported
    assert n0 == n1 == 0  # neither restores: the same prefix on both ranks
    said = [r.getMessage() for r in caplog.records if "prompt-cache folders" in r.getMessage()]
    assert len(said) == 1 and f"(rank 0 {alone}, rank 1 0 tokens)" in said[0]  # rank 0's
    shutil.copytree(root / "rank0", root / "rank1")
    n0, _ = restart(root / "rank0", 0, [0, alone])
    n1, row1 = restart(root / "rank1", 1, [0, alone])
    assert n0 == n1 == alone and row1 == [0, alone]
    with pytest.raises(follow.Parted, match="rank 1's prompt cache reused 0 tokens where"):
        follow.agreement(_Channel(1, [3, 0]))(0, 0)


@needs_launch
def test_two_ranks_with_other_weights_of_the_same_files_are_refused_in_one_line(twins, tiny_dir):
    """``dflash run`` on two ranks, rank 1's target another seed's (same names, sizes and
    flags): one line from rank 0, and no rank ends well (mlx.launch itself exits 0, so its
    per-rank lines are how to tell: docs/distributed.md)."""
    worker = Path(__file__).with_name("cli_rank.py")
    args = ["run", "--drafter", str(tiny_dir / "d2_qwen3"), "--block-size", "4", "-m", "4", "hi"]
    r = launch_with_mlx([str(worker), str(twins[0]), str(twins[1]), "--", *args], twins[0].parent)
    lines = [ln for ln in r.stdout.splitlines() if "error" in ln.lower()]
    want = (
        "error: the ranks were started differently than rank 0: rank 1 "
        f"({handshake._host()}) has other weights (same file names and sizes, other "
        "contents); start every rank with the same model files, flags and dflash / mlx / "
        "mlx-lm versions"
    )
    assert lines == [want], r.stdout[-3000:]
    ends = dict(re.findall(r"Node with rank (\d) (exited with code -?\d+|was killed)", r.stdout))
    assert ends.get("0") == "exited with code 2", r.stdout[-2000:]
    # rank 1 ends 2 too, unless mlx.launch ended it first (rank 0 exited): never 0
    assert ends.get("1") in ("exited with code 2", "exited with code -15", "was killed"), ends
    assert "Traceback" not in r.stdout
