"""No dropped connections: a burst of clients past ``--max-queue`` waits in the listen
backlog (sized to the queue, at least 128) and each gets an answer or a 503 with
``Retry-After``, never a reset. Served in this process, the worker in a thread."""

from __future__ import annotations

import http.client
import json
import socket
import threading

from dflash_mlx.server.app import backlog

CLIENTS = 64


def test_the_backlog_covers_the_queue_and_more():
    assert backlog(16, 8) == 128 and backlog(1, 1) == 128
    assert backlog(200, 8) == 416


def test_a_burst_past_the_queue_is_held_by_the_listen_backlog(inproc):
    """64 connections to a server not accepting yet: all are held (the stdlib's backlog of 5
    dropped the rest: they hung here on Linux and were reset on macOS)."""
    _, port = inproc(serve=False, max_queue=16, max_batch=8)
    held = []
    try:
        for _ in range(CLIENTS):
            held.append(socket.create_connection(("127.0.0.1", port), timeout=3))
    finally:
        for s in held:
            s.close()
    assert len(held) == CLIENTS


def test_64_concurrent_clients_get_an_answer_or_a_503_never_a_reset(inproc):
    _, port = inproc(max_queue=4, max_batch=2)
    body = json.dumps({"prompt": "def f(", "max_tokens": 2, "temperature": 0})
    start, got = threading.Barrier(CLIENTS), []

    def one():
        start.wait(30)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            got.append((r.status, r.getheader("Retry-After"), json.loads(r.read())))
        except OSError as e:  # a reset or a refusal: what this test forbids
            got.append((type(e).__name__, None, None))
        finally:
            conn.close()

    threads = [threading.Thread(target=one, daemon=True) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(got) == CLIENTS
    statuses = [s for s, _, _ in got]
    assert set(statuses) <= {200, 503}, statuses
    assert statuses.count(200) >= 1
    for status, retry, answer in got:
        if status == 503:
            assert retry == "1" and answer["error"]["code"] == "server_busy"
        else:
            assert answer["choices"][0]["finish_reason"] in ("stop", "length")
