"""Several processes as one Mac would be several Macs (docs/distributed.md, "Benchmark"):
the demo pair sharded over ``mlx.launch -n N --backend ring`` on this machine (loopback),
plain sharded decoding against DFlash on the same sharded target, and the unsharded pair.

    python benchmarks/distributed.py                       # tensor, 3 ranks, delays 0 0.1 1
    python benchmarks/distributed.py --modes pipeline      # pipeline, 2 ranks
    python benchmarks/distributed.py --modes tensor pipeline --json out.json

Per mode and per injected delay (``DFLASH_TEST_LINK_DELAY_MS``, ``distributed/link.py``:
every collective's input evaluated, then a sleep, then the collective), one launch: each
rank loads the demo pair sharded, decodes the same prompts plainly (mlx-lm's
``generate_step`` on the sharded target) and with DFlash (the checkpoint's block), and
rank 0 reports tokens/s, tau and the collectives issued per generated token (counted by
the hook). The unsharded row runs in one process with the hook counting nothing. The demo
needs 3 ranks for tensor parallelism (9 query / 3 key-value heads); pipeline runs on 2. A
mode that ``load`` refuses is a row saying so. Plain decoding stops at an end-of-sequence
token as DFlash does, so both count the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import dflash_mlx  # noqa: F401 - before MLX: it preloads the system OpenBLAS (Linux)

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = shutil.which("mlx.launch") or str(Path(sys.executable).with_name("mlx.launch"))
PROMPTS = [
    "Why is the sky blue? Answer in two sentences.",
    "Write a short Python function that reverses a string.",
]
TIMEOUT = 900  # seconds for one launch, loading included
# the demo's 9 query / 3 key-value heads split over 3 ranks; its 30 layers over 2 stages
RANKS = {"tensor": 3, "pipeline": 2}


def _decode(model, tok, prompt: str, max_tokens: int, dflash: bool) -> dict:
    """One prompt: seconds, tokens and tau, plain (mlx-lm) or DFlash."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step, generation_stream

    from dflash_mlx import stream_generate
    from dflash_mlx.generation import encode_prompt, eos_ids

    ids = encode_prompt(tok, prompt)  # the chat template, as `dflash run` would
    t = time.perf_counter()
    if dflash:
        n, tau = 0, 0.0
        kw = {"max_tokens": max_tokens, "temperature": 0.0, "block_size": model.block_size}
        for r in stream_generate(model, tok, ids, **kw):
            n, tau = r.generation_tokens, r.tau
    else:
        n, tau, eos = 0, 1.0, eos_ids(tok)
        for tok_id, _ in generate_step(mx.array(ids), model.target, max_tokens=max_tokens):
            if int(tok_id) in eos:  # where DFlash stops too: both count the same tokens
                break
            n += 1
        mx.synchronize(generation_stream)  # its step in flight: done before the next run
    return {"seconds": time.perf_counter() - t, "tokens": n, "tau": tau}


def worker(out: Path, mode: str, max_tokens: int) -> None:
    """One rank (or the one process): load, warm up, time plain and DFlash, write JSON."""
    import mlx.core as mx  # after dflash_mlx (imported above): a BLAS loaded after MLX is unused

    from dflash_mlx import DFlashError, load
    from dflash_mlx.distributed import link

    group = mx.distributed.init() if mode != "none" else None
    rank = group.rank() if group is not None else 0
    counts = link.install(link.delay_from_env() or 0.0) if group is not None else None
    kw = {} if mode in ("none", "tensor") else {"shard": mode}
    try:
        model, tok = load("demo", **kw)
    except (TypeError, DFlashError) as e:  # a mode this build does not have
        (out / f"rank{rank}.json").write_text(json.dumps({"refused": str(e).splitlines()[0]}))
        return
    res = {"size": 1 if group is None else group.size()}
    for name, dflash in (("plain", False), ("dflash", True)):
        _decode(model, tok, PROMPTS[0], 8, dflash)  # warm-up: compile, caches
        before = sum(counts.values()) if counts is not None else 0
        runs = [_decode(model, tok, p, max_tokens, dflash) for p in PROMPTS]
        after = sum(counts.values()) if counts is not None else 0
        tokens = sum(r["tokens"] for r in runs)
        res[name] = {
            "tok_s": tokens / sum(r["seconds"] for r in runs),
            "tau": sum(r["tau"] * r["tokens"] for r in runs) / max(tokens, 1),
            "collectives_per_token": (after - before) / max(tokens, 1),
            "tokens": tokens,
        }
    (out / f"rank{rank}.json").write_text(json.dumps(res))


def _launch(mode: str, ranks: int, delay: float, max_tokens: int) -> dict:
    """One row: the ranks' run (rank 0's figures), or the one process for mode "none"."""
    out = Path(tempfile.mkdtemp(prefix="dflash-dist-bench-"))
    me = [sys.executable, __file__, "--worker", str(out), "--mode", mode]
    me += ["--max-tokens", str(max_tokens)]
    cmd = me if mode == "none" else [LAUNCH, "-n", str(ranks), "--backend", "ring", "--", *me]
    env = dict(os.environ, PYTHONPATH=str(ROOT), DFLASH_TEST_LINK_DELAY_MS=f"{delay:g}")
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        log, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the ranks it started
        return {"failed": f"no answer in {TIMEOUT} s"}
    try:  # mlx.launch exits 0 even when a rank fails: rank 0's own file is the answer
        return json.loads((out / "rank0.json").read_text())
    except (OSError, ValueError):
        return {"failed": log.decode(errors="replace").strip().splitlines()[-1:]}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def table(rows: list[dict]) -> str:
    """The rows as text: tok/s plain and DFlash, their ratio, tau, collectives per token."""
    head = f"{'mode':<10}{'ranks':>6}{'delay ms':>9}{'plain tok/s':>12}{'DFlash tok/s':>13}"
    head += f"{'DFlash/plain':>13}{'tau':>6}{'coll/token plain':>17}{'DFlash':>8}"
    lines = [head]
    for r in rows:
        lead = f"{r['mode']:<10}{r['ranks']:>6}{r['delay_ms']:>9g}"
        if "plain" not in r:
            lines.append(lead + "  " + (r.get("refused") and "refused: " + r["refused"] or str(r)))
            continue
        p, d = r["plain"], r["dflash"]
        lines.append(
            f"{lead}{p['tok_s']:>12.1f}{d['tok_s']:>13.1f}{d['tok_s'] / p['tok_s']:>12.2f}x"
            f"{d['tau']:>6.2f}{p['collectives_per_token']:>17.1f}{d['collectives_per_token']:>8.1f}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", nargs="+", default=["tensor"], choices=["tensor", "pipeline"])
    ap.add_argument("--ranks", type=int, help="processes (default: tensor 3, pipeline 2)")
    ap.add_argument("--delays", nargs="+", type=float, default=[0.0, 0.1, 1.0], help="ms")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(Path(a.worker), a.mode, a.max_tokens)
    rows = [
        {"mode": "unsharded", "ranks": 1, "delay_ms": 0.0, **_launch("none", 1, 0, a.max_tokens)}
    ]
    for mode in a.modes:
        for delay in a.delays:
            ranks = a.ranks or RANKS[mode]
            got = _launch(mode, ranks, delay, a.max_tokens)
            rows.append({"mode": mode, "ranks": ranks, "delay_ms": delay, **got})
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(f"load: {os.getloadavg()[0]:.1f} (1-min average, {os.cpu_count()} cores)")
    print(table(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
