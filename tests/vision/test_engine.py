"""Images in, speculation on: greedy DFlash with images equals mlx-vlm's own greedy
decoding token for token (one image, two, a second turn through the prompt cache, batched),
and the prompt cache keys an image by its bytes."""

from __future__ import annotations

import pytest
from reference import greedy
from tiny_vlm import VLM_TEMPLATE

from dflash_mlx import load, stream_generate
from dflash_mlx.batching import BatchGenerator

N = 24  # tokens per completion: several verify cycles of block 4


@pytest.fixture(scope="module")
def pair(tiny_vlm_dir):
    return load(str(tiny_vlm_dir[0]), drafter=str(tiny_vlm_dir[1]))


def user(text: str, n_images: int) -> dict:
    return {
        "role": "user",
        "content": [{"type": "image"}] * n_images + [{"type": "text", "text": text}],
    }


def run(pair, messages, images, cache=None, **kw):
    """(ids committed, the last response) of a greedy DFlash completion (EOS kept)."""
    model, tok = pair
    out, last = [], None
    settings = {"max_tokens": N, "temperature": 0.0, "block_size": 4, **kw}
    for r in stream_generate(model, tok, messages, images=images, prompt_cache=cache, **settings):
        out += r.tokens
        last = r
    if last.finish_reason == "stop" and len(out) < N:
        out.append(3)  # the EOS the reference yields too
    return out, last


def same(ours: list[int], ref: list[int]) -> None:
    assert ours == ref[: len(ours)] and len(ours) == min(N, len(ref)), (ours, ref)


def test_one_image_greedy_equals_mlx_vlm(pair, tiny_vlm_dir, images):
    msgs = [user("What is in this picture?", 1)]
    ours, last = run(pair, msgs, [images[0]])
    same(ours, greedy(tiny_vlm_dir[0], msgs, [images[0]], N))
    assert last.cycles < last.generation_tokens  # verify blocks ran (drafts accepted)
    # what the request runs without is in its stats, never silent (vision/notes.py)
    assert [n.split(":")[0] for n in last.notes] == ["tree off", "rollback replays"]
    _, last = run(pair, msgs, [images[0]], max_tokens=2, tree=False)
    assert [n.split(":")[0] for n in last.notes] == ["rollback replays"]


def test_two_images_and_a_str_prompt(pair, tiny_vlm_dir, images):
    msgs = [user("Compare these two.", 2)]
    ours, _ = run(pair, msgs, images[:2])
    same(ours, greedy(tiny_vlm_dir[0], msgs, images[:2], N))
    # a str prompt with images: one user turn, the images first
    text, _ = run(pair, "Compare these two.", images[:2])
    assert text == ours


def test_second_turn_reuses_the_image_from_the_prompt_cache(pair, tiny_vlm_dir, images):
    model, tok = pair
    cache = model.make_cache()
    first = [user("Describe it.", 1)]
    ids, r1 = run(pair, first, [images[0]], cache)
    answer = tok.decode(ids, skip_special_tokens=True)  # a random model's specials dropped
    second = first + [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": [{"type": "text", "text": "And the colours?"}]},
    ]
    ours, r2 = run(pair, second, [images[0]], cache)
    same(ours, greedy(tiny_vlm_dir[0], second, [images[0]], N))
    cached = r2.prompt_tokens - r2.prompt_processed
    assert cached >= r1.prompt_tokens - 1  # the whole first prompt, its image rows included
    # the same turn with another image at that place: the cache stops before the image
    other, r3 = run(pair, second, [images[1]], cache)
    same(other, greedy(tiny_vlm_dir[0], second, [images[1]], N))
    assert r3.prompt_tokens - r3.prompt_processed < 8  # only "<|im_start|>user\n<vision_start>"


