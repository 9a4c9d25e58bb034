"""Pipeline parallelism (``distributed/pipeline.py``): two ranks on one machine (started by
``distributed.local`` as ``mlx.launch -n 2 --backend ring`` starts them) and the mode
choice, refusals and tap layout in one process."""

import json
from pathlib import Path

import pytest
import sharded_law
from launch import FakeGroup as _Group
from launch import launch, needs_launch

WORKER = Path(__file__).with_name("pipeline_worker.py")


def _models(root: Path, tiny_dir: Path) -> Path:
    """root with a tiny qwen2 pair, an 8-token qwen2 pair, and the tiny qwen3_5 pair."""
    from tiny_models import build_drafter, build_target

    build_target(root / "qwen2", "qwen2", hidden=128)  # its layers outweigh the other reads
    build_drafter(root / "d2_qwen2", root / "qwen2", dflash2=True, block_size=16)
    sharded_law.build(root, "qwen2")
    for name in ("qwen3_5", "d2_qwen3_5"):
        (root / name).symlink_to(tiny_dir / name)
    return root


def _check_greedy(res: dict, own: list[int]) -> None:
    plain = res["plain"]
    for name in ("b2", "b4", "b2_chain", "b4_chain", "b4_vocab"):
        got = res[name]
        assert got and got == plain[: len(got)], name  # an early stop only at the EOS
        assert len(got) == len(plain) or got[-1] == 3, name
    assert res["held"] == own  # this rank holds the weights of its own layers only
    assert res["as_one"] == [True, True]  # logits and taps: the whole target's bits


@needs_launch
def test_dflash_on_a_pipelined_target_equals_its_plain_greedy_and_keeps_the_sampling_law(
    tiny_dir, tmp_path
):
    root = _models(tmp_path / "m", tiny_dir)
    res = launch([str(WORKER), str(tmp_path), str(root)], tmp_path)
    assert res.returncode == 0, res.stdout[-3000:]
    files = [tmp_path / f"rank{r}.json" for r in (0, 1)]
    assert all(f.is_file() for f in files), res.stdout[-3000:]
    ranks = [json.loads(f.read_text()) for f in files]
    assert [r["size"] for r in ranks] == [2, 2]
    # mlx-lm gives rank 0 the last layers: of 4, rank 0 runs 2-3 and rank 1 runs 0-1
    for r, own in ((0, [2, 3]), (1, [0, 1])):
        _check_greedy(ranks[r]["qwen2"], own)
        _check_greedy(ranks[r]["qwen3_5"], own)
        # trees on the dense target (its verifies take them), chains on the hybrid
        assert [ranks[r][k]["tree_ok"] for k in ("qwen2", "qwen3_5")] == [True, False]
        assert [ranks[r][k]["hybrid"] for k in ("qwen2", "qwen3_5")] == [False, True]
        # the weights of the other stage's layers are not read from the file: loading
        # reads the pair's files less (most of) them, plus a little (tokenizer, configs)
        sizes = {int(k): v for k, v in ranks[r]["layer_bytes"].items()}
        other = sum(v for k, v in sizes.items() if k not in own)
        pair = sum(f.stat().st_size for d in ("qwen2", "d2_qwen2") for f in (root / d).iterdir())
        read = ranks[r]["qwen2"]["read"]
        assert read < pair - other // 2, (read, pair, other)
        kv8 = ranks[r]["qwen2"]["b4_kv8"]
        assert kv8 and kv8 == ranks[r]["qwen2"]["plain_kv8"][: len(kv8)]
    for kind in ("qwen2", "qwen3_5"):  # every rank decoded the same tokens
        keys = ("plain", "b2", "b4", "b2_chain", "b4_chain", "b4_vocab")
        keys += ("b4_kv8",) if kind == "qwen2" else ()
        assert [ranks[0][kind][k] for k in keys] == [ranks[1][kind][k] for k in keys]
    sharded_law.check([r["law"] for r in ranks])
    timing = {k: ranks[0]["qwen2"][k] for k in ("load_s", "b2_s", "b4_s")}
    reads = [r["qwen2"]["read"] for r in ranks]
    print(
        f"pipeline loopback: qwen2 {timing}, read {reads} of {pair} B; "
        f"{sharded_law.TRIALS} law draws {ranks[0]['law']['draw_s']:.1f} s"
    )


def _fake(tensor: bool, pipeline: bool):
    from types import SimpleNamespace

    inner = SimpleNamespace(pipeline=lambda g: None) if pipeline else SimpleNamespace()
    model = SimpleNamespace(args=SimpleNamespace(model_type="toy"), model=inner)
    if tensor:
        model.shard = lambda g: None
    return model


