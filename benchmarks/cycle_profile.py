"""Per-cycle time split of DFlash decoding (docs/algorithm.md §5) on tiny or given models.

    python benchmarks/cycle_profile.py                      # tiny random qwen3 + qwen3_5 pairs
    python benchmarks/cycle_profile.py --model demo         # the shipped demo pair
    python benchmarks/cycle_profile.py --model T --drafter D --json out.json
    python benchmarks/cycle_profile.py --model demo --block-size 8 --append both --rounds 3

``--append both`` runs each set-up with the kept rows' K/V projected in the next draft's pass
(``now``, the CPU backend's way) and right after the verify (``eager``, as before and as on a
Mac), alternating for ``--rounds``, and prints the median of each: the drafter stage counts
the append either way.

Stages are timed by evaluating at stage boundaries (profile mode), so the split shows where a
cycle's work goes; the conv share is measured by timing the drafter's conv calls alone on the
same shapes. "host" is wall time not inside any stage.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from dflash_mlx.bench.runner import STAGES, conv_seconds


def profile(model, tok, prompt, max_tokens, block, selector):
    from dflash_mlx import stream_generate

    t0, first, last = None, None, None
    for r in stream_generate(
        model,
        tok,
        prompt,
        max_tokens=max_tokens,
        block_size=block,
        use_selector=selector,
        raw=True,
        profile=True,
    ):
        if first is None:
            first, t0 = r, time.perf_counter()
        last = r
    wall = time.perf_counter() - t0
    cycles = max(last.cycles, 1)
    per = {k: v / cycles for k, v in last.timings.items() if k != "prefill"}
    per["conv"] = min(conv_seconds(model.drafter, block), per.get("drafter", 0.0))
    per["drafter"] = per.get("drafter", 0.0) - per["conv"]
    total = wall / cycles
    per["host"] = max(total - sum(per.values()), 0.0)
    return {
        "cycle_ms": 1e3 * total,
        "tau": last.tau,
        "cycles": last.cycles,
        "tokens": last.generation_tokens,
        "share": {k: per.get(k, 0.0) / total for k in STAGES},
        "ms": {k: 1e3 * per.get(k, 0.0) for k in STAGES},
    }


def modes(choice: str) -> list[str]:
    return ["now", "eager"] if choice == "both" else [choice]


@contextlib.contextmanager
def append_mode(mode: str):
    """``eager``: the kept rows' K/V projected right after the verify (plain MLX's
    ``ops.append_context``) instead of in the next draft's pass."""
    from dflash_mlx import ops

    saved = ops.append_context
    if mode == "eager":
        ops.append_context = ops._DEFAULTS["append_context"]
    try:
        yield
    finally:
        ops.append_context = saved


def median_run(runs: list[dict]) -> dict:
    """The run whose cycle time is the median of ``runs`` (its split kept whole)."""
    return sorted(runs, key=lambda r: r["cycle_ms"])[len(runs) // 2] | {"rounds": len(runs)}


def tiny_pairs(root: Path):
    from tiny_models import build_drafter, build_target

    out = []
    for kind in ("qwen3", "qwen3_5"):
        build_target(root / kind, kind, hidden=256, layers=4)
        build_drafter(
            root / f"d_{kind}",
            root / kind,
            dflash2=True,
            block_size=16,
            num_hidden_layers=2,
            selector_rank=64,
        )
        out.append((f"tiny-{kind}", root / kind, root / f"d_{kind}"))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--drafter")
    ap.add_argument("--prompt", default="def parse_args(argv):\n    parser = ")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--block-size", type=int, nargs="*", default=[4, 8, 16])
    ap.add_argument("--append", choices=["now", "eager", "both"], default="now")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from dflash_mlx import load

    tmp = tempfile.TemporaryDirectory()
    if args.model:
        model, tok = load(args.model, drafter=args.drafter)
        pairs = [(args.model, model, tok)]
    else:
        pairs = [(n, *load(str(t), drafter=str(d))) for n, t, d in tiny_pairs(Path(tmp.name))]
    rows = []
    for name, model, tok in pairs:
        for block in args.block_size:
            if block > model.block_size:
                continue
            for sel in [True, False] if model.drafter.has_selector else [False]:
                runs = {m: [] for m in modes(args.append)}
                for _ in range(args.rounds):
                    for mode, got in runs.items():
                        with append_mode(mode):
                            got.append(
                                profile(model, tok, args.prompt, args.max_tokens, block, sel)
                            )
                for mode, res in runs.items():
                    rows.append(
                        {"model": name, "block": block, "selector": sel, "append": mode}
                        | median_run(res)
                    )
    head = f"{'model':<14}{'blk':>4}{'sel':>5}{'append':>7}{'cycle ms':>10}{'tau':>6}" + "".join(
        f"{s:>11}" for s in STAGES
    )
    print(head)
    for r in rows:
        print(
            f"{r['model']:<14}{r['block']:>4}{'on' if r['selector'] else 'off':>5}"
            f"{r['append']:>7}{r['cycle_ms']:>10.2f}{r['tau']:>6.2f}"
            + "".join(f"{100 * r['share'][s]:>10.1f}%" for s in STAGES)
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
