"""Start-up time of the command line, end to end, as a user sees it:

    python benchmarks/startup.py [--repeats 3] [--model demo]

times ``dflash --help`` and ``dflash run --model demo -m 4 "Hi"`` in fresh processes: the
first run with an empty start-up cache (it builds the cache), then best-of-N warm starts
(the cache filled, the file cache warm), and the same with the cache turned off
(``DFLASH_CACHE=0``: what every start cost before the cache). Then what the warm-up costs:
``run --block-size 4 -m 8 "Hi"`` (a fixed block: no warm-up) against ``run -m 8 "Hi"``
(``auto``) with the stored step costs removed first (so it measures them), both with the
start-up cache warm. Prints a table and JSON.
The cache used is a temporary folder, never the user's. Other load on the machine shows
in the numbers: run it on a quiet one (the load average is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


def timed(args, env) -> float:
    """Wall seconds of one ``dflash`` process (it must succeed)."""
    t = time.perf_counter()
    cmd = [sys.executable, "-m", "dflash_mlx.cli", *args]
    p = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t
    if p.returncode != 0:
        raise SystemExit(f"dflash {' '.join(args)} failed:\n{p.stderr}")
    return took


def measuring(cache: str, model: str, env) -> float:
    """Wall seconds of an ``auto`` run that measures the step costs (the stored ones removed)."""
    shutil.rmtree(os.path.join(cache, "costs"), ignore_errors=True)
    return timed(["run", "--model", model, "-m", "8", "Hi"], env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="demo")
    a = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="dflash-startup-")
    env = dict(os.environ, DFLASH_CACHE_DIR=cache, HF_HUB_OFFLINE="1")
    run = ["run", "--model", a.model, "-m", "4", "Hi"]
    try:
        res = {"load_average": os.getloadavg()[0]}
        res["help"] = min(timed(["--help"], env) for _ in range(a.repeats))
        res["first_run"] = timed(run, env)
        res["warm_run"] = min(timed(run, env) for _ in range(a.repeats))
        off = dict(env, DFLASH_CACHE="0")
        res["no_cache_run"] = min(timed(run, off) for _ in range(a.repeats))
        fixed = ["run", "--model", a.model, "--block-size", "4", "-m", "8", "Hi"]
        res["fixed_block_run"] = min(timed(fixed, env) for _ in range(a.repeats))
        res["auto_measuring_run"] = min(measuring(cache, a.model, env) for _ in range(a.repeats))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    print(f"load average {res['load_average']:.2f}; best of {a.repeats} unless noted")
    for k in (
        "help",
        "first_run",
        "warm_run",
        "no_cache_run",
        "fixed_block_run",
        "auto_measuring_run",
    ):
        print(f"{k:14s} {res[k]:6.2f} s" + ("  (once)" if k == "first_run" else ""))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
