"""``auto`` by prompt length: plain mlx-lm decoding, ``auto`` (costs and acceptance priors
per context band, a band's first costs predicted by the warm-up's long-context timings) and
``auto`` whose bands start as copies of the band below (before the long-context warm-up; ``--arms``
adds ``one table``: one cost table and prior for every length, its scheduler told a context
of 0), in one process, the order alternating per run, greedy, each prompt cache kept so
that only the first run of a prompt pays its prefill.

    python benchmarks/auto_length.py                       # demo pair, 200 / 3,500 / 7,000
    python benchmarks/auto_length.py --lengths 3500 --prompts 3 -n 64 --runs 2 --json out.json

Prompt k of length L is L tokens of Python's own ``dataclasses``, ``inspect``, ``argparse``
and ``typing`` sources, from token k * L on.
Speeds are tokens per second after the first token. Other load on the machine shows in the
numbers (the load average is printed): compare the ratios, not the speeds.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import time
import typing


def _plain(model, ids, n, cache) -> tuple[list[int], float]:
    """mlx-lm's greedy decoding, the cache trimmed back to the prompt's first L - 1 tokens."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import trim_prompt_cache

    done = cache[0].offset
    if done:
        trim_prompt_cache(cache, done - (len(ids) - 1))
    feed = ids[len(ids) - 1 :] if done else ids
    out, first = [], None
    for t, _ in generate_step(mx.array(feed), model.target, max_tokens=n, prompt_cache=cache):
        first = first or time.perf_counter()
        out.append(int(t))
    return out, time.perf_counter() - first


def _auto(model, ids, n, cache, tuning, context) -> tuple[list[int], float, dict]:
    from dflash_mlx.decoding.acceptance import SamplingParams
    from dflash_mlx.decoding.loop import DecodeOptions, decode

    sched = tuning.scheduler(True, True, lookup=True, context=context)
    out, first = [], None
    for c in decode(model, ids, cache, SamplingParams(), DecodeOptions(n, policy=sched)):
        first = first or time.perf_counter()
        out += c.tokens
    took = time.perf_counter() - first
    tuning.finish(sched)
    return out[:n], took, {**sched.summary(), "notes": sched.notes}


def measure(model, ids, n, runs, tunings) -> dict:
    """tok/s of each method over ``runs`` timed runs (one untimed first), parity, schedules."""
    from mlx_lm.models.cache import make_prompt_cache

    caches = {"plain": make_prompt_cache(model.target)}
    caches.update({k: model.make_cache() for k in tunings})
    order, done, outs = list(caches), {k: [0, 0.0] for k in caches}, {}
    sched = {k: [] for k in tunings}
    for r in range(runs + 1):
        for k in order if r % 2 == 0 else order[::-1]:
            if k == "plain":
                out, took = _plain(model, ids, n, caches[k])
            else:
                context = 0 if k == "one table" else len(ids)
                out, took, summary = _auto(model, ids, n, caches[k], tunings[k], context)
                sched[k] += [summary] if r else []
            outs[k] = out
            if r:
                done[k][0] += len(out) - 1
                done[k][1] += took
    tps = {k: t / s for k, (t, s) in done.items()}
    return {
        "tok_per_s": {k: round(v, 2) for k, v in tps.items()},
        "speedup": {k: round(tps[k] / tps["plain"], 3) for k in tunings},
        "parity": all(o == outs["plain"] for o in outs.values()),
        "schedules": sched,
    }


def setup(name: str, tokens: int):
    """(the loaded pair, its warm-up's costs, about ``tokens`` prompt ids): the costs are
    measured or read as ``auto``'s first request would; the ids are Python's own
    ``dataclasses``, ``inspect``, ``argparse`` and ``typing`` sources."""
    from dflash_mlx import load  # first: the CPU backend's BLAS loads before MLX
    from dflash_mlx.decoding.warmup import ensure

    model, tok = load(name, quiet=True)
    base = ensure(model)
    text = "".join(inspect.getsource(m) for m in (dataclasses, inspect, argparse, typing))
    return model, base, tok.encode(text[: 5 * tokens])  # ~4 characters a token


def fresh(base, long: bool = True):
    """A Tuning from the warm-up's costs alone (nothing learnt yet); ``long``: with its
    long-context tables (else a band starts as a copy of the band below)."""
    from dflash_mlx.decoding.schedule import Tuning

    copied = base.measured_lookup.copy()
    return Tuning(base.measured.copy(), copied, base.long if long else None)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--lengths", type=int, nargs="+", default=[200, 3500, 7000])
    ap.add_argument("-n", "--max-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=1, help="prompts per length")
    ap.add_argument("--first", type=int, default=0, help="index of the first prompt")
    arms = ("auto", "bands copied", "one table")
    ap.add_argument("--arms", nargs="+", default=list(arms[:2]), choices=arms)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    model, base, ids = setup(a.model, max(a.lengths) * (a.first + a.prompts))
    tunings = {k: fresh(base, long=k == "auto") for k in a.arms}
    rep = {"load_average": os.getloadavg()[0], "lengths": {}}
    print(f"load average {rep['load_average']:.2f}")
    for n in a.lengths:
        for k in range(a.first, a.first + a.prompts):
            got = measure(model, ids[k * n : (k + 1) * n], a.max_tokens, a.runs, tunings)
            rep["lengths"][f"{n}/{k}"] = got
            keys = ("tok_per_s", "speedup", "parity")
            print(f"{n:6d} tokens, prompt {k}: " + json.dumps({x: got[x] for x in keys}))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rep, f, indent=1)


if __name__ == "__main__":
    main()
