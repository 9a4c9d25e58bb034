"""Batching as a client sees it (issue 45): ``dflash serve`` with its defaults, N greedy chat
requests sent at once against the same N sent one after another, on prompts the project
never tuned to (``unseen_prompts.jsonl``: code and chat alternating).

    python benchmarks/batching_server.py                      # demo, 4 clients, 48 tokens
    python benchmarks/batching_server.py --clients 4 8 --max-tokens 48 256 --json out.json

Per (clients, max tokens): wall time of the sequential and the concurrent round (after one
warm-up request), generated tokens / wall time, their ratio, and whether every concurrent
text equals its sequential text. The rounds alternate (sequential, concurrent, ...) and
the median of ``--rounds`` is reported.
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


def ask(url: str, text: str, max_tokens: int) -> tuple[str, int]:
    """One greedy chat completion, whole or streamed: (text, completion tokens)."""
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
            return out["choices"][0]["message"]["content"], out["usage"]["completion_tokens"]
        text, tokens = "", 0
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices", []):
                text += choice.get("delta", {}).get("content") or ""
            tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
        return text, tokens


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--clients", type=int, nargs="+", default=[4])
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[48])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--serve-args", default="", help="extra `dflash serve` flags")
    ap.add_argument("--prompts", default=None, help="a JSONL file of {'prompt': ...} rows")
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
                texts, seq, con, same = prompts(n, args.prompts), [], [], True
                for _ in range(args.rounds):
                    if args.cold:
                        t_c, got = concurrent(url, texts, m)
                    t_s, ref = sequential(url, texts, m)
                    if not args.cold:
                        t_c, got = concurrent(url, texts, m)
                    tokens = sum(k for _, k in ref)
                    seq.append(tokens / t_s)
                    con.append(sum(k for _, k in got) / t_c)
                    same &= [t for t, _ in got] == [t for t, _ in ref]
                s, c = statistics.median(seq), statistics.median(con)
                rows.append(
                    {
                        "clients": n,
                        "max_tokens": m,
                        "sequential": s,
                        "concurrent": c,
                        "ratio": c / s,
                        "same_text": same,
                        "runs": [seq, con],
                    }
                )
                print(
                    f"{n:7d} | {m:6d} | {s:16.1f} | {c:16.1f} | {c / s:4.2f}x | {same}", flush=True
                )
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
