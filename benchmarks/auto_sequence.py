"""``auto`` over a sequence of prompt lengths in one process, as a user's session meets them:
what each request inherits from the ones before (acceptance priors, lookup priors, cost
bands, probe backoff), its speed-up over plain mlx-lm, and its schedule.

    python benchmarks/auto_sequence.py                              # 256, 3,500, 7,000
    python benchmarks/auto_sequence.py --lengths 3500,7000 -n 2 -m 64

Prompts are ``dflash bench --context``'s (standard-library source, then a request), as in
``long_context.py``. Greedy; every request's output is checked against plain decoding.
Run it on a quiet machine: one run per request, so other load moves the ratios.
"""

from __future__ import annotations

import argparse
import sys

ASKS = (
    "Explain what the code above does, function by function.",
    "Write a Python function that merges two sorted lists into one sorted list.",
)


def _costs(table) -> dict:
    return {b: round(table(b) * 1e3, 1) for b in (1, 2, 4, 8)} if table is not None else {}


def run(model, tok, lengths: list[int], prompts: int, max_tokens: int) -> list[dict]:
    """One row per request: its length, ``auto``'s speed-up, parity and schedule."""
    from dflash_mlx.bench.long_prompts import with_context
    from dflash_mlx.bench.runner import PromptResult, _autoregressive, _dflash
    from dflash_mlx.decoding.warmup import ensure
    from dflash_mlx.generation import encode_prompt

    tuning, seen = ensure(model), []
    finish = tuning.finish
    tuning.finish = lambda s: seen.append(s) or finish(s)  # the request's scheduler, kept
    rows = []
    for n in lengths:
        for text in with_context(tok, list(ASKS[:prompts]), n, False):
            ids = encode_prompt(tok, text, False)
            res = PromptResult()
            _autoregressive(model, ids, max_tokens, 0.0, 0, res)
            _dflash(model, ids, max_tokens, model.block_size, 0.0, 0, True, "auto", res, True)
            sched = seen[-1]
            rows.append(
                {
                    "tokens": len(ids),
                    "speedup": res.seconds["autoregressive"] / res.seconds["auto"],
                    "same": res.outputs["auto"] == res.outputs["autoregressive"],
                    **sched.summary(),
                    "costs_ms": _costs(sched.costs),
                    "notes": sched.notes,
                }
            )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo")
    p.add_argument("--lengths", default="256,3500,7000")
    p.add_argument("-n", "--prompts", type=int, default=1, choices=range(1, len(ASKS) + 1))
    p.add_argument("-m", "--max-tokens", type=int, default=64)
    p.add_argument("-v", "--verbose", action="store_true", help="print the schedule's notes")
    args = p.parse_args(argv)

    from dflash_mlx import load
    from dflash_mlx.bench.runner import PromptResult, _dflash

    model, tok = load(args.model)
    _dflash(model, tok.encode("def f("), 4, 8, 0.0, 0, True, "warm", PromptResult())
    lengths = [int(x) for x in args.lengths.split(",")]
    print("tokens   auto  same  plain  drafted blocks          copied blocks   costs ms (1/2/4/8)")
    for r in run(model, tok, lengths, args.prompts, args.max_tokens):
        drafted = {b: c for b, c in r["blocks"].items() if b > 1}
        costs = "/".join(f"{v:.0f}" for v in r["costs_ms"].values())
        print(
            f"{r['tokens']:>6} {r['speedup']:5.2f}x {'yes' if r['same'] else 'NO':>4}"
            f"  {r['plain_share']:4.0%}  {drafted!s:22.22} {r['lookup_blocks']!s:15.15} {costs}",
            flush=True,
        )
        for note in r["notes"] if args.verbose else ():
            print(f"         {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
