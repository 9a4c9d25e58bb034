"""Exact laws and samples for the sampling-law tests: enumerate the target's joint law of
the first tokens, draw speculative samples, compare them."""

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import make_logits_processors

from dflash_mlx.decoding.acceptance import SamplingParams, target_probs
from dflash_mlx.decoding.loop import DecodeOptions, decode


def tv(a, b):
    return 0.5 * np.abs(np.asarray(a) - np.asarray(b)).sum()


def exact_law(model, prompt, n, temp, top_p, top_k, presence):
    """Joint law of the first n generated tokens, by enumeration with mlx-lm's processors."""
    procs = make_logits_processors(presence_penalty=presence or None)
    params = SamplingParams(temp, top_p, 0.0, top_k)
    law = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for prefix, pr in law.items():
            seq = mx.array(prompt + list(prefix))
            logits = model.target(seq[None])[:, -1].astype(mx.float32)
            for proc in procs:
                logits = proc(seq, logits)
            p = np.array(target_probs(logits, params)[0])
            for t in range(8):
                if p[t] > 0:
                    nxt[prefix + (t,)] = pr * p[t]
        law = nxt
    return law


def processed_law(model, prompt, n, params, make_processor, vocab: int = 8):
    """Joint law of the first n tokens when a fresh processor from ``make_processor()``
    (first shown the prompt) masks each prefix's logits, by enumeration."""
    law = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for prefix, pr in law.items():
            seq = mx.array(list(prompt) + list(prefix))
            logits = model.target(seq[None])[:, -1].astype(mx.float32)
            proc = make_processor()
            proc(mx.array(list(prompt)), logits)
            p = np.array(target_probs(proc(seq, logits), params)[0])
            for t in range(vocab):
                if p[t] > 0:
                    nxt[prefix + (t,)] = pr * p[t]
        law = nxt
    return law


def draw(model, prompt, params, n, trials, selector, seed, scheduler=None):
    """``trials`` speculative samples of n tokens (block 4): (samples, drafts accepted)."""
    samples, accepted = [], 0
    key = mx.random.key(seed)
    for _ in range(trials):
        key, sub = mx.random.split(key)
        out = []
        for c in decode(
            model,
            prompt,
            model.make_cache(),
            params,
            DecodeOptions(
                max_tokens=n,
                block_size=4,
                use_selector=selector,
                key=sub,
                policy=None if scheduler is None else scheduler(),
            ),
        ):
            out += c.tokens
            accepted += c.accepted
        samples.append(tuple(out[:n]))
    return samples, accepted


def assert_law(samples, law, n, first=1):
    """Samples of n tokens follow the enumerated joint law: each position's marginal from
    ``first`` on, and the pair at positions 1-2 (none drawn that the law rules out)."""
    trials = len(samples)
    for pos in range(first, n):  # marginal law of each later position
        exact = np.zeros(8)
        for seq, pr in law.items():
            exact[seq[pos]] += pr
        emp = np.bincount([s[pos] for s in samples], minlength=8) / trials
        assert tv(emp, exact) < 0.07, (pos, emp, exact)
    exact2 = {}
    for seq, pr in law.items():
        exact2[seq[1:3]] = exact2.get(seq[1:3], 0) + pr
    keys = sorted(set(exact2) | {s[1:3] for s in samples})
    emp2 = [sum(s[1:3] == k for s in samples) / trials for k in keys]
    assert tv(emp2, [exact2.get(k, 0) for k in keys]) < 0.12
    assert all(k in exact2 for k in {s[1:3] for s in samples})  # no impossible pair drawn
