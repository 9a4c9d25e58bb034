"""What a verify costs on a mixture-of-experts target, with mlx-lm's experts and with the
grouped ones (``dflash_mlx/model/moe.py``), and what speculation gains there.

    python benchmarks/moe.py                          # 128 experts, top 8, float32
    python benchmarks/moe.py --experts 32 --top-k 4   # gpt-oss-20b's routing
    python benchmarks/moe.py --bits 4 --json out.json # experts quantized to 4 bits

A random ``qwen3_moe`` target sized for 2 CPU cores (``--hidden``, ``--expert-dim``,
``--layers``). In one process, alternating the two paths (``DFLASH_MOE_GROUPED``):

Times are CPU time of this process (all its threads), not wall time: on a machine shared
with other jobs wall time is mostly waiting for a core, while CPU time only grows with
what the other jobs do to the caches. On a dedicated machine the two agree up to the
threads' overlap.

- per verify width 1..16: the CPU milliseconds of one target forward of that many rows after a
  ``--context``-token prompt (the caches trimmed back after each; the best of ``--reps``,
  alternating the paths forward by forward, and the median), and the distinct
  experts it read per layer against the pairs (rows x top-k) mlx-lm multiplies one by one;
- oracle decoding: block ``--block`` cycles whose drafts are the target's own greedy
  continuation, cut wrong after 2, 4 and 6 tokens (as ``rollback.py`` does; the drafter
  still runs and is timed), in tokens per second against plain decoding (mlx-lm's
  ``generate_step``), per path.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import dflash_mlx  # loads the system BLAS before mlx

# isort: split
import mlx.core as mx
import numpy as np

PATHS = {"mlx_lm": "0", "grouped": "1"}  # DFLASH_MOE_GROUPED per path


def build(args, root: Path):
    """The random MoE target (and a random drafter) written to ``root``, loaded."""
    from mlx import nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model, save_config
    from tiny_models import build_drafter, build_target

    kw = {"experts": args.experts, "top_k": args.top_k, "expert_dim": args.expert_dim}
    build_target(root / "t", "qwen3_moe", hidden=args.hidden, layers=args.layers, **kw)
    if args.bits:
        model, cfg = load_model(root / "t")
        nn.quantize(model, group_size=64, bits=args.bits)
        cfg["quantization"] = {"group_size": 64, "bits": args.bits}
        weights = dict(tree_flatten(model.parameters()))
        mx.save_safetensors(str(root / "t" / "model.safetensors"), weights)
        save_config(cfg, root / "t" / "config.json")
    build_drafter(root / "d", root / "t", block_size=16)
    return dflash_mlx.load(str(root / "t"), drafter=str(root / "d"))


def _forward_ms(adapter, cache, ids) -> float:
    """CPU ms (this process's threads) of one evaluated forward of ids [1, n]; the caches
    trimmed back after it. CPU time, not wall time: on a machine shared with other jobs a
    forward's wall time is mostly waiting for a core."""
    t = time.process_time()
    logits, feats = adapter(ids, cache)
    mx.eval(logits, feats)
    ms = 1e3 * (time.process_time() - t)
    for c in cache:
        c.trim(ids.shape[1])
    return ms


def verify_table(model, context: int, reps: int, widths) -> list[dict]:
    """Per width: ms per path (alternating forward by forward: the best of ``reps``, which
    other processes can only lengthen, and the median), the distinct experts per layer."""
    adapter, rng = model.adapter, np.random.default_rng(0)
    vocab = adapter.vocab_size
    cache = model.make_cache().target
    mx.eval(adapter(mx.array(rng.integers(0, vocab, context))[None], cache, last=True))
    count, k = adapter.experts, adapter.experts.top_k
    rows = []
    for w in widths:
        ids = mx.array(rng.integers(0, vocab, w))[None]
        ms = {p: [] for p in PATHS}
        for _ in range(reps + 1):  # the first round warms both paths up
            for p, flag in PATHS.items():
                os.environ["DFLASH_MOE_GROUPED"] = flag
                ms[p].append(_forward_ms(adapter, cache, ids))
        count.reset()
        _forward_ms(adapter, cache, ids)
        got = count.summary()
        count.reset(on=False)
        row = {"rows": w, "pairs": w * k, "experts": got["per_verify"] or got["per_plain_step"]}
        for p, v in ms.items():
            row |= {f"{p}_ms": round(min(v[1:]), 2), f"{p}_median_ms": round(statistics.median(v[1:]), 2)}  # fmt: skip
        row["speedup"] = round(row["mlx_lm_ms"] / row["grouped_ms"], 3)
        row["median_speedup"] = round(row["mlx_lm_median_ms"] / row["grouped_median_ms"], 3)
        rows.append(row)
    return rows


def experts_table(model, reps: int, widths) -> list[dict]:
    """Per width: CPU ms of every MoE layer's routed experts alone (the best of ``reps``,
    alternating mlx-lm's module and ``moe.grouped`` call by call), on the routing the
    target's own routers give random rows; and whether the two outputs are the same bits."""
    from dflash_mlx.model.moe import grouped

    layers = [x.inner if hasattr(x, "inner") else x for x in model.adapter.inner.layers]
    blocks = [(x.mlp.gate, x.mlp.switch_mlp.inner) for x in layers]
    k, hidden = model.adapter.experts.top_k, model.adapter.hidden_size
    rows = []
    for w in widths:
        x = mx.random.normal((1, w, hidden), key=mx.random.key(w))
        routes = [mx.argpartition(g(x), kth=-k, axis=-1)[..., -k:] for g, _ in blocks]
        mx.eval(x, routes)
        paths = {"mlx_lm": lambda m, x, i: m(x, i), "grouped": grouped}
        ms = {p: [] for p in paths}
        for _ in range(reps + 1):
            for p, fn in paths.items():
                t = time.process_time()
                mx.eval([fn(m, x, i) for (_, m), i in zip(blocks, routes)])
                ms[p].append(1e3 * (time.process_time() - t))
        same = all(mx.array_equal(m(x, i), grouped(m, x, i)).item() for (_, m), i in zip(blocks, routes))  # fmt: skip
        row = {"rows": w, "same_bits": same}
        row |= {f"{p}_ms": round(min(v[1:]), 3) for p, v in ms.items()}
        row["speedup"] = round(row["mlx_lm_ms"] / row["grouped_ms"], 3)
        rows.append(row)
    return rows


def _continuation(model, ids: list[int], n: int) -> list[int]:
    from mlx_lm.generate import generate_step

    return [int(t) for t, _ in generate_step(mx.array(ids), model.target, max_tokens=n)]


def _plain_tps(model, ids: list[int], n: int) -> float:
    """mlx-lm's plain greedy decoding: tokens per CPU second after the first."""
    from mlx_lm.generate import generate_step

    t0, got = None, 0
    for _ in generate_step(mx.array(ids), model.target, max_tokens=n):
        t0 = t0 or time.process_time()
        got += 1
    return (got - 1) / (time.process_time() - t0)


def _oracle_tps(model, ids, cont, block: int, accept: int, n: int) -> tuple[float, float]:
    """(tokens per CPU second, tokens per cycle) decoding with the target's own continuation
    as drafts, cut wrong after ``accept`` of them."""
    from dflash_mlx.decoding import steps
    from dflash_mlx.decoding.acceptance import SamplingParams
    from dflash_mlx.decoding.loop import DecodeOptions, decode

    real = steps._draft

    def oracle(model_, cache, params, anchor, chain, n_sib, key, clock, selector=True):
        drafts, _q, _s = real(model_, cache, params, anchor, chain, n_sib, key, clock, selector)
        at = len(cache.tokens) - len(ids) + 1  # the anchor is cont[at - 1]
        want = cont[at : at + chain - 1]
        if accept < len(want):
            want[accept] = (want[accept] + 1) % model_.adapter.vocab_size
        mx.eval(drafts)  # the drafter's work is done and timed, then set aside
        return mx.array(want, dtype=mx.uint32), None, None

    steps._draft = oracle
    try:
        opts = DecodeOptions(max_tokens=n, block_size=block, lookup=False, tree=False)
        t0, got, cycles = None, 0, 0
        for c in decode(model, ids, model.make_cache(), SamplingParams(0.0), opts):
            if t0 is None:
                t0 = time.process_time()
                continue
            got, cycles = got + len(c.tokens), cycles + 1
    finally:
        steps._draft = real
    return got / (time.process_time() - t0), got / max(cycles, 1)


def oracle_table(model, context: int, block: int, tokens: int, accepts) -> dict:
    """Plain decoding's tokens per second, and per accepted count and path the oracle
    decode's tokens per second, tokens per cycle and speed-up (alternating, best of 3)."""
    rng = np.random.default_rng(1)
    ids = [int(t) for t in rng.integers(0, model.adapter.vocab_size, context)]
    cont = _continuation(model, ids, tokens + 2 * block)
    plain, runs = [], {(a, p): [] for a in accepts for p in PATHS}
    for _ in range(3):
        plain.append(_plain_tps(model, ids, tokens))
        for a in accepts:
            for p, flag in PATHS.items():
                os.environ["DFLASH_MOE_GROUPED"] = flag
                runs[a, p].append(_oracle_tps(model, ids, cont, block, a, tokens))
    base = max(plain)  # the best of 3 rounds each: other processes only slow a run down
    rows = []
    for a in accepts:
        row = {"accepted": a, "tokens_per_cycle": round(runs[a, "mlx_lm"][0][1], 2)}
        for p in PATHS:
            tps = max(t for t, _ in runs[a, p])
            row |= {f"{p}_tok_s": round(tps, 2), f"{p}_speedup": round(tps / base, 3)}
        rows.append(row)
    return {"plain_tok_s": round(base, 2), "block": block, "rows": rows}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--expert-dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--bits", type=int, default=0, help="quantize the target (0: float32)")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--widths", default="1-16", help="'1-16' or a list '1,2,4,8'")
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--accepts", default="2,4,6")
    ap.add_argument("--json", dest="json_path")
    args = ap.parse_args(argv)
    a, _, b = args.widths.partition("-")
    widths = range(int(a), int(b) + 1) if b else [int(w) for w in args.widths.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model, _ = build(args, Path(tmp))
        t0 = time.time()
        rep = {"config": {k: v for k, v in vars(args).items() if k != "json_path"}}
        rep["experts"] = experts_table(model, 3 * args.reps, widths)
        rep["verify"] = verify_table(model, args.context, args.reps, widths)
        accepts = [int(x) for x in args.accepts.split(",")]
        rep["oracle"] = oracle_table(model, args.context, args.block, args.tokens, accepts)
        rep["seconds"] = round(time.time() - t0, 1)
    rep["load_average"] = os.getloadavg()[0]
    print_tables(rep)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(rep, indent=1))
    return rep


