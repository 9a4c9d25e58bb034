"""Speed ceiling of the decode loop: the demo target with a drafter that proposes the
target's own greedy continuation (optionally wrong at chosen block rows), against plain
mlx-lm decoding in the same process.

    python benchmarks/ceiling.py [--max-tokens 128]

Shows what the loop costs per cycle apart from the drafter's quality: with full acceptance
tau is ~block size and the speedup is bounded by verify + drafter cost per cycle.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# The package before MLX: MLX then binds the system OpenBLAS and the few-row kernel
# (imported after MLX, MLX keeps its wheel's reference BLAS).
import dflash_mlx  # noqa: F401

# isort: split
import mlx.core as mx
from mlx_lm.generate import generate_step

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from oracle import OracleDrafter

from dflash_mlx import load
from dflash_mlx.cpu.blas import measure as measure_blas
from dflash_mlx.decoding.acceptance import SamplingParams
from dflash_mlx.decoding.loop import DecodeOptions, decode


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt", default="def parse_args(argv):\n    parser = argparse.")
    args = ap.parse_args(argv)
    model, tok = load("demo", quiet=True)
    ids, n = tok.encode(args.prompt), args.max_tokens
    [t for t, _ in generate_step(mx.array(ids), model.target, max_tokens=8)]  # warm up
    t = time.perf_counter()
    ref = [t for t, _ in generate_step(mx.array(ids), model.target, max_tokens=n)]
    ar = time.perf_counter() - t
    print(f"BLAS: {measure_blas()['name']}; autoregressive {n / ar:.0f} tok/s")
    real = model.drafter
    for block, wrong in [(8, ()), (8, (4,)), (4, ()), (4, (2,))]:
        model.drafter = OracleDrafter(real, ids + ref + [0] * 20, wrong_at=wrong)
        t, out, cycles = time.perf_counter(), [], 0
        for c in decode(
            model,
            ids,
            model.make_cache(),
            SamplingParams(),
            DecodeOptions(max_tokens=n, block_size=block),
        ):
            out += c.tokens
            cycles += bool(c.drafted)
        dt = time.perf_counter() - t
        model.drafter = real
        assert out == ref, "lossless check failed"
        print(
            f"block {block} wrong rows {list(wrong) or '-'}: tau {(len(out) - 1) / cycles:.2f}, "
            f"{n / dt:.0f} tok/s, speedup {ar / dt:.2f}x"
        )


if __name__ == "__main__":
    main()
