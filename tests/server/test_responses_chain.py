"""Responses that agents can chain: a response is held before its answer is sent (whole or
streamed), so a continuation sent the moment the answer arrives never gets a 404, and
``store: null`` means the default (held). Served in this process; the store is slowed down
so that storing after sending (the old order) would lose the race every time."""

from __future__ import annotations

import json
import time

import pytest

from dflash_mlx.server import responses_store

openai = pytest.importorskip("openai")


@pytest.fixture
def slow_store(monkeypatch):
    """Each put takes 0.3 s more: a continuation racing it finds the response only when it
    was held before the answer went out."""
    put = responses_store.Store.put

    def slow(self, response, items):
        time.sleep(0.3)
        put(self, response, items)

    monkeypatch.setattr(responses_store.Store, "put", slow)


def _client(port: int):
    base = f"http://127.0.0.1:{port}/v1"
    return openai.OpenAI(base_url=base, api_key="unused", timeout=60, max_retries=0)


@pytest.mark.parametrize("stream", [False, True])
def test_an_immediate_continuation_finds_the_response(inproc, slow_store, stream):
    _, port = inproc()
    client = _client(port)
    prev = None
    for turn in range(3):
        kw = {"previous_response_id": prev} if prev else {}
        ask = {"model": "tiny", "input": f"turn {turn}", "max_output_tokens": 2, **kw}
        if stream:
            events = list(client.responses.create(stream=True, **ask))
            assert len(events) < 200
            done = events[-1]
            assert done.type in ("response.completed", "response.incomplete")
            prev = done.response.id
        else:
            prev = client.responses.create(**ask).id  # a 404 raises NotFoundError
        assert client.responses.retrieve(prev).id == prev


def test_store_null_is_the_default_and_store_false_is_not_held(inproc):
    _, port = inproc()
    client = _client(port)
    ask = {"model": "tiny", "input": "hi", "max_output_tokens": 2}
    held = client.responses.create(**ask, extra_body={"store": None})
    assert held.store is True and client.responses.retrieve(held.id).id == held.id
    skipped = client.responses.create(**ask, store=False)
    assert skipped.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(skipped.id)
    with pytest.raises(openai.BadRequestError, match="'store' must be a boolean"):
        client.responses.create(**ask, extra_body={"store": json.dumps(True)})
