"""Image URLs (``server/images.fetch``), taken only with ``--allow-image-urls``: an image is
fetched; a page that is not an image, too many bytes (announced or not), a slow drip, a
redirect loop, a redirect to file:// and an HTTP error are each refused in one line, and
the server keeps answering. The URLs are served by a stdlib server in this process."""

from __future__ import annotations

import socketserver
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("PIL", reason="images need Pillow (pip install -e '.[vision]')")
from image_helpers import encoded, post

from dflash_mlx.server import images as server_images
from dflash_mlx.settings import ServerConfig
from dflash_mlx.vision.images import ImageError, ImageLimits

PNG = encoded("PNG")


class Site(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def log_message(self, *args):
        pass

    def _send(self, status: int, ctype: str, body: bytes, length: bool = True, **headers):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        if length:
            self.send_header("Content-Length", str(len(body)))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        route = {
            "/cat.png": lambda: self._send(200, "image/png", PNG),
            "/page": lambda: self._send(200, "text/html", b"<html>no</html>"),
            "/big.png": lambda: self._send(200, "image/png", b"\0" * 50_000),
            "/unsized.png": lambda: self._send(200, "image/png", b"\0" * 50_000, length=False),
            "/loop": lambda: self._send(302, "text/plain", b"", Location="/loop"),
            "/file": lambda: self._send(302, "text/plain", b"", Location="file:///etc/passwd"),
            "/moved": lambda: self._send(301, "text/plain", b"", Location="/cat.png"),
            "/r1": lambda: self._send(302, "text/plain", b"", Location="/cat.png"),
            "/r2": lambda: self._send(307, "text/plain", b"", Location="/r1"),
            "/r3": lambda: self._send(303, "text/plain", b"", Location="/r2"),
            "/r4": lambda: self._send(308, "text/plain", b"", Location="/r3"),
            "/slow.png": self._slow,
        }.get(self.path)
        if route is None:
            return self._send(404, "text/plain", b"nope")
        route()

    def _slow(self):
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.end_headers()
        for b in PNG:
            self.wfile.write(bytes([b]))
            self.wfile.flush()
            time.sleep(0.05)


@pytest.fixture(scope="module")
def site():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Site)
    httpd.daemon_threads = True
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch):
    for name in (
        "http_proxy",
        "https_proxy",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "all_proxy",
        "ALL_PROXY",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(server_images, "URL_SECONDS", 1.0)


LIMITS = ImageLimits(max_bytes=10_000)


def test_an_image_url_and_a_redirect_to_it_are_fetched(site):
    assert server_images.fetch(site + "/cat.png", LIMITS) == PNG
    assert server_images.fetch(site + "/moved", LIMITS) == PNG


def test_at_most_three_redirects_are_followed_exactly(site):
    assert server_images.MAX_REDIRECTS == 3  # docs/server.md says "at most 3"
    assert server_images.fetch(site + "/r3", LIMITS) == PNG  # r3 -> r2 -> r1 -> cat.png
    with pytest.raises(ImageError, match="over 3 redirects"):
        server_images.fetch(site + "/r4", LIMITS)


ANSWERS = {  # what the hostile server sends for each path
    "/garbage": b"GARBAGE\r\n\r\n",
    "/long-header": b"HTTP/1.1 200 OK\r\nX-Long: " + b"a" * 70_000 + b"\r\n\r\n",
    "/bad-chunks": b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n10\r\nshort\r\nZZ\r\n",
    "/drip-status": b"HTTP/1.1 200 OK\r\n" * 100,  # one byte at a time, never ending
    "/drip-headers": None,
}


class Hostile(socketserver.BaseRequestHandler):
    """A server that answers each path with raw bytes, however malformed, or drips them."""

    def handle(self):
        line = self.request.makefile("rb").readline().split()
        path = line[1].decode() if len(line) > 1 else "/"
        answer = ANSWERS.get(path)
        try:
            if path.startswith("/drip"):
                if answer is None:
                    self.request.sendall(b"HTTP/1.1 200 OK\r\n")
                    answer = b"X-Slow: yes\r\n" * 100
                for b in answer[:60]:  # 60 bytes over 6 s: past the 1 s deadline
                    self.request.sendall(bytes([b]))
                    time.sleep(0.1)
            else:
                self.request.sendall(answer or b"HTTP/1.1 404 Not Found\r\n\r\n")
        except OSError:  # the client gave up: that is the point
            pass


@pytest.fixture(scope="module")
def hostile():
    srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Hostile)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


MALFORMED = [
    ("http://127.0.0.1:abc/x.png", "not a valid URL"),
    ("http://[::1/x.png", "not a valid URL"),
    ("http://127.0.0.1:1/a b.png", "space or a control character"),
    ("http://127.0.0.1:1/a\x01.png", "space or a control character"),
    ("http:///x.png", "with a host"),
]


