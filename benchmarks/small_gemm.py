"""Few-row float32 matmuls on MLX's CPU backend: OpenBLAS alone against the dflash kernel
in front of it (dflash_mlx/small_gemm.py), alternating in one process.

    python benchmarks/small_gemm.py [--rows 1,2,4,8,16] [--reps 15] [--json out.json]

The shapes are the demo target's (SmolLM2-135M: hidden 576, MLP 1536, vocabulary 49,152) and
the drafter's 8,192-id head. Prints a table of median milliseconds and the ratio.
"""

import argparse
import json

from dflash_mlx.cpu import small_gemm  # first: loads OpenBLAS and the kernel before MLX
from dflash_mlx.cpu.blas import _median_ms

SHAPES = [
    ("q/o 576->576", 576, 576),
    ("k/v 576->192", 576, 192),
    ("gate/up 576->1536", 576, 1536),
    ("down 1536->576", 1536, 576),
    ("draft head 576->8192", 576, 8192),
    ("lm head 576->49152", 576, 49152),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,9,16")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not small_gemm.status()["active"]:
        raise SystemExit(f"error: the kernel is not active: {small_gemm.status()['error']}")
    import mlx.core as mx

    rows = [int(r) for r in args.rows.split(",")]
    out = []
    print(f"{'shape':22} {'rows':>4} {'OpenBLAS ms':>12} {'kernel ms':>10} {'ratio':>6}")
    for name, k, n in SHAPES:
        w = mx.random.normal((n, k))
        for m in rows:
            x = mx.random.normal((m, k))
            mx.eval(w, x)
            times = {"openblas": [], "kernel": []}
            for _ in range(3):  # alternate so drift hits both
                for mode, limit in (("openblas", 0), ("kernel", small_gemm.MAX_ROWS)):
                    small_gemm.set_max_rows(limit)
                    times[mode].append(_median_ms(lambda x=x, w=w: x @ w.T, args.reps))
            small_gemm.set_max_rows(small_gemm.MAX_ROWS)
            ob, kn = min(times["openblas"]), min(times["kernel"])
            out.append({"shape": name, "rows": m, "openblas_ms": ob, "kernel_ms": kn})
            print(f"{name:22} {m:>4} {ob:>12.3f} {kn:>10.3f} {ob / kn:>5.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
