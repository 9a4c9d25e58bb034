"""What the drafter's side of a cycle costs against one plain target step, stage by stage
(docs/algorithm.md §2.4), with and without a draft vocabulary.

    python benchmarks/drafter_cost.py [--model demo] [--block 8] [--vocab 0 4096 8192 16384]

Each stage is timed alone (evaluated on its own), interleaved with plain target steps on the
same cache, median of ``--reps``; ratios are to the plain step measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx

import dflash_mlx  # noqa: F401  (loads the system BLAS before mlx)


def timed(fn, reps: int) -> float:
    """Median seconds of fn() (which must evaluate what it builds)."""
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def stages(model, cache, block: int, reps: int) -> dict:
    """Seconds of each drafter stage for one block after the cached context."""
    from dflash_mlx.cpu import draft_step
    from dflash_mlx.decoding.acceptance import SamplingParams
    from dflash_mlx.decoding.propose import propose

    d = model.drafter
    anchor = mx.array([17], mx.uint32)
    emb = model.embed_block(anchor, block)
    mx.eval(emb)
    hidden = draft_step.step(d, emb, cache.drafter)
    mx.eval(hidden)
    logits = model.draft_logits(hidden[:, 1:])
    mx.eval(logits)
    params = SamplingParams()
    out = {
        "embed": timed(lambda: mx.eval(model.embed_block(anchor, block)), reps),
        "layers": timed(lambda: mx.eval(draft_step.step(d, emb, cache.drafter)), reps),
        "head": timed(lambda: mx.eval(model.draft_logits(hidden[:, 1:])), reps),
        "selector": timed(
            lambda: mx.eval(propose(model, logits, hidden[:, 1:], anchor, params, True, None)[0]),
            reps,
        ),
    }

    def whole():
        h = draft_step.step(d, model.embed_block(anchor, block), cache.drafter)
        lg = model.draft_logits(h[:, 1:])
        mx.eval(propose(model, lg, h[:, 1:], anchor, params, True, None)[0])

    out["drafter_total"] = timed(whole, reps)
    return out


def main(argv=None) -> None:
    from dflash_mlx import load
    from dflash_mlx.decoding.acceptance import SamplingParams
    from dflash_mlx.decoding.steps import prefill
    from dflash_mlx.loading.loader import set_draft_vocab

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="demo")
    p.add_argument("--drafter", default=None)
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--vocab", type=int, nargs="+", default=[0, 4096, 8192, 16384])
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    model, tok = load(a.model, drafter=a.drafter, warmup=False)
    cache = model.make_cache()
    ids = [(i * 7919) % 30000 + 100 for i in range(a.context)]
    prefill(model, ids, cache, SamplingParams(), mx.random.key(0))
    tok_arr = mx.array([[ids[-1]]])

    def plain():
        logits, _ = model.adapter(tok_arr, cache.target)
        mx.eval(mx.argmax(logits[:, -1], -1))
        model.adapter.rollback(cache.target, 1, 0, None)

    own = model.draft_head
    rows = []
    for n in ["own"] + a.vocab:
        if n == "own":
            if own is None:
                continue
            model.draft_head = own
        else:
            set_draft_vocab(model, tok, n)
        plain_s = timed(plain, a.reps)
        st = stages(model, cache, a.block, a.reps)
        size = model.draft_head.size if model.draft_head is not None else "full"
        rows.append(
            {"vocab": size, "plain_ms": 1e3 * plain_s, **{k: 1e3 * v for k, v in st.items()}}
        )
    print(
        f"{'vocab':>8} {'plain':>7} {'embed':>7} {'layers':>7} {'head':>7} {'select':>7} "
        f"{'drafter':>8} {'share':>6}"
    )
    for r in rows:
        print(
            f"{r['vocab']!s:>8} {r['plain_ms']:7.1f} {r['embed']:7.2f} {r['layers']:7.2f} "
            f"{r['head']:7.2f} {r['selector']:7.2f} {r['drafter_total']:8.2f} "
            f"{r['drafter_total'] / r['plain_ms']:6.1%}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
