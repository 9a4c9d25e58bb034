"""The OpenAI-compatible server, end to end: a subprocess on a free loopback port serving the
tiny models, driven by the official ``openai`` client (and raw HTTP for malformed requests).

Expected texts come from ``dflash_mlx.generate`` on the same tiny models in this process.
Every client loop is bounded in count and time.
"""

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from dflash_mlx import generate
from dflash_mlx.server import bind_warning, context_length
from dflash_mlx.server.schema import DEFAULTS, APIError, parse_request

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-test-key"
EOS = 3  # tiny models' <|im_end|>
NO_EOS = {str(EOS): -100}  # keeps a generation going until max_tokens


def _start(tmp: Path, model: Path, drafter: Path, *args: str):
    """Start ``python -m dflash_mlx.server`` (``dflash serve``) on port 0; return (process,
    base url, log)."""
    log = tmp / f"server-{time.monotonic_ns()}.log"
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        HF_HUB_OFFLINE="1",
    )
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dflash_mlx.server",
                "--model",
                str(model),
                "--drafter",
                str(drafter),
                "--port",
                "0",
                *args,
            ],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(ROOT),
        )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)/v1", log.read_text())
        if m:
            return proc, m.group(1), log
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("server did not start:\n" + log.read_text())


def serve_tiny(tiny_dir, tmp_path_factory, name: str):
    """A server of the tiny qwen3 pair behind KEY, for a module-scoped fixture: yields its
    URL, stops it after."""
    proc, url, _ = _start(
        tmp_path_factory.mktemp(name), tiny_dir / "qwen3", tiny_dir / "d2_qwen3", "--api-key", KEY
    )
    yield url
    _stop(proc)


def _stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


@pytest.fixture(scope="module")
def paths(tiny_dir):
    return tiny_dir / "qwen3", tiny_dir / "d2_qwen3"


@pytest.fixture(scope="module")
def server(paths, tmp_path_factory):
    proc, url, _log = _start(
        tmp_path_factory.mktemp("srv"), *paths, "--api-key", KEY, "--max-queue", "8"
    )
    yield url
    _stop(proc)
    assert proc.returncode is not None


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def local(pairs):
    return pairs("qwen3", "d2")


@pytest.fixture(scope="module")
def name(paths):
    return paths[0].name  # the server calls a local model by its directory name


