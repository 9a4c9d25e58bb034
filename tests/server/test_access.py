"""Local means local: web pages cannot drive the server. A foreign ``Origin`` or a ``Host``
that is not this server's (DNS rebinding) gets a 403, a POST that is not JSON a 415, in the
API's own error shape, before anything reaches the model; ``--allow-origin`` opens it (with
CORS answers) for pages the user names. Served in this process, without the worker."""

from __future__ import annotations

import json
import socket

import pytest

from dflash_mlx.server.access import Access
from dflash_mlx.settings import ServerConfig, SettingError

CHAT = "/v1/chat/completions"
BODY = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()


@pytest.fixture
def start(inproc):
    """Starts an HTTP server on the tiny pair (the worker is not run: nothing refused here
    may reach it); returns the function that starts one and returns its port."""
    return lambda **kw: inproc(worker=False, **kw)[1]


def _send(port: int, method: str, path: str, headers: dict, body: bytes = b""):
    """(status, headers, parsed body or None) of one raw request."""
    head = f"{method} {path} HTTP/1.1\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    head += f"Content-Length: {len(body)}\r\n\r\n" if body or method == "POST" else "\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head.encode() + body)
        out = b""
        while piece := s.recv(65536):
            out += piece
    top, _, rest = out.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    got = dict(ln.split(": ", 1) for ln in lines[1:] if ": " in ln)
    return int(lines[0].split()[1]), got, json.loads(rest) if rest else None


def test_a_cross_site_simple_post_is_403_and_never_queued(start, pairs):
    port = start()
    page = {"Host": f"127.0.0.1:{port}", "Origin": "http://evil.example"}
    for ctype in ("text/plain", "application/json"):
        st, _, body = _send(port, "POST", CHAT, {**page, "Content-Type": ctype}, BODY)
        assert st == 403 and body["error"]["code"] == "forbidden_origin", body
        assert "--allow-origin http://evil.example" in body["error"]["message"]
        assert set(body["error"]) == {"message", "type", "param", "code"}
    st, _, body = _send(port, "GET", "/v1/models", page)
    assert st == 403  # the answers are not readable either
    anth = {**page, "Content-Type": "text/plain"}
    st, _, body = _send(port, "POST", "/v1/messages", anth, BODY)
    assert st == 403 and body["type"] == "error"
    assert body["error"]["type"] == "permission_error", body


def test_a_dns_rebinding_host_is_403(start):
    port = start()
    for host in (f"evil.example:{port}", "192.168.1.7", "localhost.evil.example"):
        st, _, body = _send(port, "GET", "/v1/models", {"Host": host})
        assert st == 403 and body["error"]["code"] == "forbidden_host", (host, body)
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST"):
        assert _send(port, "GET", "/v1/models", {"Host": host})[0] == 200, host
    assert _send(port, "GET", "/health", {})[0] == 200  # HTTP/1.0 clients may send no Host


def test_the_servers_own_origin_is_served(start):
    port = start()
    for origin in (f"http://127.0.0.1:{port}", f"http://localhost:{port}"):
        st, headers, _ = _send(port, "GET", "/v1/models", {"Origin": origin})
        assert st == 200 and "Access-Control-Allow-Origin" not in headers
    for origin in ("http://localhost:3000", f"https://localhost:{port}", "null"):
        assert _send(port, "GET", "/v1/models", {"Origin": origin})[0] == 403, origin


def test_posts_that_are_not_json_are_415_in_the_apis_shape(start):
    port = start()
    for ctype in (None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        headers = {"Host": "127.0.0.1"} | ({"Content-Type": ctype} if ctype else {})
        st, _, body = _send(port, "POST", CHAT, headers, BODY)
        assert st == 415 and body["error"]["code"] == "unsupported_media_type", (ctype, body)
        assert "Content-Type: application/json" in body["error"]["message"]
        st, _, body = _send(port, "POST", "/v1/messages", headers, BODY)
        assert st == 415 and body["type"] == "error", body
    ok = {"Host": "127.0.0.1", "Content-Type": "Application/JSON; charset=utf-8"}
    st, _, body = _send(port, "POST", "/v1/messages/count_tokens", ok, BODY)
    assert st == 200 and body["input_tokens"] > 0


def test_allow_origin_lets_that_page_call_with_cors_answers(start):
    ui = "http://ui.example:3000"
    port = start(config=ServerConfig((ui + "/",)))
    st, headers, _ = _send(port, "GET", "/v1/models", {"Origin": ui})
    assert st == 200 and headers["Access-Control-Allow-Origin"] == ui
    asked = {
        "Origin": ui,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    st, headers, _ = _send(port, "OPTIONS", CHAT, asked)
    assert st == 204 and headers["Access-Control-Allow-Origin"] == ui
    assert headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert _send(port, "OPTIONS", CHAT, {**asked, "Origin": "http://evil.example"})[0] == 405
    assert _send(port, "GET", "/v1/models", {"Origin": "http://evil.example"})[0] == 403
    any_page = start(config=ServerConfig(("*",)))
    st, headers, _ = _send(any_page, "GET", "/v1/models", {"Origin": "http://evil.example"})
    assert st == 200 and headers["Access-Control-Allow-Origin"] == "http://evil.example"


def test_a_lan_bind_takes_any_host_but_still_checks_origins():
    lan = Access("0.0.0.0", 8080)
    lan.check({"Host": "192.168.1.7:8080"})
    lan.check({"Host": "my-mac.local:8080", "Origin": "http://localhost:8080"})
    with pytest.raises(Exception, match="forbidden|refused"):
        lan.check({"Host": "my-mac.local:8080", "Origin": "http://my-mac.local:8080"})
    named = Access("my-mac.local", 8080)  # bound by a name: that name is this server's
    named.check({"Host": "my-mac.local:8080"})
    loop = Access("127.0.0.1", 8080)
    with pytest.raises(Exception, match="is not this server's name"):
        loop.check({"Host": "my-mac.local:8080"})


def test_server_config_names_the_flag_and_the_fix():
    cfg = ServerConfig(("HTTP://UI.example:3000/", "*"), 2).validate(flags=True)
    assert cfg.allow_origins == ("http://ui.example:3000", "*")
    for origins, grace, want in (
        (("ui.example",), 5, "--allow-origin 'ui.example' is not an origin"),
        (("http://ui/chat",), 5, "is not an origin"),
        ((), -1, "--shutdown-grace must be in 0..3600"),
        ((), float("nan"), "--shutdown-grace must be in"),
        ((), 1e300, "--shutdown-grace must be in"),
    ):
        with pytest.raises(SettingError, match=want):
            ServerConfig(origins, grace).validate(flags=True)
    with pytest.raises(SettingError, match="^shutdown_grace must"):
        ServerConfig((), -1).validate()
