"""Batching as a client sees it (issues 45, 52): ``dflash serve`` with its defaults, N greedy
chat requests sent at once against the same N sent one after another, on prompts the project
never tuned to (``unseen_prompts.jsonl``: code and chat alternating; ``--prompts`` another
JSONL file, e.g. ``unseen_prompts_batch.jsonl``, taken in its order).

    python benchmarks/batching_server.py                      # demo, 4 clients, 48 tokens
    python benchmarks/batching_server.py --prompts benchmarks/unseen_prompts_batch.jsonl \
        --clients 4 8 --max-tokens 48 256 --json out.json

Per (clients, max tokens): wall time of the sequential and the concurrent round (after one
warm-up request), generated tokens / wall time, their ratio, and whether every concurrent
text equals its sequential text. The rounds alternate (sequential, concurrent, ...) and
the median of ``--rounds`` is reported, then each row's tau (tokens per cycle, from the
responses' ``dflash`` stats) alone and in the batch, and the block sizes the batch used.
Last, the roofline's Mac estimate (``--chip``) of a batched verify: a plain step of N rows
against a verify of N rows x the drafter's block, and the tau per row that breaks even.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from agents_cache import start  # the server subprocess on a free port


def prompts(n: int, path: str | None = None) -> list[str]:
    """n prompts: a JSONL file's in order, or the unseen ones, code and chat alternating."""
    src = Path(path) if path else ROOT / "unseen_prompts.jsonl"
    rows = [json.loads(line)["prompt"] for line in src.open() if line.strip()]
    if path is None:
        code = [p for p in rows if "function" in p.lower() or "python" in p.lower()]
        chat = [p for p in rows if p not in code]
        rows = [x for pair in zip(code, chat) for x in pair]
    return (rows * (n // len(rows) + 1))[:n]


STREAM = False  # --stream: every request streamed (server-sent events), as chat UIs do


def ask(url: str, text: str, max_tokens: int) -> tuple[str, int, dict]:
    """One greedy chat completion, whole or streamed: (text, completion tokens, its
    ``dflash`` stats)."""
    body = {
        "model": "default_model",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if STREAM:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(
        f"{url}/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=900) as r:
        if not STREAM:
            out = json.loads(r.read())
            msg, use = out["choices"][0]["message"]["content"], out["usage"]
            return msg, use["completion_tokens"], out.get("dflash", {})
        text, tokens, stats = "", 0, {}
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices", []):
                text += choice.get("delta", {}).get("content") or ""
            tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
            stats = event.get("dflash", stats)
        return text, tokens, stats


def sequential(url: str, texts: list[str], max_tokens: int):
    tic = time.perf_counter()
    got = [ask(url, t, max_tokens) for t in texts]
    return time.perf_counter() - tic, got


def concurrent(url: str, texts: list[str], max_tokens: int):
    got: list = [None] * len(texts)

    def one(i):
        got[i] = ask(url, texts[i], max_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
    tic = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - tic, got


def mac_estimate(model: str, rows: int, chip: str) -> dict | None:
    """The roofline's batched verify of ``rows`` rows on ``chip`` (estimated; None when the
    model's configs are not at hand offline)."""
    from dflash_mlx.bench import roofline as rl
    from dflash_mlx.bench import roofline_data as data
    from dflash_mlx.cli.roofline import _configs, _inputs
    from dflash_mlx.errors import DFlashError

    try:
        _, tcfg, dcfg, stored = _configs(model, None)
    except DFlashError:
        return None
    inp = _inputs(tcfg, dcfg, (stored or "4bit").lower(), None, None, None)
    name, bandwidth, _ = data.chip(chip)
    return rl.batched(rl.estimate(inp), inp, name, bandwidth, rows) | {"chip": name}


def taus(got) -> list[float]:
    """Each response's tau (tokens per cycle)."""
    return [round(st.get("tau", 0.0), 2) for _, _, st in got]


def blocks(got) -> dict[str, int]:
    """Cycles per block size over all responses ("1": plain steps)."""
    out: dict[str, int] = {}
    for _, _, st in got:
        for b, n in st.get("blocks", {}).items():
            out[b] = out.get(b, 0) + n
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def measure(url: str, texts: list[str], m: int, rounds: int, cold: bool) -> dict:
    """Alternating rounds of one (clients, max tokens) cell; medians and the last round's
    per-row tau and blocks."""
    seq, con, same = [], [], True
    for _ in range(rounds):
        if cold:
            t_c, got = concurrent(url, texts, m)
        t_s, ref = sequential(url, texts, m)
        if not cold:
            t_c, got = concurrent(url, texts, m)
        seq.append(sum(k for _, k, _ in ref) / t_s)
        con.append(sum(k for _, k, _ in got) / t_c)
        same &= [t for t, _, _ in got] == [t for t, _, _ in ref]
    s, c = statistics.median(seq), statistics.median(con)
    return {
        "clients": len(texts),
        "max_tokens": m,
        "sequential": s,
        "concurrent": c,
        "ratio": c / s,
        "same_text": same,
        "runs": [seq, con],
        "tau_alone": taus(ref),
        "tau_batched": taus(got),
        "blocks_alone": blocks(ref),
        "blocks_batched": blocks(got),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--clients", type=int, nargs="+", default=[4])
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[48])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--serve-args", default="", help="extra `dflash serve` flags")
    ap.add_argument("--prompts", default=None, help="a JSONL file of {'prompt': ...} rows")
    ap.add_argument("--chip", default="M4 Pro", help="the Mac of the roofline's estimate")
    ap.add_argument(
        "--cold",
        action="store_true",
        help="no warm-up request, and each round sends the concurrent requests first (the "
        "first batch on a fresh server pays its one-time costs)",
    )
    ap.add_argument("--stream", action="store_true", help="stream every request (SSE)")
    args = ap.parse_args()
    global STREAM
    STREAM = args.stream
    proc, url = start(args.model, args.serve_args.split())
    rows = []
    try:
        if not args.cold:
            ask(url, "Hi", 8)  # the first request's one-time costs are not the batch's
        print("clients | tokens | sequential tok/s | concurrent tok/s | ratio | same text")
        for n in args.clients:
            for m in args.max_tokens:
                row = measure(url, prompts(n, args.prompts), m, args.rounds, args.cold)
                rows.append(row)
                s, c = row["sequential"], row["concurrent"]
                print(
                    f"{n:7d} | {m:6d} | {s:16.1f} | {c:16.1f} | {c / s:4.2f}x | {row['same_text']}",
                    flush=True,
                )
                print(f"    tau alone {row['tau_alone']}  batched {row['tau_batched']}")
                print(f"    blocks alone {row['blocks_alone']}  batched {row['blocks_batched']}")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    for n in args.clients:
        est = mac_estimate(args.model, n, args.chip)
        if est is not None:
            print(
                f"Mac estimate ({est['chip']}, estimated): {n} rows, plain step "
                f"{est['plain_step_seconds'] * 1e3:.2f} ms, verify of {n} x {est['block']} "
                f"{est['verify_cycle_seconds'] * 1e3:.2f} ms: break-even tau per row "
                f"{est['break_even_tau']:.2f}"
            )
            for r in rows:
                if r["clients"] == n:
                    r["mac_estimate"] = est
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
