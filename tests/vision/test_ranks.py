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


def test_a_follower_makes_rank_zeros_image_request_again_and_decodes_alike(tiny_vlm_dir, images):
    """``dflash serve`` across ranks: rank 0 sends a request's image files and rendered
    text with its insert (``distributed.wire``); a follower makes the same prompt of them
    and decodes the same tokens (in one process, the commands passed over a list)."""
    from test_follow import _recorded, _Wire

    from dflash_mlx.batching import BatchGenerator
    from dflash_mlx.distributed import follow
    from dflash_mlx.prompts import request_ids
    from dflash_mlx.server.prompt_cache import PromptPool
    from dflash_mlx.settings import GenerationConfig

    model, tok = load(str(tiny_vlm_dir[0]), drafter=str(tiny_vlm_dir[1]))
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}]
    cfg = GenerationConfig(max_tokens=16, temperature=0.0, block_size=4)
    ids, cfg, vision = request_ids(model, tok, msgs, cfg, images=images[:1])
    wire, out = _Wire(), []
    lead = follow.Lead(wire)
    gen = lead.batch(BatchGenerator(model, tok, 2))
    uid = gen.insert(ids, cfg, images=vision)
    while len(gen._gen):
        for _, r in gen.step():
            out += r.tokens
    lead.quit()
    (insert,) = [op for msg in wire.sent for op in msg["ops"] if op[0] == "insert"]
    assert len(insert) == 6 and insert[5][0] == vision.source[0]  # the text and the file
    seen = {}
    follow.follow_batches(wire, PromptPool(model, 10**9), lambda: _recorded(model, tok, seen))
    assert seen == {uid: out} and len(out) > 4


def test_a_chat_follower_makes_rank_zeros_image_turn_again_and_holds_the_same_cache(
    tiny_vlm_dir, images, tmp_path, monkeypatch
):
    """``dflash chat`` across ranks: ``/image`` attaches a file; the turn goes out with the
    file's bytes and the engine's prompt, and the follower's session cache ends holding
    rank 0's tokens, image rows included."""
    import io
    import signal

    from test_follow import _Wire

    from dflash_mlx.cli import chat_ranks
    from dflash_mlx.cli.chat import ChatSession
    from dflash_mlx.settings import GenerationConfig

    model, tok = load(str(tiny_vlm_dir[0]), drafter=str(tiny_vlm_dir[1]))
    made, real = [], model.make_cache
    monkeypatch.setattr(model, "make_cache", lambda: made.append(real()) or made[-1])
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # the follower leaves pytest's
    png = tmp_path / "shot.png"
    png.write_bytes(images[0])
    wire, out = _Wire(), io.StringIO()
    gen = GenerationConfig(max_tokens=8, block_size=4, temperature=0.0)
    lines = f"/image {png}\nWhat is this?\n/exit\n"
    s = ChatSession(model, tok, "tiny", gen, stdin=io.StringIO(lines), stdout=out)
    s.lead = chat_ranks.ChatLead(wire, dog=None)
    s.loop()
    s.lead.quit()
    (turn,) = [m for m in wire.sent if m["op"] == "turn"]
    assert len(turn["images"][1]) == 1 and len(turn["prompt"]) > len(turn["ids"])
    ours = list(s.cache.tokens)
    chat_ranks.follow_chat(wire, None, model, tok)
    assert not wire.sent and made[-1] is not s.cache
    assert list(made[-1].tokens) == ours and len(ours) > len(turn["prompt"])