def test_batched_requests_with_images_equal_mlx_vlm(pair, tiny_vlm_dir, images):
    model, tok = pair
    gen = BatchGenerator(model, tok, max_batch=4)
    prompts = [([user("One.", 1)], [images[0]]), ([user("Two.", 2)], images[1:3])]
    settings = {"max_tokens": N, "temperature": 0.0, "block_size": 4}
    uids = [gen.insert(m, images=i, **settings) for m, i in prompts]
    got = {u: [] for u in uids}
    done = {}
    while len(gen):
        for uid, r in gen.step():
            got[uid] += r.tokens
            done[uid] = r.finish_reason
            assert r.notes[-1].startswith("batch off: a vision-language target decodes"), r.notes
    for uid, (msgs, imgs) in zip(uids, prompts):
        ours = got[uid] + ([3] if done[uid] == "stop" and len(got[uid]) < N else [])
        same(ours, greedy(tiny_vlm_dir[0], msgs, imgs, N))


def test_prefill_chunks_that_cut_through_images(pair, tiny_vlm_dir, images):
    """Chunks of 3 rows: images are split across chunks (features and positions sliced)."""
    msgs = [user("Compare these two.", 2)]
    ours, _ = run(pair, msgs, images[:2], prefill_step_size=3)
    same(ours, greedy(tiny_vlm_dir[0], msgs, images[:2], N))


def test_a_prepared_prompt_passes_with_its_ids(pair, tiny_vlm_dir, images):
    """What a server does: encode once (``prepare``), then decode the ids with it."""
    from dflash_mlx.settings import GenerationConfig
    from dflash_mlx.vision.request import prepare

    model, tok = pair
    msgs = [user("What is in this picture?", 1)]
    ids, _, vision = prepare(model, tok, msgs, [images[0]], GenerationConfig())
    cache = model.make_cache()
    ours, _ = run(pair, ids, vision, cache)
    same(ours, greedy(tiny_vlm_dir[0], msgs, [images[0]], N))
    assert cache.tokens[: len(vision.keys)] == vision.keys  # the cache holds the image keys


def test_a_dense_family_qwen2_5_vl_equals_mlx_vlm(dense_vlm_dir, images):
    """qwen2_5_vl (all attention layers, no recurrent state): one and two images, greedy."""
    pair = load(str(dense_vlm_dir[0]), drafter=str(dense_vlm_dir[1]))
    for n in (1, 2):
        msgs = [user("Look.", n)]
        ours, last = run(pair, msgs, images[:n])
        same(ours, greedy(dense_vlm_dir[0], msgs, images[:n], N))
        assert [x.split(":")[0] for x in last.notes] == ["tree off"]  # no recurrent layers


# VLM_TEMPLATE with what Qwen's adds: the tools in a system turn, and an empty think block
# when enable_thinking is False (the tiny template has neither)
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    + VLM_TEMPLATE
    + "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}"
)
TOOL = {"type": "function", "function": {"name": "zoom", "parameters": {"type": "object"}}}


def test_tools_and_template_variables_reach_a_prompt_with_images(pair, images, monkeypatch):
    """An image request renders ``tools`` and ``enable_thinking`` exactly as the text path."""
    from dflash_mlx.prompts import encode_prompt, request_ids
    from dflash_mlx.settings import GenerationConfig

    model, tok = pair
    monkeypatch.setattr(tok._tokenizer, "chat_template", TOOLS_TEMPLATE)
    kw = {"tools": [TOOL], "template_kwargs": {"enable_thinking": False}}
    msgs = [user("Hi", 1)]
    ids, _, vision = request_ids(model, tok, msgs, GenerationConfig(), images=images[:1], **kw)
    text = encode_prompt(tok, [{"role": "user", "content": "Hi"}], **kw)
    assert text != encode_prompt(tok, [{"role": "user", "content": "Hi"}])  # the kw did act
    assert '"zoom"' in tok.decode(text) and tok.decode(text).endswith("</think>\n\n")
    ((s, e),) = vision.spans  # the same prompt, <|vision_start|> image rows <|vision_end|> aside
    assert ids[: s - 1] + ids[e + 1 :] == text
