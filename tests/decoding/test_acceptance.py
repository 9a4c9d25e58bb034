"""Sampling is lossless: the acceptance rule alone, and end to end on a tiny vocabulary."""

import mlx.core as mx
import numpy as np
import pytest
from laws import assert_law, draw, exact_law, tv
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from scripted import Scripted

from dflash_mlx.decoding.acceptance import SamplingParams, accept_sampled, sample_rows, target_probs


@pytest.mark.parametrize(
    "temp,top_p,min_p,top_k",
    [(1.0, 1.0, 0.0, 0), (0.7, 0.9, 0.0, 0), (1.3, 1.0, 0.1, 4), (0.8, 0.8, 0.0, 3)],
)
def test_target_probs_is_the_law_mlx_lm_samples_from(temp, top_p, min_p, top_k):
    mx.random.seed(0)
    logits = mx.random.normal((1, 10)) * 2
    N = 40000
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    draws = make_sampler(temp, top_p, min_p, top_k=top_k)(mx.repeat(logprobs, N, axis=0))
    emp = np.bincount(np.array(draws), minlength=10) / N
    p = np.array(target_probs(logits, SamplingParams(temp, top_p, min_p, top_k))[0])
    assert np.all(emp[p == 0] == 0)
    assert tv(emp, p) < 0.02


def test_acceptance_rule_alone_reproduces_the_target_rows():
    """Fixed p rows: the token at each emitted position must follow that row's law."""
    rng = np.random.default_rng(0)
    V, n = 6, 4
    p = rng.dirichlet(np.ones(V) * 0.7, size=n).astype(np.float32)  # [n, V]
    q = rng.dirichlet(np.ones(V) * 0.7, size=n - 1).astype(np.float32)  # [n-1, V]
    P, Q = mx.array(p), mx.array(q)
    trials = 6000
    counts = np.zeros((n, V))
    key = mx.random.key(1)
    for _ in range(trials):
        key, k1, k2 = mx.random.split(key, 3)
        drafts = mx.random.categorical(mx.log(Q), key=k1).astype(mx.uint32)
        a, bonus = accept_sampled(P, drafts, Q, k2)
        out = np.array(drafts)[: a.item()].tolist() + [bonus.item()]
        for i, t in enumerate(out):
            counts[i, t] += 1
    for i in range(n):
        emp = counts[i] / counts[i].sum()
        assert counts[i].sum() > 150
        # 3 sigma of the TV estimator at this sample size, bounded away from a broken rule
        assert tv(emp, p[i]) < 3 * np.sqrt(V / counts[i].sum()) / 2 + 0.01, (i, emp, p[i])


def test_acceptance_rule_rejects_with_a_wrong_proposal_law():
    """Sanity that the statistic can fail: claiming q = p while drafting from q breaks it."""
    rng = np.random.default_rng(3)
    V = 6
    p = rng.dirichlet(np.ones(V) * 0.5, size=2).astype(np.float32)
    q = rng.dirichlet(np.ones(V) * 0.5, size=1).astype(np.float32)
    P, Q = mx.array(p), mx.array(q)
    counts = np.zeros(V)
    key = mx.random.key(2)
    for _ in range(3000):
        key, k1, k2 = mx.random.split(key, 3)
        d = mx.random.categorical(mx.log(Q), key=k1).astype(mx.uint32)
        a, bonus = accept_sampled(P, d, P[:1], k2)  # wrong q
        counts[(np.array(d).tolist()[: a.item()] + [bonus.item()])[0]] += 1
    assert tv(counts / counts.sum(), p[0]) > 0.05


@pytest.mark.parametrize(
    "selector,temp,top_p,top_k,presence,script",
    [
        (True, 1.0, 1.0, 0, 0.0, None),
        (True, 0.8, 0.9, 5, 0.0, None),
        (True, 1.0, 1.0, 0, 1.5, None),
        (False, 0.7, 1.0, 4, 1.0, None),
        (True, 0.9, 1.0, 0, 0.0, [1, 4]),  # a plain step (pipelined), then a block
        (True, 1.0, 1.0, 0, 1.0, [2, 1]),  # with a penalty, plain steps go through cycle()
    ],
)
def test_end_to_end_sampling_matches_the_target_law(
    small_vocab_pair, selector, temp, top_p, top_k, presence, script
):
    model = small_vocab_pair
    prompt = [2, 5, 1, 7]
    n, trials = 4, 1000
    law = exact_law(model, prompt, n, temp, top_p, top_k, presence)
    procs = make_logits_processors(presence_penalty=presence or None)
    params = SamplingParams(temp, top_p, 0.0, top_k, procs)
    sched = None if script is None else (lambda: Scripted(script, plain=1))
    samples, drafted_accepted = draw(model, prompt, params, n, trials, selector, 11, sched)
    # drafts really were accepted along the way (scripts spend some steps drafting nothing)
    assert drafted_accepted > (trials // 4 if script is None else trials // 8)
    assert_law(samples, law, n)


def test_inverse_cdf_draws_match_the_probabilities_and_skip_zeros():
    # unnormalised (a residual), zeros inside and at the end
    p = mx.array([[0.0, 1.0, 0.0, 0.5, 0.5, 0.0], [0.3, 0.0, 0.0, 0.0, 0.0, 0.0]])
    n = 100_000
    draws = np.array(sample_rows(mx.repeat(p, n, axis=0), mx.random.key(7))).reshape(2, n)
    want = np.array(p) / np.array(p).sum(-1, keepdims=True)
    for row, w in zip(draws, want):
        freq = np.bincount(row, minlength=6) / n
        assert (freq[w == 0] == 0).all()
        assert np.abs(freq - w).max() < 5 * np.sqrt(0.25 / n)
