"""Two agents sharing one server, alternating turns (A, B, A, B, A), each with its own long
system prompt: time to first token per turn, and what ``usage.prompt_tokens_details.
cached_tokens`` says was reused from the server's prompt caches (``--prompt-cache-gb``).

    python benchmarks/agents_cache.py                       # the demo pair, ~3,000-token prompts
    python benchmarks/agents_cache.py --turns 7 --json out.json

The server runs as ``python -m dflash_mlx.server`` in a subprocess on a free loopback port;
each turn is a streamed, greedy chat completion whose history grows by the answer and a new
user message. Time to first token: from sending the request to the first streamed event
(the server sends it with the first generated token).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = [
    "file",
    "path",
    "read",
    "write",
    "edit",
    "search",
    "grep",
    "list",
    "run",
    "command",
    "shell",
    "test",
    "build",
    "commit",
    "branch",
    "diff",
    "patch",
    "review",
    "error",
    "line",
    "function",
    "class",
    "module",
    "import",
    "return",
    "value",
    "type",
    "string",
    "number",
    "array",
    "object",
    "field",
    "option",
    "flag",
    "default",
    "config",
    "server",
    "client",
    "request",
    "response",
    "token",
    "cache",
    "model",
    "prompt",
    "tool",
    "call",
    "result",
    "output",
    "input",
    "stream",
    "event",
    "message",
    "user",
    "agent",
    "plan",
    "step",
    "task",
    "check",
    "verify",
    "parse",
    "format",
    "json",
    "schema",
    "name",
    "description",
    "required",
]


def system_prompt(agent: str, words: int) -> str:
    """A long, agent-specific system prompt: a role line and a made-up tool manual."""
    rng = random.Random(agent)
    lines = [f"You are agent {agent}, a coding assistant. Use the tools below when needed."]
    n = 0
    while n < words:
        tool = "_".join(rng.sample(WORDS, 2))
        text = " ".join(rng.choice(WORDS) for _ in range(40))
        lines.append(f"Tool {tool}: {text}.")
        n += 42
    return "\n".join(lines)


def start(model: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    """The server subprocess and its base URL."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "dflash_mlx.server", "--model", model, "--port", "0", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    deadline, seen = time.monotonic() + 600, []
    while time.monotonic() < deadline:
        line = proc.stdout.readline().decode(errors="replace")
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        m = re.search(r"listening on (http://\S+?)/v1", line)
        if m:  # keep reading its output, so the pipe never fills and blocks it
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, m.group(1)
    proc.kill()
    raise SystemExit("the server did not start:\n" + "".join(seen[-10:]))


def turn(url: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed greedy chat turn: time to first event, the answer and its usage."""
    body = {
        "model": "default_model",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    ttft, text, usage = None, [], {}
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            event = json.loads(line[6:])
            for choice in event.get("choices") or []:
                text.append(choice.get("delta", {}).get("content") or "")
            usage = event.get("usage") or usage
    return {"ttft": ttft, "text": "".join(text), "usage": usage}


def run(args) -> dict:
    """All turns against one server; returns the rows, the per-agent speedups and the
    server's ``/v1/cache`` report."""
    proc, url = start(args.model, args.server_args)
    try:
        agents = [chr(ord("A") + i) for i in range(args.agents)]
        # --same-system: one system prompt for all (two sessions of one agent, say)
        owner = {a: "A" if args.same_system else a for a in agents}
        history = {
            a: [{"role": "system", "content": system_prompt(owner[a], args.words)}] for a in agents
        }
        rows = []
        for i in range(args.turns):
            a = agents[i % len(agents)]
            ask = f"{a}{i}: what should I check next?"  # the agent's name first: they differ
            history[a].append({"role": "user", "content": ask})
            out = turn(url, history[a], args.max_tokens)
            history[a].append({"role": "assistant", "content": out["text"]})
            details = out["usage"].get("prompt_tokens_details") or {}
            rows.append(
                {
                    "turn": i + 1,
                    "agent": a,
                    "prompt_tokens": out["usage"].get("prompt_tokens"),
                    "cached_tokens": details.get("cached_tokens"),
                    "ttft_s": round(out["ttft"], 4),
                }
            )
        with urllib.request.urlopen(url + "/v1/cache", timeout=60) as resp:
            cache = json.loads(resp.read())
    finally:
        proc.terminate()
        proc.wait(30)
    speedups = {}
    for a in agents:
        mine = [r["ttft_s"] for r in rows if r["agent"] == a]
        if len(mine) > 1:
            speedups[a] = round(mine[0] / max(mine[1:]), 2)  # the slowest later turn
    return {"model": args.model, "rows": rows, "speedup_min": speedups, "cache": cache}


def table(result: dict) -> str:
    """The rows as a markdown table, then each agent's first-turn / slowest-later ratio."""
    out = [
        "| turn | agent | prompt tokens | cached tokens | time to first token (s) |",
        "| ---: | :---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        out.append(
            f"| {r['turn']} | {r['agent']} | {r['prompt_tokens']} | {r['cached_tokens']} "
            f"| {r['ttft_s']:.3f} |"
        )
    ratios = ", ".join(f"{a} {s}x" for a, s in result["speedup_min"].items())
    out.append(f"\nfirst turn / slowest later turn, per agent: {ratios}")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo")
    p.add_argument("--agents", type=int, default=2)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--words", type=int, default=2600, help="system prompt length in words")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--same-system", action="store_true", help="one system prompt for every agent")
    p.add_argument("--json", help="also write the result here")
    p.add_argument(
        "server_args",
        nargs="*",
        help="more `dflash serve` options (after --), e.g. -- --prompt-cache-gb 1",
    )
    args = p.parse_args()
    result = run(args)
    print(table(result))
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
