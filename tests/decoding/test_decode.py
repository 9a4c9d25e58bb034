"""Greedy parity: speculative decoding commits exactly mlx-lm's greedy tokens.

Bit-identity holds on MLX's Linux CPU backend with the few-row kernel (what CI runs); on
Metal the guarantee is the verify pass's argmax, which may part from plain decoding at a
floating-point near-tie (docs/algorithm.md §4.2.1)."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from oracle import OracleDrafter
from references import PROMPTS, reference, run

from dflash_mlx.decoding.acceptance import SamplingParams
from dflash_mlx.decoding.loop import DecodeOptions, decode


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("drafter", ["d2", "d1"])
@pytest.mark.parametrize("block", [2, 4, 8, 16])
def test_greedy_matches_mlx_lm_with_random_drafter(pairs, kind, drafter, block):
    model, tok = pairs(kind, drafter)
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        for selector in (True, False):
            got, _ = run(model, ids, 64, block, selector)
            assert got == reference(model, ids, 64)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("block,wrong", [(4, ()), (8, (5,)), (16, (3, 9)), (8, (1,))])
@pytest.mark.parametrize("selector", [True, False])
def test_greedy_matches_with_full_partial_and_zero_acceptance(pairs, kind, block, wrong, selector):
    model, tok = pairs(kind, "d2")
    ids = tok.encode(PROMPTS[0])
    ref = reference(model, ids, 80)
    real = model.drafter
    model.drafter = OracleDrafter(real, ids + ref, wrong_at=wrong)
    try:
        got, stats = run(model, ids, 64, block, selector)
    finally:
        model.drafter = real
    assert got == ref[:64]
    accepted = [a for a, d in stats]
    if not wrong:
        assert all(a == d for a, d in stats[:-1])  # every full block accepted
    else:
        first_wrong = min(wrong) - 1
        full = max(d for a, d in stats)  # the path of a whole block
        assert all(a == min(first_wrong, d) for a, d in stats if d == full)
    assert sum(accepted) > 0 or wrong == (1,)


def test_max_tokens_is_exact_and_block_shrinks_at_the_end(pairs):
    model, tok = pairs("qwen3", "d2")
    ids = tok.encode(PROMPTS[1])
    ref = reference(model, ids, 13)
    model.drafter, real = OracleDrafter(model.drafter, ids + ref + [0] * 20), model.drafter
    try:
        out = []
        for c in decode(
            model,
            ids,
            model.make_cache(),
            SamplingParams(),
            DecodeOptions(max_tokens=13, block_size=8),
        ):
            out += c.tokens
    finally:
        model.drafter = real
    assert out == ref


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_greedy_with_penalties_matches_mlx_lm_processors_per_position(pairs, kind):
    from mlx_lm.sample_utils import make_logits_processors

    model, tok = pairs(kind, "d2")
    ids = tok.encode(PROMPTS[0])
    kw = {"presence_penalty": 0.8, "repetition_penalty": 1.3, "frequency_penalty": 0.4}
    ref = [
        t
        for t, _ in generate_step(
            mx.array(ids),
            model.target,
            max_tokens=48,
            logits_processors=make_logits_processors(**kw),
        )
    ]
    real = model.drafter
    model.drafter = OracleDrafter(real, ids + ref + [0] * 20, wrong_at=(6,))
    try:
        params = SamplingParams(processors=make_logits_processors(**kw))
        out = []
        for c in decode(
            model, ids, model.make_cache(), params, DecodeOptions(max_tokens=48, block_size=8)
        ):
            out += c.tokens
    finally:
        model.drafter = real
    assert out == ref


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("script", [[1, 8, 3, 1, 1, 5, 2], [4, 1], [1]])
@pytest.mark.parametrize("oracle", [False, True])
def test_greedy_matches_mlx_lm_under_any_schedule_of_plain_and_speculative_steps(
    pairs, kind, script, oracle
):
    from scripted import Scripted

    model, tok = pairs(kind, "d2")
    ids = tok.encode(PROMPTS[1])
    ref = reference(model, ids, 90)
    real = model.drafter
    if oracle:  # drafts get accepted, so blocks commit several tokens between plain runs
        model.drafter = OracleDrafter(real, ids + ref, wrong_at=(4,))
    sched = Scripted(script, copy=not oracle)  # copied drafts, where there is a match
    try:
        out = []
        for c in decode(
            model,
            ids,
            model.make_cache(),
            SamplingParams(),
            DecodeOptions(max_tokens=64, block_size=8, policy=sched),
        ):
            out += c.tokens
    finally:
        model.drafter = real
    assert out == ref[:64]
    assert set(script) <= set(sched.used)  # every scripted block size really ran


def test_warm_up_times_every_block_the_scheduler_may_choose(pairs):
    from dflash_mlx.decoding.warmup import long_blocks, warm_up, warm_up_blocks

    assert warm_up_blocks(8) == [2, 3, 4, 5, 6, 7, 8]
    assert warm_up_blocks(16) == [2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16]
    assert long_blocks(16) == [2, 4, 8, 16] and long_blocks(6) == [2, 4, 6]
    model, _ = pairs("qwen3", "d2")
    tuning = warm_up(model)
    for table in (tuning.measured, tuning.measured_lookup):  # drafted and copied blocks
        assert sorted(table.seconds) == [1] + warm_up_blocks(model.block_size)
        assert all(s > 0 for s in table.seconds.values())
    for table in tuning.long:  # the same at the long context, fewer widths
        assert sorted(table.seconds) == [1] + long_blocks(model.block_size)
        assert all(s > 0 for s in table.seconds.values())


def test_warm_up_keeps_the_median_of_its_rounds_per_block(pairs, monkeypatch):
    """Each width is timed once per round and its median stands, so one slow timing (a
    noisy machine) does not decide what the scheduler thinks a block costs."""
    import time

    from dflash_mlx.decoding import steps
    from dflash_mlx.decoding.warmup import long_blocks, warm_up, warm_up_blocks

    model, _ = pairs("qwen3", "d2")
    real, calls = steps.cycle, {}

    def cycle(model, cache, params, history, choice, keys, copied=None, **k):
        b = choice.block
        if copied is None:  # drafted blocks (copied ones are timed the same way, apart)
            calls[b] = calls.get(b, 0) + 1
            if b == 2 and calls[b] == 3:
                time.sleep(0.5)  # one outlier among block 2's three timings, the last one
        return real(model, cache, params, history, choice, keys, copied, **k)

    monkeypatch.setattr(steps, "cycle", cycle)
    tuning = warm_up(model, rounds=3)
    B = model.block_size
    # B once more, untimed; the long context's widths 3 more times
    assert calls == {b: 3 + (b == B) + 3 * (b in long_blocks(B)) for b in warm_up_blocks(B)}
    assert tuning.measured.seconds[2] < 0.1  # the median: not the last (0.5 s), not a mean
