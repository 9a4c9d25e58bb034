"""Context lookup: the n-gram index, copied drafts in the decode loop (greedy parity, the
exact sampling law) and their scheduling."""

import mlx.core as mx
import numpy as np
import pytest
from laws import exact_law, tv
from mlx_lm.sample_utils import make_logits_processors
from scripted import Scripted
from tiny_models import eight_token_pair

from dflash_mlx.decoding.acceptance import SamplingParams
from dflash_mlx.decoding.lookup import Lookup, match_class, priors
from dflash_mlx.decoding.loop import DecodeOptions, decode
from dflash_mlx.decoding.schedule import CostTable, Scheduler, Tuning
from dflash_mlx.decoding.steps import Cycle


def naive(seq, limit, max_n=4):
    """The definition: the latest earlier occurrence of the longest suffix n-gram."""
    for n in range(min(max_n, len(seq) - 1), 0, -1):
        for s in range(len(seq) - n - 1, -1, -1):
            if seq[s : s + n] == seq[len(seq) - n :]:
                out = []
                for k in range(limit):
                    j = s + n + k
                    out.append(seq[j] if j < len(seq) else out[j - len(seq)])
                return out, n
    return [], 0


def test_lookup_copies_after_the_latest_occurrence_of_the_longest_suffix():
    lk = Lookup([5, 1, 2, 3, 9, 1, 2, 7, 1, 2])
    assert lk.propose(3) == ([7, 1, 2], 2)  # "1 2" last seen before "7"
    lk.extend([3])
    assert lk.propose(2) == ([9, 1], 3)  # now "1 2 3" matches, longer than "2 3" or "3"
    assert Lookup([4, 5, 6]).propose(4) == ([], 0)
    assert Lookup([4, 5, 6]).propose(0) == ([], 0)


def test_lookup_continues_a_loop_past_the_end_of_the_sequence():
    lk = Lookup([8, 1, 2, 1, 2])
    assert lk.propose(5) == ([1, 2, 1, 2, 1], 2)  # period 2, copied on through the drafts


def test_lookup_index_built_token_by_token_equals_the_definition():
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 5, 300).tolist()
    lk = Lookup(seq[:1])
    for i in range(1, len(seq)):
        lk.extend([seq[i]])
        assert lk.propose(6) == naive(seq[: i + 1], 6), i


def test_match_classes_and_priors_cover_every_length():
    assert [match_class(n) for n in range(6)] == [0, 1, 2, 2, 4, 4]
    assert all(len(p) == 15 for p in priors(15).values())
    assert sorted(priors(3)) == [1, 2, 4]


def run(model, ids, n, block, lookup, params=None, key=None, scheduler=None):
    out, copied = [], 0
    for c in decode(
        model,
        ids,
        model.make_cache(),
        params or SamplingParams(),
        DecodeOptions(max_tokens=n, block_size=block, key=key, policy=scheduler, lookup=lookup),
    ):
        out += c.tokens
        copied += c.lookup > 0
    return out[:n], copied


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("block", [2, 4, 8])
def test_greedy_with_copied_drafts_matches_mlx_lm(pairs, kind, block):
    from references import PROMPTS, reference

    model, tok = pairs(kind, "d2")
    used = 0
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        got, copied = run(model, ids, 64, block, lookup=True)
        assert got == reference(model, ids, 64)
        used += copied
    assert used > 0  # the random target loops, so copied drafts really were verified


def test_greedy_with_lookup_and_auto_blocks_matches_mlx_lm(pairs):
    from references import PROMPTS, reference

    model, tok = pairs("qwen3", "d2")
    costs = CostTable(model.block_size)
    costs.seconds = {1: 1.0, **{b: 1.3 for b in range(2, model.block_size + 1)}}
    used = 0
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        sched = Scheduler(costs, [0.1] * 7, frozen=True, lookup_costs=costs)  # drafts lose
        got, copied = run(model, ids, 64, None, True, scheduler=sched)
        assert got == reference(model, ids, 64)
        used += copied
    assert used > 0


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    return eight_token_pair(tmp_path_factory.mktemp("v8"))


