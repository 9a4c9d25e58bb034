"""DFlash by prompt length (issue 33): plain decoding, DFlash 2 at a fixed block and ``auto``
on prompts made N tokens long (``dflash bench --context``'s standard-library source, then a
built-in request), per length: speed-up, tau, per-position acceptance, teacher-forced
Recall@1 and the cycle split (draft / verify / rollback / host).

    python benchmarks/long_context.py                          # demo, 256 .. 7000 tokens
    python benchmarks/long_context.py --lengths 256,4096 -n 2 -m 64 --json out.json
    python benchmarks/long_context.py --window 512             # the drafter's window cut

Every method runs on the same prompts in one process, prompt after prompt, so the ratios
hold while other jobs share the machine (the absolute tok/s do not). ``--window`` overrides
the drafter's sliding window (decoding and teacher forcing alike), to see how much of the
acceptance at long prompts the window's reach explains.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

PROMPTS = (  # requests that read the source before them, and ones that do not need it
    "Explain what the code above does, function by function.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write unit tests for the first function in the code above.",
    "How do I read a CSV file and compute the average of one column in Python?",
)


def measure(model, tok, prompts: list[str], args) -> dict:
    """Every method on every prompt of one length -> the bench's summary, plus the split."""
    from dflash_mlx.bench.parity import parity_report
    from dflash_mlx.bench.prefix import copied, prefilled
    from dflash_mlx.bench.runner import (
        PromptResult,
        _autoregressive,
        _dflash,
        _recall,
        latency_split,
        summarize,
    )
    from dflash_mlx.generation import encode_prompt

    results, lengths, split = [], [], None
    top_k = model.drafter.args.selector_top_k
    for text in prompts:
        ids = encode_prompt(tok, text, False)
        lengths.append(len(ids))
        prefix = prefilled(model, ids)  # once per prompt; each method decodes from a copy
        res = PromptResult()
        _autoregressive(model, ids, args.max_tokens, 0.0, 0, res, cache=copied(prefix))
        run = (model, ids, args.max_tokens, args.block, 0.0, 0, True)
        _dflash(*run, "dflash2", res, lookup=False, cache=copied(prefix))
        _dflash(*run, "auto", res, lookup=True, cache=copied(prefix))
        _recall(model, ids, args.block, top_k, res, prefix=prefix)
        if split is None:
            split = latency_split(
                model, ids, args.max_tokens, args.block, 0.0, cache=copied(prefix)
            )
        results.append(res)
    rep = summarize(results, args.block, top_k, model, prompts, args.max_tokens, 0.0)
    rep["config"]["prompt_tokens"] = round(float(np.mean(lengths)))
    rep["parity"] = parity_report([r.outputs for r in results], 0.0, tok.decode)
    rep["latency_split"] = split
    return rep


def row(n: int, rep: dict) -> str:
    """One line of the printed table."""
    m, s = rep["methods"], rep["latency_split"]
    same = all(v["identical"] == v["of"] for v in rep["parity"]["summary"].values())
    ms = {k: s[k] * s["cycle_ms"] for k in s if k != "cycle_ms"}
    draft = ms["drafter"] + ms["conv"] + ms["selector"]
    return (
        f"{n:>6} {m['autoregressive']['tok_per_s']:>8.1f} {m['dflash2']['speedup']:>6.2f}x "
        f"{m['dflash2']['tau']:>5.2f} {m['auto']['speedup']:>6.2f}x "
        f"{rep['tau_top1_teacher_forced']:>6.2f} {s['cycle_ms']:>7.1f} {draft:>6.1f} "
        f"{ms['verify'] + ms['acceptance']:>6.1f} {ms['rollback']:>5.1f} {ms['host']:>5.1f} "
        f"{'yes' if same else 'NO'}"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo")
    p.add_argument("--drafter", default=None)
    p.add_argument("--lengths", default="256,1024,2048,4096,7000")
    p.add_argument("-n", "--prompts", type=int, default=2, help="prompts per length")
    p.add_argument("-m", "--max-tokens", type=int, default=64)
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--window", type=int, default=None, help="override the drafter's window")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from dflash_mlx import load
    from dflash_mlx.bench.long_prompts import with_context
    from dflash_mlx.bench.runner import PromptResult, _dflash

    model, tok = load(args.model, drafter=args.drafter)
    if args.window is not None:
        model.drafter.args.sliding_window = args.window
    asks = [PROMPTS[i % len(PROMPTS)] for i in range(args.prompts)]
    _dflash(model, tok.encode("def f("), 4, args.block, 0.0, 0, True, "warm", PromptResult())
    print(
        f"window {model.drafter.args.sliding_window}, block {args.block}, "
        f"{args.prompts} prompts x {args.max_tokens} tokens, greedy",
        file=sys.stderr,
    )
    head = "tokens  AR tok/s  dflash2  tau   auto  tf-tau cycle ms  draft verify  roll  host same"
    print(head)
    out = {}
    for n in (int(x) for x in args.lengths.split(",")):
        rep = measure(model, tok, with_context(tok, asks, n, False), args)
        out[str(n)] = rep
        print(row(n, rep), flush=True)
        if args.json:  # after every length: a long sweep stopped midway keeps what it did
            with open(args.json, "w") as f:
                json.dump({"config": vars(args), "lengths": out}, f, indent=1)
    print("\nper-position acceptance (dflash2, conditional) | teacher-forced Recall@1")
    for n, rep in out.items():
        acc = " ".join(f"{100 * a:3.0f}" for a in rep["positions"]["acceptance_dflash2"])
        rec = " ".join(f"{100 * a:3.0f}" for a in rep["positions"]["recall@1"])
        print(f"{n:>6}: {acc} | {rec}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