def test_the_mode_is_tensor_where_the_family_has_it_else_pipeline_and_refused_without():
    from dflash_mlx import DFlashError
    from dflash_mlx.distributed import pipeline

    assert pipeline.mode(_fake(True, True), None, 2) == "tensor"
    assert pipeline.mode(_fake(True, True), "pipeline", 2) == "pipeline"
    assert pipeline.mode(_fake(False, True), None, 2) == "pipeline"
    assert pipeline.mode(_fake(True, False), "tensor", 2) == "tensor"
    with pytest.raises(DFlashError, match="no tensor parallelism for 'toy'.*--shard pipeline"):
        pipeline.mode(_fake(False, True), "tensor", 2)
    with pytest.raises(DFlashError, match="no pipeline parallelism for 'toy'.*--shard tensor"):
        pipeline.mode(_fake(True, False), "pipeline", 2)
    with pytest.raises(DFlashError, match=r"no tensor parallelism .* and no pipeline .* qwen3_5"):
        pipeline.mode(_fake(False, False), None, 2)
    with pytest.raises(DFlashError, match="--shard must be tensor or pipeline"):
        pipeline.mode(_fake(True, True), "data", 2)


def test_an_unknown_shard_is_one_error_line_on_the_command_line_and_in_load(tiny_dir):
    from typer.testing import CliRunner

    from dflash_mlx import DFlashError, load
    from dflash_mlx.cli import app

    args = ["run", "--model", str(tiny_dir / "qwen3"), "--drafter", str(tiny_dir / "d2_qwen3")]
    r = CliRunner().invoke(app, [*args, "--shard", "rows", "Hi"])
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1, (r.exit_code, r.output)
    assert lines[0] == "error: --shard must be tensor or pipeline (got 'rows')"
    with pytest.raises(DFlashError, match="--shard must be tensor or pipeline"):
        load(str(tiny_dir / "qwen3"), drafter=str(tiny_dir / "d2_qwen3"), shard="rows")


def test_a_stage_wraps_only_its_own_layers_and_too_few_layers_are_refused(tmp_path):
    from mlx_lm.utils import load_model
    from tiny_models import build_target

    from dflash_mlx import DFlashError
    from dflash_mlx.distributed import pipeline
    from dflash_mlx.model.target import TargetAdapter, _Tap

    for kind in ("qwen2", "qwen3_5"):
        path = build_target(tmp_path / kind, kind, tokenizer=False, vocab_size=64)
        target = load_model(path, lazy=True)[0]
        assert pipeline.split(target, _Group(2, 0)) == range(2, 4)  # rank 0: the last layers
        adapter = TargetAdapter(target, [0, 2])
        layers = pipeline.stack(target).layers
        assert adapter.num_layers == 4 and layers[:2] == [None, None]
        assert isinstance(layers[2], _Tap) and not isinstance(layers[3], _Tap)
        assert len(adapter.recorders) == len(adapter.make_cache()) == 2
    target = load_model(tmp_path / "qwen2", lazy=True)[0]
    with pytest.raises(DFlashError, match="4 layers, too few to pipeline over 5 processes"):
        pipeline.split(target, _Group(5, 0))


def test_tap_share_fills_the_other_stages_taps_with_zeros_before_the_sum():
    import mlx.core as mx

    from dflash_mlx.distributed.pipeline import TapShare

    own = mx.arange(6, dtype=mx.float32).reshape(1, 3, 2)
    share = TapShare(mx.distributed.init(), 2, mx.float32)  # one process: the sum is itself
    feats = share({"on": True, 5: own}, [1, 5, 7], (1, 3), mx.zeros((1, 3, 4)))
    want = mx.concatenate([mx.zeros((1, 3, 2)), own, mx.zeros((1, 3, 2))], axis=-1)
    assert feats.shape == (1, 3, 6) and mx.array_equal(feats, want).item()


def test_the_commands_hand_shard_to_load(monkeypatch, tiny_dir):
    from dflash_mlx import distributed
    from dflash_mlx.cli import common
    from dflash_mlx.cli.options import ModelOptions
    from dflash_mlx.loading import loader

    seen = {}

    def fake_load(model, **kw):
        seen.update(kw)
        raise SystemExit(0)  # loading itself is the launch test's

    monkeypatch.setattr(distributed, "group", lambda given=None: _Group())
    monkeypatch.setattr(loader, "load", fake_load)
    src = ModelOptions(model=str(tiny_dir / "qwen3"), shard="pipeline")
    with pytest.raises(SystemExit):
        common.load_pair(src, True, False, sharded=True)
    assert seen["shard"] == "pipeline" and isinstance(seen["group"], _Group)


def test_heads_that_do_not_split_point_to_pipeline_only_where_the_family_has_it(tmp_path):
    from mlx_lm.utils import load_model
    from tiny_models import build_target

    from dflash_mlx import DFlashError, distributed

    for kind, hint in (("qwen2", True), ("qwen3", False)):
        path = build_target(tmp_path / kind, kind, tokenizer=False, vocab_size=64)
        target = load_model(path, lazy=True)[0]
        with pytest.raises(DFlashError, match="do not split over 3") as e:
            distributed.shard(target, _Group(size=3), "tensor")
        assert ("--shard pipeline" in str(e.value)) == hint
