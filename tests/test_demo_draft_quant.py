"""The demo pair with its drafter quantized to 4 bits at load (``load(draft_quant=4)``,
docs/format.md §2.5): greedy text still equals plain decoding, and the quantized drafter
still drafts (its drafts are accepted)."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from dflash_mlx import load, stream_generate
from dflash_mlx.generation import encode_prompt
from dflash_mlx.model import quantize

PROMPTS = ["Write a Python function that returns the squares of a list.", "What is a rainbow?"]


@pytest.fixture(scope="module")
def demo4():
    return load("demo", quiet=True, draft_quant=4, warmup=False)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_the_demo_with_a_4bit_drafter_equals_plain_decoding_and_accepts_drafts(demo4, prompt):
    model, tok = demo4
    assert quantize.bits_of(model.drafter) == 4
    ids = encode_prompt(tok, prompt)
    ref = [t for t, _ in generate_step(mx.array(ids), model.target, max_tokens=32)]
    rs = list(stream_generate(model, tok, ids, max_tokens=32, block_size=8))
    got = [t for r in rs for t in r.tokens]
    assert got == ref[: len(got)]
    assert len(got) == 32 or ref[len(got)] in tok.eos_token_ids  # early only at the EOS
    assert rs[-1].tau > 1.2  # its drafts are accepted: quantized, it still drafts
