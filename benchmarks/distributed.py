"""Several processes as one Mac would be several Macs (docs/distributed.md, "Benchmark"):
``dflash bench`` on the demo pair sharded over ``mlx.launch -n N --backend ring`` on this
machine (loopback), against the same bench in one process. Every figure is the bench's own
(its JSON), so the command each row prints is what a user runs to get it.

    python benchmarks/distributed.py                       # tensor, 3 ranks; hook off, 0, 1 ms
    python benchmarks/distributed.py --modes pipeline      # pipeline, 2 ranks
    python benchmarks/distributed.py --delays off --json out.json

Per mode and per link setting, one launch of ``dflash bench --model demo --max-samples 2
--max-tokens T --temp 0`` (the built-in prompts; ``--block-size`` if given): plain decoding
(mlx-lm's ``generate_step`` on the sharded target) against DFlash 2 and ``auto`` on the same
sharded target, each timed from its first token on from one shared prefill, as ``dflash
bench`` always times. A delay turns on the test hook on the link
(``DFLASH_TEST_LINK_DELAY_MS``, ``distributed/link.py``: each collective's input evaluated,
then a sleep, then the collective), which also counts the collectives per generated token;
"off" leaves MLX's collectives as a user gets them. The demo needs 3 ranks for tensor
parallelism (9 query / 3 key-value heads); pipeline runs on 2. A mode ``load`` refuses is a
row saying so.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = shutil.which("mlx.launch") or str(Path(sys.executable).with_name("mlx.launch"))
TIMEOUT = 1800  # seconds for one launch, loading and the warm-up included
# the demo's 9 query / 3 key-value heads split over 3 ranks; its 30 layers over 2 stages
RANKS = {"tensor": 3, "pipeline": 2}


def bench_args(max_tokens: int, block: int | None, samples: int) -> list[str]:
    """``dflash bench``'s arguments of every row (the built-in prompts, greedy)."""
    args = ["bench", "--model", "demo", "--max-samples", str(samples)]
    args += ["--max-tokens", str(max_tokens), "--temp", "0"]
    return args + ([] if block is None else ["--block-size", str(block)])


def _launch(mode: str, ranks: int, delay: str, args: list[str], launcher: str) -> dict:
    """One row: rank 0's bench report (``--json``), or the one process for mode "none".
    ``launcher`` "mlx" starts the ranks with ``mlx.launch``, "direct" with the same ring
    environment and no launcher process (``distributed.local``)."""
    from dflash_mlx.distributed.local import free_port, run_ranks

    out = Path(tempfile.mkdtemp(prefix="dflash-dist-bench-")) / "bench.json"
    me = [sys.executable, "-m", "dflash_mlx.cli", *args, "--json", str(out)]
    if mode != "none":
        me += ["--shard", mode]
    cmd = me
    if mode != "none" and launcher == "mlx":  # the ring's ports only where mlx.launch takes them
        port = str(free_port(ranks))
        cmd = [LAUNCH, "-n", str(ranks), "--backend", "ring", "--starting-port", port, "--", *me]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("DFLASH_TEST_LINK_DELAY_MS", None)
    if delay != "off":
        env["DFLASH_TEST_LINK_DELAY_MS"] = delay
    shown = shlex.join(["dflash" if a == sys.executable else a for a in cmd])
    shown = shown.replace("dflash -m dflash_mlx.cli", "dflash").replace(LAUNCH, "mlx.launch")
    if mode != "none" and launcher == "direct":
        shown = f"{ranks} ranks started directly (MLX_RANK, MLX_HOSTFILE): {shown}"
    if delay != "off":
        shown = f"DFLASH_TEST_LINK_DELAY_MS={delay} {shown}"
    if mode != "none" and launcher == "direct":
        res = run_ranks(cmd, ranks, timeout=TIMEOUT, env=env)
        timed_out, log = res.timed_out, res.output
    else:
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            log, timed_out = proc.communicate(timeout=TIMEOUT)[0].decode(errors="replace"), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the ranks it started
            log, timed_out = "", True
    if timed_out:
        return {"failed": f"no answer in {TIMEOUT} s", "command": shown}
    try:  # mlx.launch exits 0 even when a rank fails: rank 0's report is the answer
        return {"report": json.loads(out.read_text()), "command": shown}
    except (OSError, ValueError):
        lines = log.strip().splitlines()
        said = [ln for ln in lines if ln.startswith("error:")] or lines[-1:]
        return {"refused": said[0] if said else "no output", "command": shown}