def print_tables(rep: dict) -> None:
    c = rep["config"]
    print(
        f"qwen3_moe: {c['experts']} experts, top {c['top_k']}, hidden {c['hidden']}, "
        f"expert width {c['expert_dim']}, {c['layers']} layers, "
        f"{'float32' if not c['bits'] else str(c['bits']) + '-bit'}; load {rep['load_average']:.1f}"
    )
    print("rows | pairs | experts read | mlx-lm CPU ms | grouped CPU ms | speed-up (of medians)")
    for r in rep["verify"]:
        print(
            f"{r['rows']:4d} | {r['pairs']:5d} | {r['experts']:12.1f} | {r['mlx_lm_ms']:9.2f} | "
            f"{r['grouped_ms']:10.2f} | {r['speedup']:.2f}x ({r['median_speedup']:.2f}x)"
        )
    print("experts alone: rows | mlx-lm CPU ms | grouped CPU ms | speed-up | same bits")
    for r in rep["experts"]:
        print(
            f"{r['rows']:4d} | {r['mlx_lm_ms']:8.3f} | {r['grouped_ms']:8.3f} | "
            f"{r['speedup']:.2f}x | {r['same_bits']}"
        )
    o = rep["oracle"]
    print(f"oracle drafts, block {o['block']}; plain decoding {o['plain_tok_s']:.2f} tok/CPU s")
    print("accepted | tokens/cycle | mlx-lm tok/CPU s (x plain) | grouped tok/CPU s (x plain)")
    for r in o["rows"]:
        print(
            f"{r['accepted']:8d} | {r['tokens_per_cycle']:12.2f} | "
            f"{r['mlx_lm_tok_s']:8.2f} ({r['mlx_lm_speedup']:.2f}x) | "
            f"{r['grouped_tok_s']:8.2f} ({r['grouped_speedup']:.2f}x)"
        )


if __name__ == "__main__":
    main()