@pytest.mark.parametrize(
    "temp,top_k,presence,script", [(1.0, 0, 0.0, [4]), (0.8, 5, 1.0, [4]), (1.0, 0, 0.0, [1, 4])]
)
def test_sampling_with_copied_drafts_matches_the_target_law(
    small_vocab_pair, temp, top_k, presence, script
):
    """Copied drafts have a point-mass proposal; accepting with p(d) and resampling the
    residual keeps the law exact, including when the target samples a token other than
    the copied one."""
    model = small_vocab_pair
    prompt, n, trials = [2, 5, 1, 7, 0, 3, 4, 6, 2, 5], 4, 1000  # every id: always a match
    law = exact_law(model, prompt, n, temp, 1.0, top_k, presence)
    procs = make_logits_processors(presence_penalty=presence or None)
    params = SamplingParams(temp, 1.0, 0.0, top_k, procs)
    key, samples, used = mx.random.key(3), [], 0
    for _ in range(trials):
        key, sub = mx.random.split(key)
        sched = Scripted(script, plain=3, copy=True)  # copy at every match, 1-token ones too
        out, copied = run(model, prompt, n, 4, True, params, sub, sched)
        samples.append(tuple(out))
        used += copied
    assert used >= trials // 2  # samples verified copied drafts (a plain run may end one)
    for pos in range(n):
        exact = np.zeros(8)
        for seq, pr in law.items():
            exact[seq[pos]] += pr
        emp = np.bincount([s[pos] for s in samples], minlength=8) / trials
        assert tv(emp, exact) < 0.07, (pos, emp, exact)
    assert all(s in law for s in samples)  # no impossible sequence drawn


def table(costs):
    t = CostTable(len(costs))
    t.seconds = {b: c for b, c in enumerate(costs, start=1)}
    return t


def test_scheduler_copies_only_when_the_match_class_pays():
    drafted = table([1.0] + [1.5] * 7)
    copied = table([1.0] + [1.3] * 7)
    sched = Scheduler(drafted, [0.2] * 7, lookup_costs=copied)
    assert sched.choose(match=0).block == 1  # nothing to copy, drafting cannot pay
    strong = sched.choose(match=4)
    assert strong.lookup and strong.block == 8  # prior ~0.85 per position
    assert not sched.choose(match=1).lookup  # a 1-token match is accepted 16% at first
    for _ in range(40):  # copied 4-token matches keep failing at once: the class learns it
        sched.record(8, Cycle([], accepted=0, lookup=4), 1.3)
    assert sched.choose(match=4).speedup < strong.speedup / 2
    fresh = Scheduler(drafted, [0.2] * 7, lookup_costs=copied)
    assert sched.choose(match=2).speedup == fresh.choose(match=2).speedup  # classes apart
    assert sched.summary()["lookup_blocks"] == {8: 40}
    weak = Scheduler(drafted, [0.2] * 7, lookup_costs=copied, lookup_priors={4: [0.1] * 7})
    assert not weak.choose(match=4).lookup and not weak.choose(match=2).lookup  # no class 2


def test_lookup_acceptance_carries_to_the_next_request_and_not_without_lookup():
    costs = table([1.0] + [1.1] * 7)
    tuning = Tuning(costs, costs)
    sched = tuning.scheduler(greedy=True, selector=True, lookup=True)
    for _ in range(30):
        sched.record(8, Cycle([], accepted=0, lookup=4), 1.1)
    tuning.finish(sched)
    before = Tuning(costs, costs).scheduler(True, True, lookup=True).choose(match=4).speedup
    assert tuning.scheduler(True, True, lookup=True).choose(match=4).speedup < before / 2
    off = tuning.scheduler(True, True, lookup=False)
    assert off.lookup_costs is None and not off.choose(match=4).lookup
    assert Tuning(costs).scheduler(True, True, lookup=True).lookup_costs is None
