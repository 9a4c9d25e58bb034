"""Prefill speed of a long prompt with each BLAS MLX's CPU backend can get on Linux: the
system OpenBLAS, the scipy-openblas32 wheel's OpenBLAS, and the mlx wheel's reference BLAS.

    python benchmarks/prefill_blas.py [--tokens 3700] [--rounds 2] [--json out.json]

The BLAS is chosen before MLX is imported, so each measurement is a fresh process
(``--child``) with ``DFLASH_SYSTEM_BLAS`` / ``DFLASH_SCIPY_OPENBLAS`` set; the rounds
alternate the configurations so machine drift hits them alike. Each child loads the demo
pair, prefills 300 tokens of the prompt to warm up, then times the prefill of about
``--tokens`` tokens (one generated token; ``prompt_tps`` of the response). Prints one line per run and
the median prompt tok/s per BLAS with its ratio to the reference BLAS.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

CONFIGS = {
    "system OpenBLAS": {},
    "scipy-openblas32": {"DFLASH_SYSTEM_BLAS": "0"},
    "reference BLAS": {"DFLASH_SYSTEM_BLAS": "0", "DFLASH_SCIPY_OPENBLAS": "0"},
}
TEXT = (
    "The harbour town woke slowly: gulls over the fish market, a bell from the chapel on "
    "the hill, carts rattling down to the quay where the boats unloaded their night's catch. "
)


def child(tokens: int) -> dict:
    """One measurement in this process: the BLAS it got and the prefill's prompt tok/s."""
    import time

    import dflash_mlx  # first: chooses the BLAS before MLX loads
    from dflash_mlx.cpu import blas

    model, tokenizer = dflash_mlx.load("demo")
    ids = tokenizer.encode(TEXT * (tokens // 20))[:tokens]
    prompts = {"warm-up": tokenizer.decode(ids[:300]), "timed": tokenizer.decode(ids)}
    config = dflash_mlx.GenerationConfig(max_tokens=1, block_size=8)
    out = {"blas": blas.in_use(), "measured": blas.measure(repeats=3)["name"]}
    for run, prompt in prompts.items():
        t = time.perf_counter()
        last = None
        for last in dflash_mlx.stream_generate(model, tokenizer, prompt, config=config):
            pass
        out[run] = {"seconds": round(time.perf_counter() - t, 2)}
        out[run].update(prompt_tokens=last.prompt_tokens, prompt_tps=round(last.prompt_tps, 1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=3700)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default=None, help="comma-separated configuration names")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.tokens)))
        return
    names = args.only.split(",") if args.only else list(CONFIGS)
    results: dict[str, list] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names:
            env = dict(os.environ, **CONFIGS[name])
            cmd = [sys.executable, __file__, "--child", "--tokens", str(args.tokens)]
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if p.returncode != 0:
                raise SystemExit(f"error: {name} run failed: {p.stderr.strip()[-500:]}")
            res = json.loads(p.stdout.strip().splitlines()[-1])
            results[name].append(res)
            timed = res["timed"]
            print(
                f"round {r + 1} {name:18} {timed['prompt_tps']:7.1f} prompt tok/s "
                f"({timed['prompt_tokens']} tokens, {timed['seconds']} s) [{res['blas']}]"
            )
    median = {n: statistics.median(x["timed"]["prompt_tps"] for x in v) for n, v in results.items()}
    base = median.get("reference BLAS")
    for n, tps in median.items():
        ratio = f", {tps / base:.2f}x the reference BLAS" if base else ""
        print(f"{n:18} median {tps:7.1f} prompt tok/s{ratio}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"median_prompt_tps": median, "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