@pytest.mark.parametrize("url,words", MALFORMED)
def test_a_malformed_url_is_refused_before_connecting(url, words):
    with pytest.raises(ImageError) as e:
        server_images.fetch(url, LIMITS)
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "path,words",
    [
        ("/garbage", "BadStatusLine"),
        ("/long-header", "LineTooLong"),
        ("/bad-chunks", "IncompleteRead"),
        ("/drip-status", "took over 1 s"),
        ("/drip-headers", "took over 1 s"),
    ],
)
def test_a_malformed_or_dripping_answer_is_refused_within_the_deadline(hostile, path, words):
    t = time.monotonic()
    with pytest.raises(ImageError) as e:
        server_images.fetch(hostile + path, LIMITS)
    assert time.monotonic() - t < 3  # the 1 s deadline covers the status line and headers
    assert e.value.kind == "invalid" and words in str(e.value), str(e.value)
    assert "\n" not in str(e.value) and path in str(e.value)


@pytest.mark.parametrize(
    "path,kind,words",
    [
        ("/page", "invalid", "text/html, not an image"),
        ("/big.png", "too_large", "50,000 bytes"),
        ("/unsized.png", "too_large", "over 10,000 bytes"),
        ("/slow.png", "invalid", "took over"),
        ("/loop", "invalid", "over 3 redirects"),
        ("/file", "invalid", "away from http(s)"),
        ("/missing.png", "invalid", "HTTP 404"),
    ],
)
def test_each_bad_url_is_refused_in_one_line(site, path, kind, words):
    t = time.monotonic()
    with pytest.raises(ImageError) as e:
        server_images.fetch(site + path, LIMITS)
    assert time.monotonic() - t < 5
    assert e.value.kind == kind and words in str(e.value) and "\n" not in str(e.value)


def test_an_unreachable_host_is_refused():
    with pytest.raises(ImageError, match="cannot fetch"):
        server_images.fetch("http://127.0.0.1:9/a.png", LIMITS)


def _post(port: int, url: str):
    part = {"type": "image_url", "image_url": {"url": url}}
    body = {"messages": [{"role": "user", "content": [part]}], "max_tokens": 2}
    return post(port, "/v1/chat/completions", body)


def test_the_server_fetches_urls_only_when_allowed(inproc, site):
    _, off = inproc(worker=False)
    st, out = _post(off, site + "/cat.png")
    assert st == 400 and out["error"]["code"] == "image_urls_off", out
    config = ServerConfig(allow_image_urls=True, image_limits=LIMITS)
    _, on = inproc(config=config)
    st, out = _post(on, site + "/cat.png")  # fetched, checked, then the text model's refusal
    assert st == 400 and out["error"]["code"] == "model_not_vision", out
    st, out = _post(on, site + "/big.png")
    assert st == 413 and out["error"]["code"] == "image_too_large", out
    st, out = _post(on, site + "/page")
    assert st == 400 and out["error"]["code"] == "invalid_image", out


def _bodies(url: str, stream: bool) -> dict:
    """The same image URL in each API's request shape."""
    msg = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}
    block = {"type": "image", "source": {"type": "url", "url": url}}
    part = {"type": "input_image", "image_url": url}
    return {
        "/v1/chat/completions": {"messages": [msg], "max_tokens": 2, "stream": stream},
        "/v1/messages": {
            "messages": [{"role": "user", "content": [block]}],
            "max_tokens": 2,
            "stream": stream,
        },
        "/v1/responses": {
            "input": [{"role": "user", "content": [part]}],
            "max_output_tokens": 2,
            "stream": stream,
        },
    }


def test_every_api_answers_a_hostile_url_4xx_in_its_shape_streaming_or_not(inproc, hostile):
    config = ServerConfig(allow_image_urls=True, image_limits=LIMITS)
    _, port = inproc(config=config)
    for url, words in [(hostile + "/garbage", "BadStatusLine"), (MALFORMED[0][0], "valid URL")]:
        for stream in (False, True):
            for path, body in _bodies(url, stream).items():
                st, out = post(port, path, body)
                assert st == 400, (path, stream, st, out)
                err = out["error"]
                if path == "/v1/messages":
                    assert out["type"] == "error" and err["type"] == "invalid_request_error"
                else:
                    assert err["code"] == "invalid_image" and err["type"] == "invalid_request_error"
                assert words in err["message"] and "\n" not in err["message"], out
    t = time.monotonic()
    st, out = _post(port, hostile + "/drip-status")
    assert st == 400 and "took over 1 s" in out["error"]["message"], out
    assert time.monotonic() - t < 3
    hi = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    st, out = post(port, "/v1/chat/completions", hi)
    assert st == 200, out  # and the server answers the next request
