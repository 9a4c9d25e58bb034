"""Image URLs (``server/images.fetch``), taken only with ``--allow-image-urls``: an image is
fetched; a page that is not an image, too many bytes (announced or not), a slow drip, a
redirect loop, a redirect to file:// and an HTTP error are each refused in one line, and
the server keeps answering. The URLs are served by a stdlib server in this process."""

from __future__ import annotations

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
