"""Greedy references: mlx-lm's own decoding of a target, and ours with the drafter's drafts.

Tests asserting the two equal token for token hold on MLX's Linux CPU backend with the
few-row kernel; on Metal they may part at floating-point near-ties (docs/algorithm.md
§4.2.1)."""

import mlx.core as mx
from mlx_lm.generate import generate_step

from dflash_mlx.decoding.acceptance import SamplingParams
from dflash_mlx.decoding.loop import DecodeOptions, decode

PROMPTS = ["def parse_args(", "import os\nfor i in"]


def reference(model, ids, n):
    """mlx-lm's own greedy decoding of the target (taps are inert outside a capture)."""
    return [t for t, _ in generate_step(mx.array(ids), model.target, max_tokens=n)]


def run(model, ids, n, block, selector=True, lookup=False):
    """Decode with the drafter's drafts only (copied drafts: tests/test_lookup.py)."""
    out, stats = [], []
    for c in decode(
        model,
        ids,
        model.make_cache(),
        SamplingParams(),
        DecodeOptions(max_tokens=n, block_size=block, use_selector=selector, lookup=lookup),
    ):
        out += c.tokens
        if c.drafted and not c.sibling:  # (accepted, the path's drafts: a tree's are fewer)
            stats.append((c.accepted, c.drafted - c.siblings))
    return out[:n], stats
