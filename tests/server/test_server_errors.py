"""Every error the server sends is OpenAI-shaped JSON, the HTTP layer's own included, and no
bad request stops it. Served here: a tiny pair with a 256-token context and no chat template
(the default chat format answers chat requests)."""

from __future__ import annotations

import json
import socket

import pytest
from cli_helpers import build_pair
from test_server import _start, _stop

from dflash_mlx import generate

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("srvsmall"), chat_template=False, context=256)


@pytest.fixture(scope="module")
def served(root, tmp_path_factory):
    proc, url, log = _start(tmp_path_factory.mktemp("srvlog"), root / "target", root / "drafter")
    yield url, log
    _stop(proc)


def _raw(url: str, data: bytes):
    """(status, headers dict, parsed body or None) of bytes sent as they are."""
    host, port = url.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    head, _, body = out.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(ln.split(": ", 1) for ln in lines[1:] if ": " in ln)
    return int(lines[0].split()[1]), headers, json.loads(body) if body else None


def _openai_error(body) -> dict:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    return err


def _post(url, path, body: bytes):
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(body)}\r\n\r\n"
    return _raw(url, head.encode() + body)


def test_http_layer_errors_are_openai_json(served):
    url, _ = served
    for method in ("PUT", "DELETE", "PATCH", "OPTIONS"):
        st, headers, body = _raw(
            url, f"{method} /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()
        )
        assert st == 405 and headers["Allow"] == "GET, POST"
        assert _openai_error(body)["code"] == "method_not_allowed"
    st, _, body = _raw(url, b"BREW /v1/models HTTP/1.1\r\n\r\n")
    assert st == 501 and "use GET or POST" in _openai_error(body)["message"]
    many = b"".join(b"X-Header-%d: v\r\n" % i for i in range(120))
    st, _, body = _raw(url, b"GET /health HTTP/1.1\r\n" + many + b"\r\n")
    assert st == 431 and _openai_error(body)["code"] == "headers_too_large"
    st, _, body = _raw(url, b"GET /v1/models?q=" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n")
    assert st == 414 and _openai_error(body)["code"] == "uri_too_long"
    for line in (b"GARBAGE\r\n\r\n", b"GET /health HTTP/1.1 extra\r\n\r\n"):
        st, _, body = _raw(url, line)
        assert st == 400 and _openai_error(body)["type"] == "invalid_request_error"
    st, _, body = _raw(url, b"GET /health HTTP/9.9\r\n\r\n")
    assert st == 505 and _openai_error(body)
    st, headers, body = _raw(url, b"HEAD /health HTTP/1.1\r\n\r\n")
    assert st == 200 and body is None and headers["Content-Type"] == "application/json"
    assert _raw(url, b"GET /health HTTP/1.1\r\n\r\n")[2]["status"] == "ok"


def test_bodies_that_break_parsers_are_400(served):
    url, _ = served
    chat = "/v1/chat/completions"
    st, _, body = _post(url, chat, b"[" * 100_000)
    assert st == 400 and "nested too deeply" in _openai_error(body)["message"]
    st, _, body = _post(url, chat, b'{"messages": ' + b"[" * 900 + b"]" * 900 + b"}")
    assert st == 400 and _openai_error(body)
    st, _, body = _post(url, chat, b'{"max_tokens": ' + b"1" * 5000 + b"}")
    assert st == 400 and _openai_error(body)["code"] == "invalid_json"
    lone = b'{"messages": [{"role": "user", "content": "caf\\udce9"}], "max_tokens": 2}'
    st, _, body = _post(url, chat, lone)
    err = _openai_error(body)
    assert st == 400 and err["param"] == "messages" and "not valid UTF-8" in err["message"]
    st, _, body = _post(url, "/v1/completions", b'{"prompt": "\\ud800x", "max_tokens": 2}')
    assert st == 400 and _openai_error(body)["param"] == "prompt"
    st, _, body = _post(url, chat, b'{"messages": [{"role": ["user"], "content": "x"}]}')
    assert st == 400 and _openai_error(body)["param"] == "messages"
    st, _, body = _post(
        url, chat, b'{"messages": [{"role": "user", "content": "x"}], "top_k": 1e400}'
    )
    assert st == 400 and _openai_error(body)["param"] == "top_k"
    big = b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1' + b"0" * 400 + b"}"
    st, _, body = _post(url, chat, big)
    assert st == 400 and "finite" in _openai_error(body)["message"]
    assert _raw(url, b"GET /health HTTP/1.1\r\n\r\n")[2]["status"] == "ok"


def test_context_limits_are_400_with_openai_code(served, root):
    url, _ = served
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=60, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="target", prompt="print(i) " * 200, max_tokens=2)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:  # refused by characters, not tokenized
        c.completions.create(model="target", prompt="x" * 1_000_000, max_tokens=2)
    assert "characters, at least" in e.value.body["message"]
    r = c.completions.create(model="target", prompt=list(range(5, 250)), max_tokens=100)
    assert r.usage.completion_tokens <= 256 - 245  # clamped to the room left


def test_chat_without_a_template_uses_the_default_format(served, root):
    from dflash_mlx import load

    url, log = served
    model, tok = load(str(root / "target"), drafter=str(root / "drafter"))
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=60, max_retries=0)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    for _ in range(2):
        r = c.chat.completions.create(model="target", messages=msgs, max_tokens=6, temperature=0)
        assert r.choices[0].message.content == generate(model, tok, msgs, max_tokens=6)
    assert log.read_text().count("note: this model has no chat template") == 1


def test_an_empty_stop_string_is_ignored_alone_or_in_a_list(served):
    url, _ = served
    texts = []
    for stop in (None, "", [""], ["", ""]):
        req = {"prompt": "def f(", "max_tokens": 6, "temperature": 0}
        if stop is not None:
            req["stop"] = stop
        st, _, body = _post(url, "/v1/completions", json.dumps(req).encode())
        assert st == 200, body
        texts.append((body["choices"][0]["text"], body["usage"]["completion_tokens"]))
    assert texts[0][1] == 6 and all(t == texts[0] for t in texts), texts
    bad_usage = {"prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}}
    st, _, body = _post(url, "/v1/completions", json.dumps(bad_usage).encode())
    assert st == 400 and _openai_error(body)["param"] == "stream_options"


@pytest.fixture
def in_process(inproc, monkeypatch):
    """An HTTP server on a tiny pair in this process (no generation: the worker is not
    run), its body timeout cut to half a second; returns a function that starts it."""
    from dflash_mlx.server.http import Handler

    monkeypatch.setattr(Handler, "body_timeout", 0.5)
    return lambda **kw: f"http://127.0.0.1:{inproc(worker=False, **kw)[1]}"


def test_a_body_shorter_than_its_content_length_is_a_prompt_408(in_process):
    import time

    url = in_process()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n"
    head += b"Content-Type: application/json\r\n\r\n"
    t = time.monotonic()
    st, _, body = _raw(url, head + b'{"pr')
    assert st == 408 and _openai_error(body)["code"] == "request_timeout"
    assert time.monotonic() - t < 10
    assert _raw(url, b"GET /health HTTP/1.1\r\n\r\n")[2]["status"] == "ok"


def test_a_non_ascii_api_key_matches_the_utf8_bytes_clients_send(in_process):
    url = in_process(api_key="clé-ключ")
    for key, want in (("clé-ключ", 200), ("cle-kljuch", 401)):
        head = (
            b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + key.encode()
        )
        st, _, body = _raw(url, head + b"\r\n\r\n")
        assert st == want, body
