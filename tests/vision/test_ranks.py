"""A vision-language target across two ranks (``mlx.launch -n 2 --backend ring``,
loopback): the tiny qwen3_5 VLM's language model split by tensor parallelism
(``vision.shard``), the vision tower on every rank, greedy DFlash with an image equal to
the same decode in one process, on every rank."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))  # the launch helpers
import vlm_worker
from launch import launch, needs_launch

from dflash_mlx import load


@needs_launch
def test_a_vlm_split_over_two_ranks_decodes_an_image_prompt_as_one_process(tiny_vlm_dir, tmp_path):
    target, drafter = map(str, tiny_vlm_dir)
    model, tok = load(target, drafter=drafter)
    alone = vlm_worker.decode(model, tok, 4)
    res = launch([vlm_worker.__file__, str(tmp_path), target, drafter], tmp_path)
    ranks = [tmp_path / f"vlm{r}.json" for r in (0, 1)]
    assert all(p.exists() for p in ranks), res.stdout[-3000:]
    got = [json.loads(p.read_text()) for p in ranks]
    assert [g["heads"] for g in got] == [2, 2]  # 4 query heads, split
    assert got[0]["tokens"] == got[1]["tokens"] == alone and len(alone) == 16
