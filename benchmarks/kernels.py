"""Dispatches and time per draft cycle of the two-tap conv and the path selector.

Kernel (one ``mx.fast.metal_kernel`` launch each) vs the pure-MLX reference, at the
Qwen3.8-27B drafter shapes (H 5120, R 256, K 16, V 248320, 5 layers, block 8 and 16). One
cycle = 4 conv sides per layer (attention and MLP, before and after) times the layers, plus
one selector call on the block's B - 1 draft rows.

Dispatch counts of the reference are counted from its lazily built graph
(``mx.export_to_dot``): "nodes" is every primitive, "kernels" leaves out the view-only ones
(Broadcast, ExpandDims, Squeeze, Slice, Reshape, Transpose), an estimate of the GPU launches
(a Reshape of a broadcast can still copy; Pad is a fill plus a copy). The fused path is one
launch per call by construction, plus one copy per input that is not row-contiguous.

Runs anywhere. On a Metal GPU it times both paths; elsewhere it times the reference on the
default device and checks the kernel bodies through the g++ emulation in tests/metal_emu at
the same shapes (codebooks compacted to the rows the call touches, ids remapped: the kernel
only gathers rows, so that is the same computation on less memory).

    python benchmarks/kernels.py [--blocks 8 16] [--batch 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import io
import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import mlx.core as mx

from dflash_mlx.model import conv, metal_kernel, selector
from dflash_mlx.model.conv import two_tap_conv_ops as conv_reference
from dflash_mlx.model.selector import select_path_ops as select_reference

VIEW_PRIMITIVES = {"Broadcast", "ExpandDims", "Squeeze", "Slice", "Reshape", "Transpose"}
DTYPES = {"bf16": mx.bfloat16, "fp16": mx.float16, "fp32": mx.float32}


def graph_dispatches(outputs: list[mx.array]) -> dict[str, int]:
    """Primitive nodes in the unevaluated graph of ``outputs`` and the non-view subset."""
    buf = io.StringIO()
    mx.export_to_dot(buf, *[o for o in outputs if o is not None])
    labels = re.findall(r'label ="([A-Za-z]+)', buf.getvalue())
    return {"nodes": len(labels), "kernels": sum(l not in VIEW_PRIMITIVES for l in labels)}


def time_call(fn: Callable[[], list[mx.array]], iters: int, warmup: int = 2) -> float:
    """Median seconds of ``fn`` including evaluation of its outputs."""
    for _ in range(warmup):
        mx.eval(*[o for o in fn() if o is not None])
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        mx.eval(*[o for o in fn() if o is not None])
        mx.synchronize()
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples))


def make_inputs(args, block: int, A: mx.array, Bc: mx.array, seed: int = 0) -> dict:
    """Random inputs of one cycle: conv [batch, block, H], selector rows block - 1."""
    mx.random.seed(seed)
    dt, H, G = DTYPES[args.dtype], args.hidden, args.hidden // args.group
    Bsz, L, K, R, V = args.batch, block - 1, args.topk, args.rank, args.vocab
    conv = {
        "x": mx.random.normal((Bsz, block, H)).astype(dt),  # [B, block, H]
        "base": mx.random.normal((2, H)).astype(dt),  # [taps, H]
        "dyn": (0.1 * mx.random.normal((Bsz, block, 2, G))).astype(dt),  # [B, block, taps, G]
    }
    sel = {
        "U": 4.0 * mx.random.normal((Bsz, L, K)),  # [B, L, K] float32
        "cand": mx.random.randint(0, V, (Bsz, L, K)).astype(mx.uint32),  # [B, L, K]
        "anchor": mx.random.randint(0, V, (Bsz,)).astype(mx.uint32),  # [B]
        "g": mx.random.normal((Bsz, L, R)).astype(dt),  # [B, L, R]
        "A": A,
        "B": Bc,
    }
    uniforms = mx.random.uniform(shape=(Bsz, L))  # [B, L]
    mx.eval(conv, sel, uniforms)
    return {"conv": conv, "sel": sel, "uniforms": uniforms}


def compact_codebooks(sel: dict) -> dict:
    """Same selection with A, B cut to the rows it touches and ids remapped ([n, R])."""
    ids = np.concatenate([np.array(sel["anchor"]).ravel(), np.array(sel["cand"]).ravel()])
    uniq, inv = np.unique(ids, return_inverse=True)
    rows = mx.array(uniq.astype(np.uint32))
    n_anchor = sel["anchor"].size
    out = dict(sel, A=sel["A"][rows], B=sel["B"][rows])
    out["anchor"] = mx.array(inv[:n_anchor].astype(np.uint32)).reshape(sel["anchor"].shape)
    out["cand"] = mx.array(inv[n_anchor:].astype(np.uint32)).reshape(sel["cand"].shape)
    return out


def emulated_check(inp: dict, block: int) -> dict[str, object]:
    """Run the kernel bodies through g++ at these shapes and compare with the reference."""
    from metal_emu.emulator import EmulatedKernel, compiler

    if compiler() is None:
        return {"emulated": "skipped: no C++ compiler"}
    c, s, u = inp["conv"], compact_codebooks(inp["sel"]), inp["uniforms"]
    out = conv.two_tap_conv_kernel(
        metal_kernel.build(conv.KERNEL, EmulatedKernel), c["x"], c["base"], c["dyn"], block
    )
    ref = conv_reference(c["x"], c["base"], c["dyn"], block)
    diff = (out.astype(mx.float32) - ref.astype(mx.float32)).abs()
    sk = metal_kernel.build(selector.KERNEL, EmulatedKernel)
    args = (s["U"], s["cand"], s["anchor"], s["g"], s["A"], s["B"])
    pg, _ = selector.select_path_kernel(sk, *args)
    ps, qs = selector.select_path_kernel(sk, *args, 1.0, u)
    rg, _ = select_reference(*inp["sel"].values())
    rs, rq = select_reference(*inp["sel"].values(), 1.0, u)
    return {
        "conv_max_abs_diff": float(diff.max()),
        "conv_bit_identical_frac": float(mx.mean(out == ref)),
        "greedy_path_equal": bool(mx.array_equal(pg, rg)),
        "sampled_path_equal": bool(mx.array_equal(ps, rs)),
        "sampled_q_max_abs_diff": float((qs - rq).abs().max()),
    }


def bench_block(args, block: int, A: mx.array, Bc: mx.array) -> list[dict]:
    """Rows of the result table for one block size."""
    inp = make_inputs(args, block, A, Bc, seed=block)
    c, s, u = inp["conv"], inp["sel"], inp["uniforms"]
    sides = 4 * args.layers
    metal = metal_kernel.use_metal()
    conv_ref = lambda: [conv_reference(c["x"], c["base"], c["dyn"], block) for _ in range(sides)]
    greedy_ref = lambda: list(select_reference(*s.values()))
    sampled_ref = lambda: list(select_reference(*s.values(), 1.0, u))
    rows = []
    for name, fn, calls in (
        ("conv", conv_ref, sides),
        ("selector T=0", greedy_ref, 1),
        ("selector T=1", sampled_ref, 1),
    ):
        graph = graph_dispatches(fn()[:1])  # one call's graph
        rows.append(
            {
                "block": block,
                "op": name,
                "path": "reference",
                "calls": calls,
                "nodes": graph["nodes"] * calls,
                "dispatches": graph["kernels"] * calls,
                "ms": 1e3 * time_call(fn, args.iters),
            }
        )
    if metal:
        ck, sk = metal_kernel.cached(conv.KERNEL), metal_kernel.cached(selector.KERNEL)
        fused = {
            "conv": lambda: [
                conv.two_tap_conv_kernel(ck, c["x"], c["base"], c["dyn"], block)
                for _ in range(sides)
            ],
            "selector T=0": lambda: list(selector.select_path_kernel(sk, *s.values())),
            "selector T=1": lambda: list(selector.select_path_kernel(sk, *s.values(), 1.0, u)),
        }
        for name, fn in fused.items():
            calls = sides if name == "conv" else 1
            rows.append(
                {
                    "block": block,
                    "op": name,
                    "path": "kernel",
                    "calls": calls,
                    "nodes": calls,
                    "dispatches": calls,
                    "ms": 1e3 * time_call(fn, args.iters),
                }
            )
    else:
        for name in ("conv", "selector T=0", "selector T=1"):
            calls = sides if name == "conv" else 1
            rows.append(
                {
                    "block": block,
                    "op": name,
                    "path": "kernel",
                    "calls": calls,
                    "nodes": calls,
                    "dispatches": calls,
                    "ms": None,
                }
            )
    if not args.no_emulate and not metal:
        rows.append(
            {
                "block": block,
                "op": "emulated check",
                "path": "kernel (g++)",
                "check": emulated_check(inp, block),
            }
        )
    return rows


def print_table(rows: list[dict], device: str) -> None:
    """Plain-text table of the timing rows, then the emulation checks."""
    print(
        f"device: {device}  (times are medians per cycle; kernel dispatches exact, "
        f"reference dispatches counted from the graph)"
    )
    head = f"{'block':>5}  {'op':<13} {'path':<10} {'calls':>5} {'nodes':>6} {'disp.':>6} {'ms':>9}"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        if "check" in r:
            continue
        ms = "n/a" if r["ms"] is None else f"{r['ms']:.3f}"
        print(
            f"{r['block']:>5}  {r['op']:<13} {r['path']:<10} {r['calls']:>5} "
            f"{r['nodes']:>6} {r['dispatches']:>6} {ms:>9}"
        )
    for block in sorted({r["block"] for r in rows}):
        per = {(r["op"], r["path"]): r for r in rows if r["block"] == block and "check" not in r}
        for path in ("reference", "kernel"):
            conv, sel = per[("conv", path)], per[("selector T=0", path)]
            ms = None if conv["ms"] is None else conv["ms"] + sel["ms"]
            print(
                f"block {block} {path:>9}: conv + selector (T=0) per cycle: "
                f"{conv['dispatches'] + sel['dispatches']} dispatches, "
                + ("time n/a (no Metal)" if ms is None else f"{ms:.3f} ms")
            )
    for r in rows:
        if "check" in r:
            print(f"block {r['block']}: emulated kernels vs reference: {r['check']}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, nargs="+", default=[8, 16])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hidden", type=int, default=5120)
    p.add_argument("--group", type=int, default=16, help="conv_group_size (G = H / group)")
    p.add_argument("--rank", type=int, default=256)
    p.add_argument("--topk", type=int, default=16)
    p.add_argument("--vocab", type=int, default=248320)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--no-emulate", action="store_true", help="skip the g++ kernel check")
    p.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = p.parse_args(argv)

    dt = DTYPES[args.dtype]
    # codebooks [V, R] in the checkpoint dtype (bf16: 2 x 127 MB at the 27B shapes)
    A = (0.05 * mx.random.normal((args.vocab, args.rank))).astype(dt)
    Bc = (0.05 * mx.random.normal((args.vocab, args.rank))).astype(dt)
    mx.eval(A, Bc)
    rows = []
    for block in args.blocks:
        rows += bench_block(args, block, A, Bc)
    device = f"{mx.default_device()} (metal: {metal_kernel.use_metal()})"
    print_table(rows, device)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "device": device,
                    "args": {
                        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                    },
                    "rows": rows,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
