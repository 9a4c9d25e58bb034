"""Honest endings: on SIGTERM or Ctrl-C running requests get ``--shutdown-grace`` seconds to
finish, then each is ended explicitly (a whole request: 503 in its API's shape; a stream: its
API's error event), never passed off as finished (a 200 with a null finish reason, a bare
``[DONE]``) and never a 500, whether it was decoding, prefilling or queued."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import pytest
from test_server import NO_EOS, _start

from dflash_mlx.server.shutdown import Stopper
from dflash_mlx.server.worker import Job
from dflash_mlx.settings import GenerationConfig, ServerConfig

LONG = {"max_tokens": 3000, "temperature": 0, "logit_bias": NO_EOS}
MSG = [{"role": "user", "content": "Hello world!"}]


def _post(port: int, path: str, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    head += f"x-api-key: k\r\nContent-Length: {len(data)}\r\n\r\n"
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    s.sendall(head.encode() + data)
    return s


def _read(s: socket.socket, until: bytes | None = None) -> bytes:
    """What the server sends: all of it, or up to ``until`` (a stream that began)."""
    out = b""
    while (until is None or until not in out) and (piece := s.recv(65536)):
        out += piece
    return out


def _status(out: bytes) -> int:
    return int(out.split(b" ", 2)[1])


def _jobs_end_with(engine, job: Job, limit: float = 30.0) -> list:
    items, t = [], time.monotonic()
    while time.monotonic() - t < limit:
        tag, val = job.out.get(timeout=limit)
        items.append((tag, val))
        if tag == "end":
            return items
    raise AssertionError("the job never ended")


@pytest.mark.parametrize("batch", [1, 2])
def test_a_stop_ends_a_running_or_prefilling_job_with_a_503(pairs, batch):
    """The worker alone: a job stopped wherever it is (queued, in prefill, decoding) ends
    with a 503 error before its end (before: a 500 in prefill, a cut 200 while decoding)."""
    from dflash_mlx.server.worker import Engine

    model, tok = pairs("qwen3", "d2")
    engine = Engine(model, tok, max_batch=batch, cache_bytes=0)
    worker = threading.Thread(target=engine.run, daemon=True)
    worker.start()
    try:
        gen = GenerationConfig(max_tokens=3000, logit_bias={3: -100})
        job = Job(list(range(5, 200)), gen)
        assert engine.submit(job)
        t = time.monotonic()
        while not engine.occupancy and time.monotonic() - t < 30:
            time.sleep(0.001)  # running: in prefill or decoding
        engine.stop()
        items = _jobs_end_with(engine, job)
    finally:
        engine.stop()
        worker.join(30)
    errors = [val for tag, val in items if tag == "error"]
    assert errors and errors[0].status == 503 and errors[0].code == "server_shutting_down"
    assert not engine.submit(Job([5, 6], gen))  # stopped: refused


def test_running_requests_finish_within_the_grace_and_new_ones_get_503(inproc):
    httpd, port = inproc(config=ServerConfig(shutdown_grace=60))
    stopper = Stopper(httpd.engine, 60)
    stopper.watcher.start()  # no signal handlers here: the handler is called directly
    s = _post(
        port, "/v1/chat/completions", {"messages": MSG, **LONG, "max_tokens": 24, "stream": True}
    )
    head = _read(s, b"data: ")
    stopper._on_signal(signal.SIGTERM, None)
    t = time.monotonic()
    while not httpd.engine.closing and time.monotonic() - t < 10:
        time.sleep(0.01)
    late = _read(_post(port, "/v1/completions", {"prompt": "hi", "max_tokens": 2}))
    assert _status(late) == 503 and b"server_shutting_down" in late
    out = head + _read(s)
    chunks = [json.loads(e[6:]) for e in out.split(b"\n\n") if e.startswith(b"data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]
    assert out.rstrip().endswith(b"data: [DONE]")
    assert httpd.engine.finished.wait(30)


def test_past_the_grace_each_api_ends_its_requests_explicitly(tiny_dir, tmp_path):
    proc, url, log = _start(
        tmp_path, tiny_dir / "qwen3", tiny_dir / "d2_qwen3", "--shutdown-grace", "0.5"
    )
    port = int(url.rsplit(":", 1)[1])
    try:
        anth = {"model": "x", "messages": MSG, "max_tokens": 3000}
        streams = {
            "chat": _post(port, "/v1/chat/completions", {"messages": MSG, **LONG, "stream": True}),
            "anthropic": _post(port, "/v1/messages", {**anth, "stream": True}),
            "responses": _post(
                port, "/v1/responses", {"input": "hi", "max_output_tokens": 3000, "stream": True}
            ),
        }
        heads = {k: _read(s, b"data: ") for k, s in streams.items()}
        whole = _post(port, "/v1/chat/completions", {"messages": MSG, **LONG})
        time.sleep(0.5)  # the whole request is decoding too
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        out = {k: heads[k] + _read(s) for k, s in streams.items()}
        answer = _read(whole)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _status(answer) == 503, answer[:300]
    err = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert err["code"] == "server_shutting_down" and set(err) == {
        "message",
        "type",
        "param",
        "code",
    }
    chat = [e for e in out["chat"].split(b"\n\n") if e.startswith(b"data: ")]
    assert b'"server_shutting_down"' in chat[-2] and chat[-1] == b"data: [DONE]", chat[-3:]
    assert b'"finish_reason": "' not in out["chat"]  # no chunk says it finished
    assert out["anthropic"].rstrip().split(b"\n\n")[-1].startswith(b"event: error")
    assert b"message_stop" not in out["anthropic"]
    assert b"event: response.failed" in out["responses"]
    assert b"response.completed" not in out["responses"]
    assert b"Traceback" not in log.read_bytes()


def test_a_second_signal_ends_running_requests_at_once(tiny_dir, tmp_path):
    proc, url, log = _start(
        tmp_path, tiny_dir / "qwen3", tiny_dir / "d2_qwen3", "--shutdown-grace", "600"
    )
    port = int(url.rsplit(":", 1)[1])
    try:
        s = _post(port, "/v1/chat/completions", {"messages": MSG, **LONG, "stream": True})
        head = _read(s, b"data: ")
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert proc.poll() is None  # still in its grace of 600 s
        t = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0 and time.monotonic() - t < 15
        out = head + _read(s)
    finally:
        if proc.poll() is None:
            proc.kill()
    events = [e for e in out.split(b"\n\n") if e.startswith(b"data: ")]
    assert b'"server_shutting_down"' in events[-2] and events[-1] == b"data: [DONE]"
    assert "stopping now" in log.read_text()
