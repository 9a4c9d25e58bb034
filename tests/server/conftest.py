"""The server tests' shared fixture: a server on the tiny pair in this process."""

from __future__ import annotations

import threading

import pytest


@pytest.fixture
def inproc(pairs):
    """Starts a server on the tiny qwen3 pair in this process, its worker in a thread;
    yields ``go(serve=True, worker=True, **make_server keywords) -> (server, port)``
    (``serve=False``: bound and listening, nothing accepted; ``worker=False``: HTTP served,
    no generation). Stops them all after the test."""
    from dflash_mlx.server.app import make_server

    model, tok = pairs("qwen3", "d2")
    running = []

    def go(serve: bool = True, worker: bool = True, **kw):
        httpd = make_server(model, tok, "tiny", port=0, **kw)
        threads = []
        if serve:
            # a short poll: shutdown() waits for it, at the end of every test
            serve = threading.Thread(target=httpd.serve_forever, args=(0.02,), daemon=True)
            threads = [serve]
            if worker:
                threads.append(threading.Thread(target=httpd.engine.run, daemon=True))
            for t in threads:
                t.start()
        running.append((httpd, threads))
        return httpd, httpd.server_address[1]

    yield go
    for httpd, threads in running:
        httpd.engine.stop()
        if threads:
            httpd.shutdown()
        for t in threads:
            t.join(30)
        httpd.server_close()
