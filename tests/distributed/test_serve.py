"""``dflash serve`` on two ring ranks on loopback (``distributed.local``: what ``mlx.launch
-n 2 --backend ring`` starts, without its launcher), in one launch, on a tiny thinking pair: a streamed and a whole request sent together get the same
greedy text under ``auto`` (the default), with rank 1's own batch planner rigged to draft
every row at block 2 each cycle while rank 0's plans plain steps where the tiny random
drafter does not pay, so the ranks stay paired only by taking rank 0's plans; the same prompt again gets it too, although rank 0 restores it
from its prompt-cache folder and rank 1 cannot write its own (the ranks agree to restore
nothing, never part); agents' requests sent together (a JSON schema, a forced and a
``required`` tool call, a thinking budget, a stop string: logits processors that each rank
rebuilds) get the answers of one process, greedily and sampled with a seed; then rank 1 is
killed mid-answer, and rank 0 answers the stream's client an error event in the API's shape
and exits within 30 s with one line naming rank 1."""

import json
import os
import re
import signal
import sys
import threading
import time
import urllib.request
from pathlib import Path

from launch import kernels_built, needs_launch
from tiny_models import thinking_pair

from dflash_mlx.distributed.local import start_ranks, stop

START = 300  # seconds for both ranks to load and listen (a loaded 2-core box took 180+)
WORKER = Path(__file__).with_name("cli_worker.py")
BOUND = 30  # seconds the survivors may take to exit once a rank is killed


FOX = "The quick brown fox"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
        },
    },
}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
FORCED = {"type": "function", "function": {"name": "get_weather"}}
AGENTS = {  # agents' chat requests (greedy but one); the random model never ends a reasoning
    "schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "r",
               "schema": SCHEMA}}, "thinking_budget": 3, "max_tokens": 60},
    "forced": {"tools": [WEATHER], "tool_choice": FORCED, "thinking_budget": 2, "max_tokens": 80},
    "required": {"tools": [WEATHER], "tool_choice": "required", "thinking_budget": 1,
                 "max_tokens": 80},
    "budget": {"thinking_budget": 5, "logit_bias": {"3": -100}, "max_tokens": 14},
    "sampled": {"response_format": {"type": "json_object"}, "thinking_budget": 2,
                "temperature": 1.0, "seed": 7, "block_size": 4,  # auto: blocks from timings
                "max_tokens": 40},
}  # fmt: skip


def _post(port: int, body: dict, timeout: float = 120, path: str = "completions"):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/{path}",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    return urllib.request.urlopen(req, timeout=timeout)


def _text(port: int, stream: bool, max_tokens: int, **kw) -> str:
    body = {"prompt": "def parse_args(argv):", "max_tokens": max_tokens, "temperature": 0}
    with _post(port, {**body, "stream": stream, **kw}) as r:
        if not stream:
            return json.loads(r.read())["choices"][0]["text"]
        events = [ln[6:] for ln in r.read().decode().splitlines() if ln.startswith("data: ")]
    return "".join(json.loads(e)["choices"][0]["text"] for e in events if e != "[DONE]")


def _answer(port: int, name: str) -> dict:
    """An agent's request's choice: its message (tool calls without their random ids)."""
    body = {"messages": ASK, "temperature": 0, **AGENTS[name]}
    with _post(port, body, timeout=300, path="chat/completions") as r:
        choice = json.loads(r.read())["choices"][0]
    for call in choice["message"].get("tool_calls") or []:
        call.pop("id")
    return choice


def _together(port: int) -> dict:
    """Every agent's answer: the greedy requests sent at once (their rows batch together),
    the sampled one alone (a row's drafts, and so its draws, follow the batch's longest
    block); and a completion cut by a stop string taken from the middle of its free text."""
    got, alone = {}, "sampled"
    runs = [
        threading.Thread(target=lambda n=n: got.update({n: _answer(port, n)}))
        for n in AGENTS
        if n != alone
    ]
    for t in runs:
        t.start()
    for t in runs:
        t.join(300)
    got[alone] = _answer(port, alone)
    free = _text(port, False, 24, prompt=FOX)
    word = re.findall(r"[a-z]{3,}", free)[1]  # the random model writes few words
    got["stop"] = (word, free, _text(port, False, 24, prompt=FOX, stop=[word]))
    return got