def figures(rep: dict) -> dict:
    """The row's figures from a bench report: plain and DFlash 2 tok/s, their ratio, tau,
    ``auto``'s ratio, and the collectives per token where the link hook counted them."""
    m = rep["methods"]
    plain, dflash = m["autoregressive"], m.get("dflash2") or m["dflash1"]
    return {
        "plain_tok_s": plain["tok_per_s"],
        "dflash_tok_s": dflash["tok_per_s"],
        "speedup": dflash["speedup"],
        "tau": dflash["tau"],
        "auto_speedup": m["auto"]["speedup"] if "auto" in m else None,
        "coll_plain": plain.get("collectives_per_token"),
        "coll_dflash": dflash.get("collectives_per_token"),
        "group": rep.get("group", {"ranks": 1}),
    }


def table(rows: list[dict]) -> str:
    """The rows as text: tok/s plain and DFlash 2, their ratio, tau, auto, collectives."""
    head = f"{'mode':<10}{'ranks':>6}{'launcher':>9}{'link':>6}{'plain tok/s':>12}"
    head += f"{'DFlash tok/s':>13}"
    head += f"{'DFlash/plain':>13}{'tau':>6}{'auto/plain':>11}{'coll/token plain':>17}{'DFlash':>8}"
    lines = [head]
    for r in rows:
        launcher = r.get("launcher", "mlx") if r["ranks"] > 1 else "-"
        lead = f"{r['mode']:<10}{r['ranks']:>6}{launcher:>9}{r['delay']:>6}"
        if "figures" not in r:
            lines.append(f"{lead}  {r.get('refused') or r.get('failed')}")
            continue
        f = r["figures"]
        auto = "-" if f["auto_speedup"] is None else f"{f['auto_speedup']:.2f}x"
        coll = [("-" if c is None else f"{c:.1f}") for c in (f["coll_plain"], f["coll_dflash"])]
        lines.append(
            f"{lead}{f['plain_tok_s']:>12.1f}{f['dflash_tok_s']:>13.1f}{f['speedup']:>12.2f}x"
            f"{f['tau']:>6.2f}{auto:>11}{coll[0]:>17}{coll[1]:>8}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", nargs="+", default=["tensor"], choices=["tensor", "pipeline"])
    ap.add_argument("--ranks", type=int, help="processes (default: tensor 3, pipeline 2)")
    ap.add_argument(
        "--delays", nargs="+", default=["off", "0", "1"], help="'off' (no hook) or ms each"
    )
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-samples", type=int, default=2, help="built-in prompts")
    ap.add_argument("--block-size", type=int, help="default: the checkpoint's")
    ap.add_argument("--json", help="also write the rows (with each bench report) here")
    ap.add_argument(
        "--launcher", nargs="+", default=["mlx"], choices=["mlx", "direct"],
        help="mlx.launch (what users run), or ranks started directly: mlx.launch 0.32's "
        "relay spins a core while the ranks run, a third of a 2-core machine",
    )  # fmt: skip
    a = ap.parse_args()
    args = bench_args(a.max_tokens, a.block_size, a.max_samples)
    runs = [("unsharded", "none", 1, "off", "mlx")]
    for mode in a.modes:
        runs += [(mode, mode, a.ranks or RANKS[mode], d, k) for k in a.launcher for d in a.delays]
    rows = []
    for name, mode, ranks, delay, launcher in runs:
        got = _launch(mode, ranks, delay, args, launcher)
        row = {"mode": name, "ranks": ranks, "delay": delay, "launcher": launcher, **got}
        if "report" in got:
            row["figures"] = figures(got["report"])
        rows.append(row)
        print(table(rows[-1:]).splitlines()[-1], f"  <- {got['command']}", flush=True)
    print(f"load: {os.getloadavg()[0]:.1f} (1-min average, {os.cpu_count()} cores)")
    print(table(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
