"""What ``block_size="auto"`` sees and chooses: the measured cost of a step per block size,
the acceptance it estimates, the schedule per prompt, and its speed against plain decoding
(mlx-lm) and every fixed block size, all in one process.

    python benchmarks/schedule.py                           # the demo pair, built-in prompts
    python benchmarks/schedule.py --model M --drafter D --dataset chat -n 8 --json out.json
    DFLASH_SYSTEM_BLAS=0 python benchmarks/schedule.py      # MLX's bundled reference BLAS

Speeds are generated tokens per second after the first token (prefill excluded), summed over
the prompts; each method runs every prompt once, in turn, so machine drift hits all alike.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def cost_curve(model, reps: int = 3) -> dict:
    """Seconds per step at every block size (1 = a plain step), measured on a dummy context."""
    import mlx.core as mx

    from dflash_mlx.decoding.acceptance import SamplingParams
    from dflash_mlx.decoding.policy import Choice
    from dflash_mlx.decoding.steps import cycle, generation_stream, plain_steps, prefill

    params, cache = SamplingParams(), model.make_cache()
    ids = [i % model.adapter.vocab_size for i in range(1, 129)]
    out = {}
    with mx.stream(generation_stream()):
        first, key = prefill(model, ids, cache, params, mx.random.key(0))
        hist = ids + first.tokens
        for b in range(2, model.block_size + 1):
            times = []
            for _ in range(reps + 1):
                t = time.perf_counter()
                step = cycle(model, cache, params, hist, Choice(b), (key, key))
                mx.eval(cache.state)
                times.append(time.perf_counter() - t)
                hist += step.tokens
            out[b] = sorted(times[1:])[reps // 2]
        t = None
        for i, step in enumerate(plain_steps(model, cache, params, hist, reps + 4, key)):
            t = time.perf_counter() if i == 0 else t
        out[1] = (time.perf_counter() - t) / (reps + 3)
    return dict(sorted(out.items()))


def speed(model, tok, prompts, max_tokens, temp, block) -> dict:
    """tok/s of one method over the prompts, and (for auto) its schedule per prompt."""
    from dflash_mlx import stream_generate

    toks, secs, per_prompt = 0, 0.0, []
    for p in prompts:
        first = last = None
        for r in stream_generate(
            model, tok, p, max_tokens=max_tokens, temperature=temp, block_size=block, seed=None
        ):
            if first is None:
                first = time.perf_counter()
            last = r
        secs += time.perf_counter() - first
        toks += last.generation_tokens - 1
        per_prompt.append(
            {
                "tokens": last.generation_tokens,
                "tau": round(last.tau, 2),
                "blocks": last.blocks,
                "plain_share": round(last.plain_share, 3),
                "schedule": last.schedule,
            }
        )
    return {"tok_per_s": toks / max(secs, 1e-9), "prompts": per_prompt}


def plain_speed(model, tok, prompts, max_tokens, temp) -> float:
    """mlx-lm's own decoding of the target: tok/s after the first token."""
    from mlx_lm.generate import stream_generate as mlx_stream
    from mlx_lm.sample_utils import make_sampler

    from dflash_mlx.generation import encode_prompt

    toks, secs = 0, 0.0
    for p in prompts:
        first, n = None, 0
        ids = encode_prompt(tok, p)
        for _ in mlx_stream(
            model.target, tok, ids, max_tokens=max_tokens, sampler=make_sampler(temp)
        ):
            n += 1
            if first is None:
                first = time.perf_counter()
        secs += time.perf_counter() - first
        toks += n - 1
    return toks / max(secs, 1e-9)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--drafter")
    ap.add_argument("--dataset", default="mixed", help="mixed, code, chat or a JSONL file")
    ap.add_argument("-n", "--max-samples", type=int, default=8)
    ap.add_argument("-m", "--max-tokens", type=int, default=128)
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--blocks", type=int, nargs="*", help="fixed sizes to compare (default all)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    from dflash_mlx import load
    from dflash_mlx.bench.runner import load_prompts
    from dflash_mlx.cpu.blas import measure

    model, tok = load(a.model, drafter=a.drafter, warmup=True)  # the costs shown below
    prompts = load_prompts(a.dataset, a.max_samples)
    rep = {"blas": measure()["name"], "costs_ms": {}, "methods": {}}
    costs = cost_curve(model)
    rep["costs_ms"] = {b: round(1e3 * c, 2) for b, c in costs.items()}
    print(f"BLAS: {rep['blas']}")
    print("step cost by block (ms): " + "  ".join(f"{b}:{c}" for b, c in rep["costs_ms"].items()))
    rep["methods"]["plain (mlx-lm)"] = {
        "tok_per_s": plain_speed(model, tok, prompts, a.max_tokens, a.temp)
    }
    for b in a.blocks or range(2, model.block_size + 1):
        rep["methods"][f"block {b}"] = speed(model, tok, prompts, a.max_tokens, a.temp, b)
    rep["methods"]["auto"] = speed(model, tok, prompts, a.max_tokens, a.temp, "auto")
    sched = model.tuning.scheduler(a.temp == 0, True)
    rep["acceptance_prior"] = [round(r, 3) for r in sched.acc.rates()]
    base = rep["methods"]["plain (mlx-lm)"]["tok_per_s"]
    best = max((v["tok_per_s"], k) for k, v in rep["methods"].items() if k.startswith("block"))
    print(f"{'method':<16}{'tok/s':>8}{'vs plain':>10}")
    for k, v in rep["methods"].items():
        print(f"{k:<16}{v['tok_per_s']:>8.1f}{v['tok_per_s'] / base:>9.2f}x")
    auto = rep["methods"]["auto"]["tok_per_s"]
    print(f"auto / best fixed ({best[1]}): {auto / best[0]:.3f};  auto / plain: {auto / base:.3f}")
    print("acceptance estimate by position: " + " ".join(map(str, rep["acceptance_prior"])))
    for i, p in enumerate(rep["methods"]["auto"]["prompts"]):
        print(
            f"prompt {i}: blocks {p['blocks']} plain {100 * p['plain_share']:.0f}% "
            f"tau {p['tau']}" + (f"  [{p['schedule'][0]}]" if p["schedule"] else "")
        )
    if a.json:
        Path(a.json).write_text(json.dumps(rep, indent=2))
    return rep


if __name__ == "__main__":
    main()