def _one_process(dirs) -> dict:
    """``_together``'s answers from a server in this process (the unsharded pair)."""
    from dflash_mlx import load
    from dflash_mlx.server.app import make_server

    httpd = make_server(*load(str(dirs[0]), drafter=str(dirs[1])), "think_t", port=0, max_batch=2)
    threads = [
        threading.Thread(target=f, daemon=True) for f in (httpd.serve_forever, httpd.engine.run)
    ]
    for t in threads:
        t.start()
    try:
        return _together(httpd.server_address[1])
    finally:
        httpd.engine.stop()
        httpd.shutdown()
        httpd.server_close()


def _port(log: Path) -> int | None:
    for line in log.read_text(errors="replace").splitlines():
        if "listening on http://127.0.0.1:" in line:
            return int(line.split("127.0.0.1:")[1].split("/")[0])
    return None


@needs_launch
def test_two_ranks_serve_agents_as_one_process_and_a_killed_rank_ends_the_other_with_its_name(
    tmp_path,
):
    dirs = thinking_pair(tmp_path / "pair")  # 4 query, 2 key/value heads: split over 2
    expected = _one_process(dirs)
    model = ["--model", str(dirs[0]), "--drafter", str(dirs[1])]
    cmd = [sys.executable, str(WORKER)]  # rank 1 rigged to choose plain
    (tmp_path / "pc").mkdir()
    (tmp_path / "pc" / "rank1").write_text("a file: rank 1 cannot write its folder")
    disk = ["--prompt-cache-dir", str(tmp_path / "pc"), "--prompt-cache-gb", "0"]  # all to disk
    kernels_built()
    serve = [*cmd, "serve", *model, "--port", "0", "--max-batch", "2", *disk]
    ranks, logs = start_ranks(serve, 2, cwd=tmp_path)
    log0 = logs / "rank0.log"
    try:
        deadline = time.monotonic() + START
        while _port(log0) is None and ranks[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        port = _port(log0)
        assert port is not None, log0.read_text()[-3000:]
        got = {}
        both = [
            threading.Thread(target=lambda s=s: got.update({s: _text(port, s, 24)}))
            for s in (True, False)
        ]
        for t in both:
            t.start()
        for t in both:
            t.join(120)
        assert got[True] == got[False] and got[True], got  # batched together, same text
        assert _text(port, False, 24) == got[True]  # rank 0's disk holds it, rank 1's cannot
        assert list((tmp_path / "pc" / "rank0").glob("*/e-*")), "rank 0 saved no entry"
        agents = _together(port)
        assert agents == expected  # every rank applied rank 0's processors
        assert json.loads(agents["schema"]["message"]["content"])["ok"] in (True, False)
        assert [c["finish_reason"] for c in (agents["forced"], agents["required"])] == [
            "tool_calls", "tool_calls"
        ]  # fmt: skip
        word, free, cut = agents["stop"]
        assert free.startswith(cut) and word in free[len(cut) :] and word not in cut

        with _post(port, {"prompt": "import os", "max_tokens": 4000, "stream": True}) as r:
            first = r.readline()  # the answer has begun
            assert first.startswith(b"data: "), first
            os.killpg(ranks[1].pid, signal.SIGKILL)
            killed = time.monotonic()
            rest = r.read().decode()
        ranks[0].wait(BOUND)  # its own watchdog ends it (no launcher here to)
        took = time.monotonic() - killed
    finally:
        stop(ranks)
    log = log0.read_text(errors="replace")
    errors = [ln for ln in rest.splitlines() if '"error"' in ln]
    assert len(errors) == 1 and "rank 1 of 2 exited" in errors[0], rest[-1500:]
    assert json.loads(errors[0][6:])["error"]["code"] == "server_group_broken"
    lines = [ln for ln in log.splitlines() if ln.startswith("error:")]
    assert lines == ["error: rank 1 of 2 exited; every rank stops (rank 0 now)"], log[-2000:]
    assert took < BOUND
