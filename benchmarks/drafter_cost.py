"""What the drafter's side of a cycle costs against one plain target step, stage by stage
(docs/algorithm.md §2.4), with and without a draft vocabulary.

    python benchmarks/drafter_cost.py [--model demo] [--block 8] [--kept 2] [--vocab 0 8192]

Each stage is timed alone (evaluated on its own), round-robin with plain target steps on the
same cache, median of ``--reps``; ratios are to the plain step measured in the same run.
``append`` is the context append of ``--kept`` rows (a verify's kept rows) projected on its
own, as a cycle did before; ``layers+kept`` the draft's layers with those rows projected in
the same pass (``cpu/draft_step.py``), as a cycle does now. ``drafter`` is the whole cost per
cycle now (layers with the kept rows, head, selector), ``before`` the same with the append
on its own. ``--cpu-time`` times process CPU seconds instead of wall time (steadier on a
shared machine; run with ``OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1`` to count one thread).
``--after-plain`` runs an (untimed) plain step before each stage, as a cycle runs the
drafter right after the verify: the target's weights then hold the caches and the drafter's
come from memory (+0.3-1.4 ms a demo draft here); without it each stage follows another.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

# The package before MLX: MLX then binds the system OpenBLAS and the few-row kernel
# (imported after MLX, MLX keeps its wheel's reference BLAS).
import dflash_mlx  # noqa: F401

# isort: split
import mlx.core as mx


def timed_round_robin(fns: dict, reps: int, clock=time.perf_counter, before=None) -> dict:
    """Median seconds of each fn() (which must evaluate what it builds), the fns taking
    turns so that a shared machine's drift hits them alike; the first two rounds are warm-up.
    ``before``: run untimed before each fn but the one named "plain"."""
    out = {name: [] for name in fns}
    for _ in range(reps + 2):
        for name, fn in fns.items():
            if before is not None and name != "plain":
                before()
            t = clock()
            fn()
            out[name].append(clock() - t)
    return {name: statistics.median(v[2:]) for name, v in out.items()}


def stage_fns(model, cache, block: int, kept: int) -> dict:
    """The drafter's stages for one block after the cached context, each leaving the cache
    as it found it; ``kept`` rows of target features stand for a verify's kept rows."""
    from dflash_mlx.cpu import draft_step
    from dflash_mlx.decoding.acceptance import SamplingParams
    from dflash_mlx.decoding.propose import propose

    d, ctx = model.drafter, cache.drafter
    anchor = mx.array([17], mx.uint32)
    emb = model.embed_block(anchor, block)
    feats = mx.random.normal((1, kept, d.feature_size)).astype(d.fc.weight.dtype)
    mx.eval(emb, feats)
    hidden = draft_step.step(d, emb, ctx)
    mx.eval(hidden)
    logits = model.draft_logits(hidden[:, 1:])
    mx.eval(logits)
    params = SamplingParams()

    def undo():
        for c in ctx:
            c.trim(kept)

    def draft():
        h = draft_step.step(d, model.embed_block(anchor, block), ctx)
        lg = model.draft_logits(h[:, 1:])
        mx.eval(propose(model, lg, h[:, 1:], anchor, params, True, None)[0])

    def appended(lazy):
        def run():
            if lazy:  # pending: the next draft projects them in its pass
                draft_step.append_context(d, feats, ctx)
            else:  # projected now; the cycle's async evaluation, waited for
                d.append_context(feats, ctx, lazy=False)
                mx.eval([c.state for c in ctx])

        return run

    def then(*fns):
        def run():
            for fn in fns:
                fn()

        return run

    return {
        "embed": lambda: mx.eval(model.embed_block(anchor, block)),
        "layers": lambda: mx.eval(draft_step.step(d, emb, ctx)),
        "append": then(appended(False), undo),
        "layers+kept": then(appended(True), lambda: mx.eval(draft_step.step(d, emb, ctx)), undo),
        "head": lambda: mx.eval(model.draft_logits(hidden[:, 1:])),
        "selector": lambda: mx.eval(
            propose(model, logits, hidden[:, 1:], anchor, params, True, None)[0]
        ),
        "before": then(appended(False), draft, undo),
        "drafter": then(appended(True), draft, undo),
    }


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
    p.add_argument("--kept", type=int, default=2, help="context rows appended per cycle")
    p.add_argument("--vocab", type=int, nargs="*", default=[], help="draft vocabularies too")
    p.add_argument("--cpu-time", action="store_true", help="process CPU time, not wall time")
    p.add_argument("--after-plain", action="store_true", help="each stage after a plain step")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    model, tok = load(a.model, drafter=a.drafter, warmup=False)
    cache = model.make_cache()
    ids = [(i * 7919) % 30000 + 100 for i in range(a.context)]
    prefill(model, ids, cache, SamplingParams(), mx.random.key(0))
    model.drafter.flush_context(cache.drafter)
    tok_arr = mx.array([[ids[-1]]])

    def plain():
        logits, _ = model.adapter(tok_arr, cache.target)
        mx.eval(mx.argmax(logits[:, -1], -1))
        model.adapter.rollback(cache.target, 1, 0, None)

    own = model.draft_head
    clock = time.process_time if a.cpu_time else time.perf_counter
    rows = []
    for n in ["own"] + a.vocab:
        if n == "own":
            if own is None:
                continue
            model.draft_head = own
        else:
            set_draft_vocab(model, tok, n)
        fns = {"plain": plain, **stage_fns(model, cache, a.block, a.kept)}
        st = timed_round_robin(fns, a.reps, clock, plain if a.after_plain else None)
        size = model.draft_head.size if model.draft_head is not None else "full"
        rows.append({"vocab": size, "kept": a.kept, **{k: 1e3 * v for k, v in st.items()}})
    cols = ["embed", "layers", "append", "layers+kept", "head", "selector", "before", "drafter"]
    print(f"{'vocab':>6} {'plain':>7}" + "".join(f" {c:>11}" for c in cols) + "  share before/now")
    for r in rows:
        print(
            f"{r['vocab']!s:>6} {r['plain']:7.2f}"
            + "".join(f" {r[c]:11.2f}" for c in cols)
            + f"  {r['before'] / r['plain']:6.1%} {r['drafter'] / r['plain']:6.1%}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