def _http(url, body=None, key=KEY, method=None, raw=None):
    """(status, parsed JSON body) of a raw HTTP request."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method or ("POST" if data else "GET"))
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _expected(local, prompt, max_tokens, **kw):
    model, tok = local
    return generate(model, tok, prompt, max_tokens=max_tokens, temperature=0.0, **kw)


def _chat_stream(client, name, messages, max_tokens, **kw):
    """(text, finish reasons, usage chunk or None, chunk count)."""
    text, reasons, use, n = [], [], None, 0
    stream = client.chat.completions.create(
        model=name, messages=messages, max_tokens=max_tokens, temperature=0, stream=True, **kw
    )
    for ch in stream:
        n += 1
        assert n < 10_000
        if ch.usage is not None:
            use = ch
        for c in ch.choices:
            text.append(c.delta.content or "")
            if c.finish_reason:
                reasons.append(c.finish_reason)
    return "".join(text), reasons, use, n


# --------------------------------------------------------------------------- no server


def test_parse_request_rejects_bad_fields():
    ok = parse_request(
        b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}',
        "chat",
        replace(DEFAULTS, temperature=0.5, block_size=4),
    )
    assert ok.gen.max_tokens == 3 and ok.gen.temperature == 0.5 and ok.gen.block_size == 4
    assert ok.prompt == [{"role": "user", "content": "hi"}] and not ok.stream
    c = parse_request(
        b'{"prompt": [1, 2, 3], "max_completion_tokens": 4, "max_tokens": 9}', "completion"
    )
    assert c.prompt == [1, 2, 3] and c.gen.max_tokens == 4
    t = parse_request(b'{"prompt": "a", "tree": false, "lookup": false}', "completion")
    assert t.gen.tree is False and t.gen.lookup is False and DEFAULTS.tree is True
    for body in [
        b"{",
        b"[]",
        b'{"messages": []}',
        b'{"messages": [{"role": "x"}]}',
        b'{"messages": [{"role": "user", "content": "a"}], "temperature": "hot"}',
        b'{"messages": [{"role": "user", "content": "a"}], "top_p": 0}',
        b'{"messages": [{"role": "user", "content": "a"}], "max_tokens": 0}',
        b'{"messages": [{"role": "user", "content": "a"}], "n": 2}',
        b'{"messages": [{"role": "user", "content": "a"}], "stop": 5}',
        b'{"messages": [{"role": "user", "content": "a"}], "block_size": 99}',
        b'{"messages": [{"role": "user", "content": "a"}], "seed": -1}',
        b'{"messages": [{"role": "user", "content": "a"}], "tree": "no"}',
        b'{"messages": [{"role": "user", "content": "a"}], "seed": 4294967296}',
        b'{"messages": [{"role": "user", "content": "a"}], "presence_penalty": NaN}',
        b'{"messages": [{"role": "user", "content": "a"}], "temperature": Infinity}',
        b'{"messages": [{"role": "user", "content": "a"}], "top_p": -Infinity}',
        b'{"messages": [{"role": "user", "content": "a"}], "logit_bias": {"3": NaN}}',
    ]:
        with pytest.raises(APIError) as e:
            parse_request(body, "chat", max_block_size=16)
        assert e.value.status == 400 and e.value.body()["error"]["message"]


def test_bind_warning_and_context(local):
    assert bind_warning("127.0.0.1", None) is None
    assert bind_warning("0.0.0.0", "key") is None
    assert "api-key" in bind_warning("0.0.0.0", None)
    assert context_length(local[0]) == 4096


# --------------------------------------------------------------------------- served


def test_health_and_models(server, client, name):
    assert _http(server + "/health", key=None)[1]["status"] == "ok"
    ids = [m.id for m in client.models.list().data]
    assert ids == [name]
    assert client.models.retrieve(name).id == name
    assert client.models.retrieve(name.upper()).id == name


def test_chat_matches_generate_with_usage(client, local, name):
    msgs = [{"role": "user", "content": "def parse_args(argv):"}]
    want = _expected(local, msgs, 24)
    r = client.chat.completions.create(model=name, messages=msgs, max_tokens=24, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason in ("stop", "length")
    n_prompt = len(local[1].apply_chat_template(msgs, add_generation_prompt=True))
    assert r.usage.prompt_tokens == n_prompt
    assert 1 <= r.usage.completion_tokens <= 24
    assert r.usage.total_tokens == n_prompt + r.usage.completion_tokens
    stats = r.model_extra["dflash"]
    assert stats["tau"] >= 1.0 and stats["cycles"] >= 1 and stats["accepted_tokens"] >= 0
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert stats["prompt_tokens_processed"] == n_prompt - cached


def test_chat_stream_with_usage(client, local, name):
    msgs = [{"role": "user", "content": "import os"}]
    want = _expected(local, msgs, 20)
    text, reasons, use, _ = _chat_stream(
        client, name, msgs, 20, stream_options={"include_usage": True}
    )
    assert text == want
    assert len(reasons) == 1 and reasons[0] in ("stop", "length")
    assert use is not None and use.choices == []
    assert use.usage.completion_tokens >= 1
    assert use.usage.total_tokens == use.usage.prompt_tokens + use.usage.completion_tokens
    assert use.model_extra["dflash"]["cycles"] >= 1


def test_stream_ends_with_done_raw(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    req = urllib.request.Request(server + "/v1/chat/completions", json.dumps(body).encode())
    req.add_header("Authorization", f"Bearer {KEY}")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = [ln for ln in r.read().decode().split("\n\n") if ln.strip()]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    first = json.loads(events[0][6:])
    assert first["choices"][0]["delta"]["role"] == "assistant" and "usage" not in first


def test_completions_stream_and_not(client, local, name):
    prompt = "class Foo:\n    def __init__(self, x):\n"
    want = _expected(local, prompt, 16, raw=True)
    r = client.completions.create(model=name, prompt=prompt, max_tokens=16, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == want
    n_prompt = len(local[1].encode(prompt))
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens <= 16
    parts, use = [], None
    for ch in client.completions.create(
        model=name,
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        parts += [c.text for c in ch.choices]
        use = ch.usage or use
    assert "".join(parts) == want
    assert use.completion_tokens == r.usage.completion_tokens
    # the repeated prompt came from the cache
    assert use.prompt_tokens_details.cached_tokens == n_prompt - 1


def test_stop_strings(client, local, name):
    msgs = [{"role": "user", "content": "The quick brown fox"}]
    full = _expected(local, msgs, 24, logit_bias={EOS: -100})
    clean = [i for i in range(4, len(full) - 3) if "\ufffd" not in full[i : i + 2]]
    assert clean, f"no usable stop string in {full!r}"
    stop = full[clean[0] : clean[0] + 2]
    want = _expected(local, msgs, 24, logit_bias={EOS: -100}, stop=[stop])
    assert want == full[: full.find(stop)]
    r = client.chat.completions.create(
        model=name,
        messages=msgs,
        max_tokens=24,
        temperature=0,
        stop=[stop, "never-there"],
        logit_bias=NO_EOS,
    )
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason == "stop"
    text, reasons, _, _ = _chat_stream(client, name, msgs, 24, stop=stop, logit_bias=NO_EOS)
    assert text == want and reasons == ["stop"]


def test_prefix_reuse_on_second_turn(client, name):
    turn1 = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "for i in range(10):"},
    ]
    r1 = client.chat.completions.create(model=name, messages=turn1, max_tokens=8, temperature=0)
    turn2 = turn1 + [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "print(i)"},
    ]
    r2 = client.chat.completions.create(model=name, messages=turn2, max_tokens=8, temperature=0)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    processed = r2.model_extra["dflash"]["prompt_tokens_processed"]
    assert cached >= r1.usage.prompt_tokens  # at least the whole first prompt
    assert processed == r2.usage.prompt_tokens - cached < r2.usage.prompt_tokens


def test_eight_concurrent_streams(client, local, name):
    prompts = [f"print({i}) and os.path.join('a', 'b{i}')" for i in range(8)]
    want = [_expected(local, [{"role": "user", "content": p}], 12) for p in prompts]
    got, errors = [None] * 8, []

    def one(i):
        try:
            got[i] = _chat_stream(client, name, [{"role": "user", "content": prompts[i]}], 12)
        except Exception as e:  # noqa: BLE001 - whatever fails in a thread, the assert reports
            errors.append(repr(e))

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 90
    for t in threads:
        t.join(max(0.1, deadline - time.monotonic()))
    assert not errors and all(not t.is_alive() for t in threads)
    for g, w in zip(got, want, strict=True):
        assert g[0] == w and len(g[1]) == 1


def test_sixteen_streams_some_aborted_the_rest_complete(server, client, local, name):
    """Sixteen at once (eight decode together, eight queue); every fourth client leaves
    mid-stream. The others get their solo text, the batch empties, the server still serves.
    Clients retry a 503 (queue full while the worker is mid-cycle) after its Retry-After."""
    before = _http(server + "/health", key=None)[1]
    client = client.with_options(max_retries=20)
    prompts = [f"x = {i} * os.getcwd() + '{i}'" for i in range(16)]
    want = {
        i: _expected(local, [{"role": "user", "content": p}], 10) for i, p in enumerate(prompts)
    }
    got, errors = {}, []

    def one(i):
        msgs = [{"role": "user", "content": prompts[i] if i % 4 else "Hello world!"}]
        try:  # (that prompt is known to run on without a stop string)
            if i % 4:
                got[i] = _chat_stream(client, name, msgs, 10)[0]
                return
            stream = client.chat.completions.create(
                model=name, messages=msgs, max_tokens=3000, stream=True, logit_bias=NO_EOS
            )
            for n, _ in enumerate(stream):
                if n >= 3:
                    break
            stream.close()
        except Exception as e:  # noqa: BLE001 - whatever fails in a thread, the assert reports
            errors.append(repr(e))

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and all(not t.is_alive() for t in threads)
    assert got == {i: w for i, w in want.items() if i % 4}
    done = before["served"] + 16  # every job ends (aborted ones too), exactly once
    h = _wait_health(server, lambda h: h["served"] >= done and h["batch"] == 0, limit=30)
    assert h["served"] == done and h["cancelled"] == before["cancelled"] + 4, (
        dict(before),
        dict(h),
    )
    assert not h["running"] and h["queued"] == 0
    r = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0
    )
    assert r.choices[0].message.content == _expected(local, [{"role": "user", "content": "hi"}], 3)


def _wait_health(server, pred, limit=20.0):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        h = _http(server + "/health", key=None)[1]
        if pred(h):
            return h
        time.sleep(0.05)
    raise AssertionError(f"health never matched: {h}")


def test_aborted_stream_is_cancelled(server, client, local, name):
    msgs = [{"role": "user", "content": "Hello world!"}]
    before = _http(server + "/health", key=None)[1]["cancelled"]
    stream = client.chat.completions.create(
        model=name, messages=msgs, max_tokens=3000, temperature=0, stream=True, logit_bias=NO_EOS
    )
    for n, _ in enumerate(stream):
        if n >= 3:
            break
    stream.close()  # the client goes away mid-generation
    # 3000 tokens would take far longer: the generation was cancelled at its next cycle
    h = _wait_health(server, lambda h: not h["running"] and h["queued"] == 0, limit=15)
    assert h["cancelled"] == before + 1
    want = _expected(local, msgs, 6)
    r = client.chat.completions.create(model=name, messages=msgs, max_tokens=6, temperature=0)
    assert r.choices[0].message.content == want


def test_disconnected_non_streaming_client_is_cancelled(server, client, name):
    before = _http(server + "/health", key=None)[1]["cancelled"]
    body = json.dumps(
        {
            "model": name,
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 3000,
            "logit_bias": NO_EOS,
        }
    ).encode()
    host, port = server.rsplit("/", 1)[1].split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
        b"application/json\r\nAuthorization: Bearer "
        + KEY.encode()
        + b"\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    _wait_health(server, lambda h: h["running"])
    sock.close()
    h = _wait_health(server, lambda h: not h["running"], limit=15)
    assert h["cancelled"] == before + 1
    assert client.models.list().data[0].id == name


def test_bad_requests(server, client, name):
    chat = server + "/v1/chat/completions"
    ok = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert _http(chat, raw=b'{"model": ')[0] == 400
    assert _http(chat, raw=b"[1, 2]")[0] == 400
    st, body = _http(chat, {**ok, "temperature": "hot"})
    assert st == 400 and body["error"]["param"] == "temperature"
    assert _http(chat, {**ok, "messages": "hi"})[0] == 400
    assert _http(chat, {**ok, "model": "gpt-4o"})[0] == 404
    assert _http(chat, ok, key=None)[0] == 401
    assert _http(chat, ok, key="wrong")[0] == 401
    assert _http(server + "/v1/models", key=None)[0] == 401
    assert _http(server + "/v1/nothing", ok)[0] == 404
    assert _http(chat, {**ok, "logit_bias": {"999999": 5}})[0] == 400
    assert _http(chat, {**ok, "n": 3})[0] == 400
    for field, value in [
        ("seed", "-1"),
        ("seed", "4294967296"),
        ("presence_penalty", "NaN"),
        ("frequency_penalty", "Infinity"),
        ("temperature", "-Infinity"),
    ]:
        raw = json.dumps(ok)[:-1] + f', "{field}": {value}}}'
        st, body = _http(chat, raw=raw.encode())  # Python's json reads NaN / Infinity
        assert st == 400 and body["error"]["param"] == field, (field, value, st, body)
    assert (
        _http(chat, {**ok, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]})[0]
        == 400
    )
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=name, messages=ok["messages"], temperature=-1)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=name, messages=ok["messages"], top_p=1.5)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=ok["messages"])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="nope", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError) as e:  # longer than the 4096-token context
        client.completions.create(model=name, prompt=[5] * 5000, max_tokens=2)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=name, prompt="hello " * 3000, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=name, prompt=[10**6], max_tokens=2)
    # still serving
    r = client.chat.completions.create(model=name, messages=ok["messages"], max_tokens=2)
    assert r.usage.completion_tokens >= 1


@pytest.mark.parametrize("batch", [1, 2])
def test_queue_full_gives_503(paths, local, tmp_path, batch):
    """Every row busy and the queue full: 503 + Retry-After; a freed row takes the queued job."""
    proc, url, log = _start(tmp_path, *paths, "--max-queue", "1", "--max-batch", str(batch))
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=60, max_retries=0)
        msgs = [{"role": "user", "content": "Hello world!"}]
        busy = []
        for _ in range(batch):
            busy.append(
                c.chat.completions.create(
                    model=paths[0].name,
                    messages=msgs,
                    max_tokens=3000,
                    stream=True,
                    logit_bias=NO_EOS,
                )
            )
            next(iter(busy[-1]))  # running now
        waiting = {}

        def queued():
            waiting["r"] = c.chat.completions.create(
                model=paths[0].name, messages=msgs, max_tokens=4, temperature=0
            )

        t = threading.Thread(target=queued, daemon=True)
        t.start()
        h = _wait_health(url, lambda h: h["running"] and h["queued"] == 1)
        assert h["batch"] == batch and h["max_batch"] == batch
        with pytest.raises(openai.APIStatusError) as e:
            c.chat.completions.create(model=paths[0].name, messages=msgs, max_tokens=2)
        assert e.value.status_code == 503 and e.value.response.headers["Retry-After"] == "1"
        assert e.value.body["code"] == "server_busy" and e.value.body["type"] == "server_error"
        busy[0].close()  # frees a row; the queued request runs next
        t.join(30)
        assert waiting["r"].choices[0].message.content == _expected(local, msgs, 4)
        assert "warning" not in log.read_text().lower()
    finally:
        _stop(proc)
