"""Tree verification A/B (dflash_mlx/tree.py): DFlash 2 at a fixed block and ``auto``, each
with and without the first draft's siblings, against plain mlx-lm decoding, in one process
(the orders alternate per prompt, so drift on a noisy machine falls on both sides).

    python benchmarks/tree_ab.py [--prompts benchmarks/unseen_prompts.jsonl] [-n 6] [-m 64]
"""

from __future__ import annotations

import argparse
import json

import dflash_mlx  # noqa: F401  (first: it loads the system BLAS before MLX)
from dflash_mlx import load
from dflash_mlx.bench.runner import PromptResult, _autoregressive, _dflash, load_prompts
from dflash_mlx.generation import encode_prompt


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="benchmarks/unseen_prompts.jsonl")
    ap.add_argument("-n", type=int, default=6)
    ap.add_argument("-m", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=8)
    args = ap.parse_args(argv)
    model, tok = load("demo", quiet=True)
    prompts = load_prompts(args.prompts, args.n)
    runs = [(f"{m} tree={t}", m, t) for m in ("dflash2", "auto") for t in (True, False)]
    total = {name: [0, 0.0, 0, 0] for name in ["autoregressive"] + [r[0] for r in runs]}
    warm = encode_prompt(tok, prompts[0], False)[:8]
    _dflash(model, warm, 4, args.block_size, 0.0, 0, True, "warm", PromptResult())
    for i, text in enumerate(prompts):
        ids = encode_prompt(tok, text, False)
        res = PromptResult()
        _autoregressive(model, ids, args.m, 0.0, 0, res)
        order = runs if i % 2 == 0 else runs[::-1]
        for name, method, tree in order:
            _dflash(model, ids, args.m, args.block_size, 0.0, 0, True, method, res, tree=tree)
            res.tokens[name], res.seconds[name] = res.tokens[method], res.seconds[method]
            res.stats[name] = res.stats[method]
        for name, row in total.items():
            row[0] += res.tokens[name]
            row[1] += res.seconds[name]
            if name in res.stats:
                row[2] += res.stats[name].cycles
                row[3] += res.stats[name].committed
    ar = total["autoregressive"][0] / total["autoregressive"][1]
    out = {}
    for name, (n, s, cycles, committed) in total.items():
        tau = committed / cycles if cycles else 1.0
        out[name] = {"tok_per_s": n / s, "speedup": n / s / ar, "tau": tau}
        print(f"{name:16s} {n / s:6.1f} tok/s  {n / s / ar:5.2f}x  tau {tau:.2f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
