"""Two ranks on one machine (``mlx.launch -n 2 --backend ring``, loopback): the tiny qwen3
target sharded with mlx-lm's tensor parallelism, DFlash greedy equal to plain greedy
decoding of the same sharded target on every rank, and every rank taking the same tokens,
``auto`` included (rank 0 decides the blocks), in the decode and in ``dflash bench``'s
methods, whose report states the group; the sampling law on a tensor-sharded 8-token
target; ``dflash serve``'s 8-bit KV caches across ranks equal to mlx-lm's on the sharded
target."""

import json
from pathlib import Path

import pytest
import sharded_law
from launch import FakeGroup as _Group
from launch import launch, needs_launch

WORKER = Path(__file__).with_name("rank_worker.py")


@needs_launch
def test_dflash_fixed_auto_and_kv8_on_a_tensor_sharded_target_equal_its_plain_greedy_and_keep_the_law(
    tiny_dir, tmp_path
):
    from tiny_models import build_drafter, build_target

    law = sharded_law.build(tmp_path / "law", "qwen3")  # 4 query, 2 key/value heads
    wide = build_target(tmp_path / "wide", "qwen3", hidden=128)  # head width 32: KV quantizes
    args = [tmp_path, tiny_dir / "qwen3", tiny_dir / "d2_qwen3", law, wide]
    args.append(build_drafter(tmp_path / "d_wide", wide, block_size=16))
    res = launch([str(WORKER), *map(str, args)], tmp_path)
    assert res.returncode == 0, res.stdout[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["size"] for r in ranks] == [2, 2] and [r["heads"] for r in ranks] == [2, 2]
    same = [{k: v for k, v in r.items() if k != "law"} for r in ranks]
    assert same[0] == same[1]  # every rank decoded the same tokens
    plain = ranks[0]["plain"]
    for block, got in ranks[0]["dflash"].items():
        assert got[: len(plain)] == plain, block
    sharded_law.check([r["law"] for r in ranks])
    kv8 = [r["kv8"] for r in ranks]  # rank 0 led the one-row batch, rank 1 replayed it
    assert len(kv8[0]["plain"]) == 16 and kv8[0] == kv8[1]
    assert kv8[0]["served"][:16] == kv8[0]["plain"]
    # auto drafted (rank 1's own scheduler never would): rank 1 took rank 0's blocks
    assert any(int(b) > 1 for b in ranks[0]["blocks"]), ranks[0]["blocks"]
    bench = ranks[0]["bench"]  # dflash bench's methods, auto too, states the group it ran on
    assert bench["group"] == {"ranks": 2, "shard": "tensor", "backend": "ring", "link": "loopback"}
    assert all(s["identical"] == s["of"] == 1 for s in bench["parity"].values()), bench
    assert "auto" in bench["parity"] and bench["auto_blocks"]  # rank 1 took the same blocks


def test_a_family_without_tensor_parallelism_or_even_heads_is_refused_in_one_line(pairs):
    from types import SimpleNamespace

    from dflash_mlx import DFlashError, distributed

    with pytest.raises(DFlashError, match="no tensor parallelism for 'toy' targets"):
        distributed.shard(SimpleNamespace(args=SimpleNamespace(model_type="toy")), _Group())
    model, _ = pairs("qwen3", "d2")  # 4 query and 2 key/value heads: not over 3 processes
    with pytest.raises(DFlashError, match=r"heads \(4 query, 2 key/value\) do not split over 3"):
        distributed.shard(model.target, _Group(size=3))
    distributed.shard(model.target, None)  # one process: nothing to do


def test_commands_that_cannot_run_sharded_yet_refuse_under_mlx_launch(monkeypatch, tiny_dir):
    from dflash_mlx import DFlashError, distributed
    from dflash_mlx.cli import common
    from dflash_mlx.cli.options import ModelOptions

    monkeypatch.setattr(distributed, "group", lambda given=None: _Group())
    src = ModelOptions(model=str(tiny_dir / "qwen3"), drafter=str(tiny_dir / "d2_qwen3"))
    with pytest.raises(DFlashError, match="does not run under mlx.launch yet"):
        common.load_pair(src, True, False)


def test_serve_takes_kv_bits_with_max_batch_1_under_mlx_launch(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from dflash_mlx import distributed
    from dflash_mlx.cli import app
    from dflash_mlx.distributed import handshake

    monkeypatch.setattr(distributed, "group", lambda given=None: _Group())
    monkeypatch.setattr(handshake, "gather", lambda row, group: [row])  # one rank's row
    argv = ["serve", "--kv-bits", "8", "--port", "0", "--model", str(tmp_path / "none")]
    batched = CliRunner().invoke(app, argv).stderr
    alone = CliRunner().invoke(app, [*argv, "--max-batch", "1"]).stderr
    assert "--kv-bits needs --max-batch 1" in batched
    assert alone.startswith("error: ") and "kv-bits" not in alone  # on to the model's own error
