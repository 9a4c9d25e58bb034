"""Where the drafter's acceptance goes at long prompts (issue 33, part 6): teacher-forced tau
(top-1 drafting) on the target's own greedy continuation, by prompt length, with the
drafter's context cut three ways.

    python benchmarks/long_context_causes.py                     # demo, 256 .. 7000 tokens
    python benchmarks/long_context_causes.py --lengths 256,7000 -n 2 -m 64
    python benchmarks/long_context_causes.py --heldout   # the drafter's held-out long prompts

Columns, each on the same anchors and labels:
- ``window W``: the drafter attends to its last W - 1 context rows (its checkpoint's window,
  then shorter ones): what the window's reach costs or gains;
- ``near N``: the target re-run on the prompt's first 8 tokens and its last N - 8 only, so
  the drafter's features are those of a short prompt over the same nearby text: what the
  target's hidden states under a long context cost the drafter (the features).
Absolute positions alone change nothing: RoPE makes the drafter's attention depend only on
the distance between rows.
"""

from __future__ import annotations

import argparse
import json
import sys

from long_context import PROMPTS


def tf_tau(model, ids, continuation, block, window) -> tuple[float, list[float]]:
    """(teacher-forced tau, Recall@1 per position) of the drafter on ids + continuation."""
    from dflash_mlx.bench.runner import PromptResult, _recall

    args = model.drafter.args
    saved, args.sliding_window = args.sliding_window, window
    try:
        res = PromptResult(continuation=continuation)
        _recall(model, ids, block, args.selector_top_k, res)
    finally:
        args.sliding_window = saved
    n = max(res.anchors, 1)
    return 1 + res.top1_run / n, (res.recall["1"] / n).tolist()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo")
    p.add_argument("--drafter", default=None)
    p.add_argument("--lengths", default="256,2048,4096,7000")
    p.add_argument("-n", "--prompts", type=int, default=2)
    p.add_argument("-m", "--max-tokens", type=int, default=64)
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--windows", default="0,1024,512,128", help="0: the checkpoint's")
    p.add_argument("--near", default="1024,256", help="tokens the target re-runs on")
    p.add_argument(
        "--heldout",
        action="store_true",
        help="train/prompts.py's held-out long prompts (~N tokens) instead of bench --context's",
    )
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)

    from dflash_mlx import load
    from dflash_mlx.bench.long_prompts import with_context
    from dflash_mlx.bench.runner import PromptResult, _autoregressive
    from dflash_mlx.generation import encode_prompt
    from dflash_mlx.train.prompts import long_prompts

    model, tok = load(a.model, drafter=a.drafter)
    own = model.drafter.args.sliding_window
    windows = [int(w) or own for w in a.windows.split(",")]
    near = [int(n) for n in a.near.split(",")]
    cols = [f"window {w}" for w in windows] + [f"near {n}" for n in near]
    print("tokens  actual " + " ".join(f"{c:>12}" for c in cols))
    out = {}
    for n in (int(x) for x in a.lengths.split(",")):
        asks = [PROMPTS[i % len(PROMPTS)] for i in range(a.prompts)]
        sums = dict.fromkeys(cols + ["prompt_tokens"], 0.0)
        texts = long_prompts("heldout", (n,), a.prompts) if a.heldout else None
        for text in texts or with_context(tok, asks, n, False):
            ids = encode_prompt(tok, text, False)
            sums["prompt_tokens"] += len(ids) / a.prompts
            res = PromptResult()
            _autoregressive(model, ids, a.max_tokens, 0.0, 0, res)
            for w, c in zip(windows, cols):
                sums[c] += tf_tau(model, ids, res.continuation, a.block, w)[0] / a.prompts
            for k in near:
                cut = ids if len(ids) <= k else ids[:8] + ids[len(ids) - (k - 8) :]
                t = tf_tau(model, cut, res.continuation, a.block, own)[0]
                sums[f"near {k}"] += t / a.prompts
        out[str(n)] = sums
        print(
            f"{n:>6} {sums['prompt_tokens']:>7.0f} " + " ".join(f"{sums[c]:>12.3f}" for c in cols),
            flush=True,
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": vars(a), "tau_teacher_forced": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
