"""Prompt tokens per second of dflash-mlx's prefill against mlx-lm's own prefill of the same
prompt on the same target (docs/algorithm.md §4.3), in one process, runs alternating.

    python benchmarks/prefill.py                     # the demo pair, a ~1,500-token prompt
    python benchmarks/prefill.py --model T --drafter D --tokens 4000 --json out.json

Methods: ``mlx-lm`` is ``generate_step`` with ``max_tokens=0`` (its chunks of
``prefill_step_size``, caches only, then the last token alone with the head: the first
token is computed, nothing after it); ``dflash`` is ``steps.prefill`` (chunks of
``prefill_chunk``, the head on the last row only, the drafter's features kept); ``full-head``
is the prefill as it was before: each chunk evaluated its [chunk, vocab] logits' last row.
Both run the same model instance, so a backend's prepared layers serve both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import dflash_mlx  # noqa: F401  (loads the system BLAS before mlx)

# isort: split
import mlx.core as mx

TEXT = (
    "def parse_args(argv):\n    parser = argparse.ArgumentParser(description='tool')\n"
    "    parser.add_argument('--input', help='the file to read')\n    return parser\n"
    "The quick brown fox jumps over the lazy dog, and the dog sleeps on.\n"
)


def mlx_lm_prefill(model, prompt: list[int], step: int) -> None:
    """mlx-lm's prefill and first token (``generate_step`` with ``max_tokens=0``)."""
    from mlx_lm.generate import generate_step

    cache = model.adapter.make_cache()
    list(
        generate_step(
            mx.array(prompt), model.target, max_tokens=0, prompt_cache=cache, prefill_step_size=step
        )
    )


def dflash_prefill(model, prompt: list[int], step: int) -> None:
    """dflash-mlx's prefill and first token."""
    from dflash_mlx.decoding.acceptance import SamplingParams
    from dflash_mlx.decoding.steps import prefill

    prefill(model, prompt, model.make_cache(), SamplingParams(), mx.random.key(0), step)


def full_head_prefill(model, prompt: list[int], step: int) -> None:
    """The prefill before issue 32: every chunk's logits built whole, their last row
    evaluated with the caches (no stop checks, no KV quantization: not needed here)."""
    from dflash_mlx.decoding.steps import prefill_chunk

    cache, chunk = model.make_cache(), prefill_chunk(step)
    for start in range(0, len(prompt), chunk):
        ids = mx.array(prompt[start : start + chunk])[None]
        logits, feats = model.adapter(ids, cache.target)
        model.drafter.append_context(feats, cache.drafter)
        mx.eval(logits[:, -1], cache.state)
    mx.argmax(logits[0, -1]).item()


METHODS = {"mlx-lm": mlx_lm_prefill, "dflash": dflash_prefill, "full-head": full_head_prefill}


def measure(model, prompt: list[int], rounds: int, step: int) -> dict:
    """Median seconds per method, the order rotated each round."""
    names = list(METHODS)
    for name in names:  # warm-up: compiled kernels, first allocations
        METHODS[name](model, prompt, step)
    times = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            mx.clear_cache()
            t = time.perf_counter()
            METHODS[name](model, prompt, step)
            times[name].append(time.perf_counter() - t)
    return {n: statistics.median(v) for n, v in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--drafter")
    ap.add_argument("--tokens", type=int, default=1500, help="prompt length")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--step", type=int, default=2048, help="prefill_step_size")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from dflash_mlx import load
    from dflash_mlx.decoding.steps import prefill_chunk

    model, tok = load(args.model, drafter=args.drafter)
    ids = tok.encode(TEXT * (1 + args.tokens // max(1, len(tok.encode(TEXT)))))
    prompt = ids[: args.tokens]
    secs = measure(model, prompt, args.rounds, args.step)
    base = len(prompt) / secs["mlx-lm"]
    rows = []
    print(
        f"{len(prompt)} prompt tokens, device {mx.default_device()}, dflash chunks of "
        f"{prefill_chunk(args.step)}, mlx-lm's of {args.step}"
    )
    print(f"{'method':<11}{'seconds':>9}{'tok/s':>9}{'x mlx-lm':>10}")
    for name, s in secs.items():
        rate = len(prompt) / s
        rows.append(
            {
                "method": name,
                "seconds": s,
                "tok_s": rate,
                "ratio": rate / base,
                "tokens": len(prompt),
                "device": str(mx.default_device()),
            }
        )
        print(f"{name:<11}{s:>9.3f}{rate:>9.0f}{rate / base:>9.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
