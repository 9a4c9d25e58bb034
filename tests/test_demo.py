"""The shipped demo pair: loads through the public path, decodes losslessly, and drafts well
enough to accept tokens (the trained drafter is not random)."""

import mlx.core as mx
from mlx_lm.generate import generate_step

from dflash_mlx.acceptance import SamplingParams
from dflash_mlx.decode import decode
from dflash_mlx import load


def test_demo_pair_is_lossless_and_accepts_drafts():
    model, tok = load("demo", quiet=True)
    assert model.name == "demo" and model.drafter.has_selector and model.block_size == 8
    ids = tok.encode("def parse_args(argv):\n    parser = argparse.")
    ref = [t for t, _ in generate_step(mx.array(ids), model.target, max_tokens=64)]
    for selector in (True, False):
        out, cycles = [], 0
        for c in decode(
            model,
            ids,
            model.make_cache(),
            SamplingParams(),
            max_tokens=64,
            block_size=8,
            use_selector=selector,
        ):
            out += c.tokens
            cycles += bool(c.drafted)
        assert out == ref
        assert 63 / cycles > 1.3  # tau well above 1: real acceptance
