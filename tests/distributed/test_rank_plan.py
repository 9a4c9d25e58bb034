"""The memory plan of one rank (no launch: a (size, rank, mode) as a group would give):
its shard of the target against the bytes a sharded target really keeps, its KV share, the
whole drafter; and a pair too big for one machine that fits as two ranks' shards."""

import pytest
from mlx.utils import tree_flatten

from dflash_mlx.errors import DFlashError
from dflash_mlx.loading import memory, rank_plan


def _kept_by_one_rank_of_two(target) -> int:
    """Bytes one of two tensor-parallel ranks keeps: half of each layer's projections,
    everything else whole (mlx-lm's ``shard`` splits the layers' linear weights only)."""
    total = 0
    for name, v in tree_flatten(target.parameters()):
        split = name.startswith("model.layers.") and "norm" not in name
        total += v.nbytes // 2 if split else v.nbytes
    return total


def test_a_tensor_rank_counts_half_the_layers_the_whole_embeddings_and_half_the_kv(tiny_dir):
    from mlx_lm.utils import load_model

    target, _ = load_model(tiny_dir / "qwen3")  # as mlx-lm loads it
    whole = memory.make_plan(tiny_dir / "qwen3", tiny_dir / "d2_qwen3", max_context=512)
    one = rank_plan.for_rank(whole, tiny_dir / "qwen3", (2, 1, "tensor"))
    assert one.target == pytest.approx(_kept_by_one_rank_of_two(target), rel=0.05)
    assert whole.target / 2 < one.target < whole.target
    assert one.kv == whole.kv // 2 and one.drafter == whole.drafter
    assert one.draft_kv == whole.draft_kv and "rank 1 of 2, tensor shard" in one.line()
    assert rank_plan.for_rank(whole, tiny_dir / "qwen3", None) is whole


def test_a_pipeline_rank_counts_its_own_layers_and_their_caches(tiny_dir):
    whole = memory.make_plan(tiny_dir / "qwen3", tiny_dir / "d2_qwen3", max_context=512)
    cfg = memory.target_size(tiny_dir / "qwen3", cpu=False)[1]
    n = cfg["num_hidden_layers"]
    assert [rank_plan.layers_of(7, 3, r) for r in range(3)] == [3, 2, 2]
    ranks = [rank_plan.per_rank(whole, cfg, (2, r, "pipeline")) for r in (0, 1)]
    assert sum(r.kv for r in ranks) == pytest.approx(whole.kv, abs=2)
    embed = whole.target * rank_plan.embedding_share(cfg)
    layers = sum(r.target - embed for r in ranks)
    assert layers == pytest.approx(whole.target - embed, rel=0.01) and n >= 2


def test_a_pair_too_big_for_one_machine_fits_as_two_ranks_shards(tiny_dir):
    from dflash_mlx.loading.loader import resolve

    res = resolve(str(tiny_dir / "qwen3"), str(tiny_dir / "d2_qwen3"))
    whole = memory.make_plan(tiny_dir / "qwen3", tiny_dir / "d2_qwen3")
    one = rank_plan.for_rank(whole, tiny_dir / "qwen3", (2, 0, "tensor"))
    gb = (whole.peak + one.peak) / 2 / 1e9  # between a rank's peak and the whole pair's
    with pytest.raises(DFlashError, match="this pair needs"):
        memory.Fit(res, None, max_memory=gb)
    assert memory.Fit(res, None, max_memory=gb, shard=(2, 0, "tensor")).plan.peak == one.peak


def test_the_verbose_plan_line_is_this_ranks(tiny_dir, capsys):
    from dflash_mlx.cli.common import print_plan
    from dflash_mlx.cli.options import ModelOptions

    class _Group:
        def size(self):
            return 2

        def rank(self):
            return 1

    src = ModelOptions(model=str(tiny_dir / "qwen3"), drafter=str(tiny_dir / "d2_qwen3"))
    print_plan(src, None, _Group())
    assert "rank 1 of 2, tensor shard" in capsys.readouterr().err
