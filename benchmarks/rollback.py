"""What rolling a hybrid target back after a verify costs (docs/algorithm.md §4.4.1): the
verify's tape (only the recurrence over the kept steps) against replaying the mixers.

    python benchmarks/rollback.py                    # a tiny random qwen3_5 pair
    python benchmarks/rollback.py --model T --drafter D --json out.json

Per mode, in one process and alternating: the rollback alone (graph built on the host, then
evaluated; the verify before it evaluated apart), median of ``--reps`` cycles with the same
kept counts; the graph's op count (MLX primitives, a compiled function counts as one); and
real decoding cycles (a random drafter: nearly every cycle keeps one token and rolls back)
whose share the rollback is.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import dflash_mlx  # noqa: F401  (loads the system BLAS before mlx)

# isort: split
import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

MODES = ("replay", "tape")


def set_mode(adapter, mode: str) -> None:
    """Tape the known mixers (mode 'tape') or replay every mixer (mode 'replay')."""
    from dflash_mlx.model import tape

    for r in adapter.recorders:
        if r is not None:
            object.__setattr__(r, "_taped", mode == "tape" and tape.known(r.inner))


def ops_in(arrays) -> int:
    """MLX primitives in the unevaluated graph behind arrays."""
    f = io.StringIO()
    mx.export_to_dot(f, *arrays)
    return f.getvalue().count("shape=rectangle")


def rollback_costs(model, prompt: list[int], block: int, reps: int) -> dict:
    """Per mode: median seconds to build and to evaluate one rollback, and its op count."""
    adapter = model.adapter
    cache = model.make_cache()
    adapter(mx.array(prompt)[None], cache.target)
    mx.eval([c.state for c in cache.target])
    rng = random.Random(0)
    keeps = [rng.randint(1, block - 1) for _ in range(reps)]
    out = {m: {"build": [], "eval": [], "ops": 0} for m in MODES}
    for keep in keeps:
        ids = mx.array([rng.randrange(adapter.vocab_size) for _ in range(block)])[None]
        for mode in MODES:
            set_mode(adapter, mode)
            snap = adapter.snapshot(cache.target)
            mx.eval(adapter(ids, cache.target))
            t0 = time.perf_counter()
            adapter.rollback(cache.target, block, keep, snap)
            states = [x for c in cache.target if isinstance(c, ArraysCache) for x in c.cache]
            t1 = time.perf_counter()
            out[mode]["ops"] = max(out[mode]["ops"], ops_in(states))
            t2 = time.perf_counter()
            mx.eval(states)
            t3 = time.perf_counter()
            out[mode]["build"].append(t1 - t0)
            out[mode]["eval"].append(t3 - t2)
            for c, s in zip(cache.target, snap):  # back to the prompt for the next run
                if isinstance(c, ArraysCache):
                    c.cache = list(s)
                else:
                    c.trim(c.offset - len(prompt))
    return {
        m: {
            "build_ms": 1e3 * statistics.median(v["build"]),
            "eval_ms": 1e3 * statistics.median(v["eval"]),
            "ms": 1e3 * statistics.median(b + e for b, e in zip(v["build"], v["eval"])),
            "ops": v["ops"],
        }
        for m, v in out.items()
    }


def cycle_ms(model, tok, prompt: str, block: int, tokens: int, rounds: int) -> dict:
    """Per mode: median wall milliseconds of a decoding cycle (after the prefill)."""
    from dflash_mlx import stream_generate

    times = {m: [] for m in MODES}
    for _ in range(rounds):
        for mode in MODES:
            set_mode(model.adapter, mode)
            t0 = last = None
            for r in stream_generate(
                model, tok, prompt, max_tokens=tokens, block_size=block, raw=True
            ):
                t0 = t0 or time.perf_counter()
                last = r
            times[mode].append(1e3 * (time.perf_counter() - t0) / max(last.cycles - 1, 1))
    return {m: statistics.median(v) for m, v in times.items()}


def accepted_share(model, tok, prompt: str, block: int, tokens: int, accepts) -> dict:
    """Rollback's share of profiled decoding cycles whose drafts are accepted ``accepts``
    of ``block - 1`` in turn (e.g. 5 then 7 of 7). The drafter runs as usual (its cost is
    in the cycle) but its drafts are replaced by the target's own greedy continuation, cut
    wrong after ``accept`` tokens: the verify, the acceptance and the rollback are real."""
    from mlx_lm.generate import generate_step

    from dflash_mlx.decoding import steps
    from dflash_mlx.decoding.acceptance import SamplingParams
    from dflash_mlx.decoding.loop import DecodeOptions, decode

    ids = tok.encode(prompt)
    cont = [
        int(t) for t, _ in generate_step(mx.array(ids), model.target, max_tokens=tokens + 8 * block)
    ]
    real, turn = steps._draft, [0]

    def oracle(model_, cache, params, anchor, chain, n_sib, key, clock, selector=True):
        drafts, _q, _s = real(model_, cache, params, anchor, chain, n_sib, key, clock, selector)
        at = len(cache.tokens) - len(ids) + 1  # the anchor is cont[at - 1]
        want = cont[at : at + chain - 1]
        n = accepts[turn[0] % len(accepts)]
        turn[0] += 1
        if n < len(want):
            want[n] = (want[n] + 1) % model_.adapter.vocab_size  # rejected from here on
        mx.eval(drafts)  # the drafter's work is done and timed, then set aside
        return mx.array(want, dtype=mx.uint32), None, None

    steps._draft = oracle
    try:
        opts = DecodeOptions(max_tokens=tokens, block_size=block, profile=True, lookup=False)
        split, t0, kept = {}, None, []
        for c in decode(model, ids, model.make_cache(), SamplingParams(0.0), opts):
            if t0 is None:
                t0 = time.perf_counter()
                continue
            kept.append(c.accepted)
            for k, v in c.timings.items():
                split[k] = split.get(k, 0.0) + v
        total = time.perf_counter() - t0
    finally:
        steps._draft = real
    return {
        "share": split.get("rollback", 0.0) / total,
        "cycle_ms": 1e3 * total / len(kept),
        "rollback_ms": 1e3 * split.get("rollback", 0.0) / len(kept),
        "accepted": sorted(set(kept)),
    }


def tiny_pair(root: Path):
    from tiny_models import build_drafter, build_target

    build_target(root / "t", "qwen3_5", hidden=256, layers=8)
    build_drafter(root / "d", root / "t", dflash2=True, block_size=16, selector_rank=64)
    return root / "t", root / "d"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--drafter")
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument(
        "--accept",
        default=None,
        help="e.g. 5,7: instead, the rollback's share of profiled cycles accepting 5 then 7 "
        "drafts (the tape mode; median of --rounds runs)",
    )
    ap.add_argument(
        "--no-record", action="store_true", help="with --accept: the verify keeps no states"
    )
    args = ap.parse_args(argv)
    from dflash_mlx import load

    tmp = tempfile.TemporaryDirectory()
    t, d = (args.model, args.drafter) if args.model else tiny_pair(Path(tmp.name))
    model, tok = load(str(t), drafter=None if d is None else str(d))
    if not model.adapter.is_hybrid:
        raise SystemExit("error: the target has no recurrent layers; pass a qwen3_5 target")
    text = "def parse_args(argv):\n    parser = argparse.ArgumentParser()\n" * 4
    if args.accept:
        return _accepted(model, tok, text, args)
    costs = rollback_costs(model, tok.encode(text), args.block, args.reps)
    cycles = cycle_ms(model, tok, text, args.block, args.tokens, args.rounds)
    rows = []
    print(
        f"{'mode':<8}{'rollback ms':>13}{'build ms':>10}{'eval ms':>9}{'ops':>6}"
        f"{'cycle ms':>10}{'share':>8}"
    )
    for m in MODES:
        share = costs[m]["ms"] / cycles[m]
        rows.append(
            {
                "mode": m,
                "block": args.block,
                **costs[m],
                "cycle_ms": cycles[m],
                "share": share,
                "device": str(mx.default_device()),
            }
        )
        c = costs[m]
        print(
            f"{m:<8}{c['ms']:>13.3f}{c['build_ms']:>10.3f}{c['eval_ms']:>9.3f}{c['ops']:>6}"
            f"{cycles[m]:>10.2f}{100 * share:>7.1f}%"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return rows


def _accepted(model, tok, text, args) -> list:
    from dflash_mlx.model import tape

    accepts = [int(a) for a in args.accept.split(",")]
    set_mode(model.adapter, "tape")
    if args.no_record:
        tape.RECORD_BYTES = 0  # the rewind runs the recurrence again over the kept steps
    runs = [
        accepted_share(model, tok, text, args.block, args.tokens, accepts)
        for _ in range(args.rounds)
    ]
    runs.sort(key=lambda r: r["share"])
    med = runs[len(runs) // 2]
    print(f"accepted per cycle {med['accepted']}; rollback share per run (sorted):")
    for r in runs:
        print(
            f"  {100 * r['share']:.2f}%  (rollback {r['rollback_ms']:.3f} ms of a "
            f"{r['cycle_ms']:.2f} ms cycle)"
        )
    print(f"median {100 * med['share']:.2f}%")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=2))
    return runs


if __name__ == "__main__":
    main()
