"""Images in the server's requests: OpenAI ``image_url`` parts, Anthropic ``image`` blocks and
Responses ``input_image`` parts, checked into ``Picture``s and ``{"type": "image"}`` parts.

Each is checked by ``vision.images`` (size, format, pixels from the header; docs/server.md
"Images"); the i-th ``{"type": "image"}`` part of the messages, in reading order, is
``CompletionRequest.images[i]``.

A ``data:`` URL (or Anthropic's base64 source) is always taken; an http(s) URL only with
``dflash serve --allow-image-urls``, fetched with a deadline, a byte cap enforced while
reading, an ``image/*`` content type and at most ``MAX_REDIRECTS`` redirects, never another
scheme. A declared media type (a ``data:`` URL's, Anthropic's ``media_type``) must name the
bytes' format; a fetched URL's bytes decide it (its server, not the client, labelled it).
Nothing here decodes pixels: a text-only model's refusal (``no_vision``) and the decode
are the engine's (``vision/request.py``). Every refusal is an ``APIError`` (each API puts
it in its own shape): 413 for an image too large, 503 when the decode budget stays full,
400 for the rest. No MLX; Pillow only when an image is sent.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
import urllib.parse
from typing import Any

from ..vision.images import (
    MEDIA_TYPES,
    ImageError,
    ImageLimits,
    Picture,
    declared,
    from_base64,
    from_bytes,
    from_data_url,
)
from .schema import APIError

IMAGE = {"type": "image"}  # a message part standing for the next picture
URL_SECONDS = 10.0  # the whole fetch of one image URL: connect, redirects, every byte
MAX_REDIRECTS = 3
URLS_OFF = "image URLs are off; send a data: URL or start the server with --allow-image-urls"
STATUS = {"too_large": 413, "busy": 503}  # every other kind: 400
CODES = {
    "invalid": "invalid_image",
    "too_large": "image_too_large",
    "too_many": "too_many_images",
    "not_allowed": "image_urls_off",
    "no_vision": "model_not_vision",
    "busy": "server_busy",
}


def api_error(e: ImageError, where: str | None = None, param: str | None = None) -> APIError:
    """The answer to an image refused: 413 when too large, else 400, the code its kind.

    Args:
        e: the refusal. where: the field at fault, put before the message. param: the
            request's top-level field (OpenAI's ``param``).
    """
    msg = f"{where}: {e}" if where else str(e)
    return APIError(STATUS.get(e.kind, 400), msg, param, CODES.get(e.kind, "invalid_image"))


class Gather:
    """The images of one request, in reading order.

    Args:
        limits: the sizes and count allowed. allow_urls: fetch http(s) image URLs.
        param: the request's field that holds the messages (for OpenAI's ``param``).
    """

    def __init__(
        self, limits: ImageLimits | None = None, allow_urls: bool = False, param: str = "messages"
    ):
        self.limits, self.allow_urls, self.param = limits or ImageLimits(), allow_urls, param
        self.pictures: list[Picture] = []
        self.seen = 0  # images decoded so far: counted before the next one is

    def _take(self, where: str, make) -> Picture:
        if self.seen >= self.limits.max_images:
            n = self.limits.max_images
            e = ImageError(
                f"more than {n} images in one request; at most {n} are taken "
                "(--max-images to change it)",
                "too_many",
            )
            raise api_error(e, where, self.param)
        self.seen += 1
        try:
            return make()
        except ImageError as e:
            raise api_error(e, where, self.param) from None

    def url(self, url: Any, where: str) -> Picture:
        """A picture from an image URL: ``data:`` always, http(s) with ``allow_urls``."""
        if not isinstance(url, str) or not url:
            raise APIError(400, f"{where} must be a data: URL or an http(s) URL", self.param)
        low = url[:8].lower()
        if low.startswith("data:"):
            return self._take(where, lambda: from_data_url(url, self.limits, "the image"))
        if not low.startswith(("http://", "https://")):
            e = ImageError("only data: and http(s) image URLs are taken", "not_allowed")
            raise api_error(e, where, self.param)
        if not self.allow_urls:
            raise api_error(ImageError(URLS_OFF, "not_allowed"), where, self.param)
        return self._take(where, lambda: from_bytes(fetch(url, self.limits), self.limits, url))

    def part(self, p: Any, where: str) -> dict | None:
        """``{"type": "image"}`` for an image part of a chat message (OpenAI's ``image_url``,
        or a picture another API's translation made), its picture kept; None otherwise."""
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == "image" and isinstance(p.get("picture"), Picture):
            self.pictures.append(p["picture"])
            return IMAGE
        if kind != "image_url":
            return None
        iu = p.get("image_url")
        url = iu.get("url") if isinstance(iu, dict) else iu
        self.pictures.append(self.url(url, f"{where}.image_url"))
        return IMAGE

    def anthropic(self, block: dict, where: str) -> dict:
        """A translated picture part of an Anthropic ``image`` block (base64 or url source)."""
        src = block.get("source")
        kind = src.get("type") if isinstance(src, dict) else None
        if kind == "url":
            return {"type": "image", "picture": self.url(src.get("url"), f"{where}.source.url")}
        if kind != "base64" or not isinstance(src.get("data"), str):
            raise APIError(
                400, f"{where}.source must be {{'type': 'base64', 'media_type', 'data'}}"
            )
        media = src.get("media_type")
        if media not in MEDIA_TYPES:
            raise APIError(
                400, f"{where}.source.media_type must be one of {', '.join(MEDIA_TYPES)}"
            )
        pic = self._take(where, lambda: from_base64(src["data"], self.limits, "the image"))
        try:
            return {"type": "image", "picture": declared(pic, media, "media_type")}
        except ImageError as e:  # the data URLs' rule (vision.images.declared)
            raise api_error(e, f"{where}.source") from None

    def responses(self, part: dict, where: str) -> dict:
        """A translated picture part of a Responses ``input_image`` part."""
        url = part.get("image_url")
        if url is None and part.get("file_id") is not None:
            raise APIError(
                400, f"{where}.file_id: files are not stored here; send image_url", "input"
            )
        return {"type": "image", "picture": self.url(url, f"{where}.image_url")}

    @staticmethod
    def content(parts: list) -> str | list:
        """A message's content from its text pieces (str) and ``IMAGE`` parts: the text
        joined when there is no image (today's text path), else text and image parts in
        order."""
        if all(isinstance(p, str) for p in parts):
            return "".join(parts)
        out: list[dict] = []
        for p in parts:
            if not isinstance(p, str):
                out.append(dict(p) if p is IMAGE else p)
            elif out and out[-1]["type"] == "text":
                out[-1]["text"] += p
            elif p:
                out.append({"type": "text", "text": p})
        return out


# ----------------------------------------------------------------------------- URLs


def fetch(url: str, limits: ImageLimits) -> bytes:
    """An image URL's bytes, read within ``URL_SECONDS`` (connecting, every redirect, the
    status line, the headers and every byte of the body) and ``limits.max_bytes``; at most
    ``MAX_REDIRECTS`` redirects are followed. The fetch runs in a thread the deadline
    abandons (its socket shut), so no server, however slowly it answers, holds it longer.

    Raises:
        ImageError: a malformed URL, unreachable, a malformed answer, an HTTP error, not
            ``image/*``, too many bytes, too slow, too many redirects, a redirect to
            another scheme; one line naming the URL.
    """
    seconds, shown = URL_SECONDS, _shown(url)
    deadline, conns, box = time.monotonic() + seconds, [], {}

    def run():
        try:
            box["data"] = _follow(url, limits.max_bytes, deadline, conns)
        except Exception as e:  # noqa: BLE001 (handed to the caller's thread, raised there)
            box["error"] = e

    t = threading.Thread(target=run, name="dflash-image-url", daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        for c in conns:
            _abort(c)
        raise ImageError(f"{shown} took over {seconds:g} s to fetch; send a data: URL")
    err = box.get("error")
    if isinstance(err, (OSError, http.client.HTTPException, ValueError)) and not isinstance(
        err, ImageError
    ):
        raise ImageError(f"cannot fetch {shown} ({_reason(err)})") from None
    if err is not None:
        raise err
    return box["data"]


def _shown(url: str) -> str:
    """The URL as messages show it: quoted when it holds a space or a control character."""
    cut = url[:200] + ("..." if len(url) > 200 else "")
    return cut if cut.isprintable() and " " not in cut else repr(cut)


def _reason(e: BaseException) -> str:
    """One line of an exception: http.client's class names say what was malformed."""
    text = str(getattr(e, "reason", None) or e).splitlines()
    head = text[0][:120] if text else ""
    return f"{type(e).__name__}: {head}" if head else type(e).__name__


def _abort(conn) -> None:
    """Wake a thread blocked reading ``conn`` (its socket shut both ways)."""
    sock = getattr(conn, "sock", None)
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _target(url: str) -> tuple[str, str, int | None, str]:
    """(scheme, host, port, request target) of an http(s) URL.

    Raises:
        ImageError: another scheme, no host, a bad port or IPv6 literal, a space or a
            control character.
    """
    shown = _shown(url)
    if any(c <= " " or c == "\x7f" for c in url):
        raise ImageError(f"{shown} holds a space or a control character; percent-encode it")
    try:
        sp = urllib.parse.urlsplit(url)
        port = sp.port  # a port that is not a number in 0..65535 raises here
    except ValueError as e:
        raise ImageError(f"{shown} is not a valid URL ({e})") from None
    if sp.scheme.lower() not in ("http", "https") or not sp.hostname:
        raise ImageError(f"{shown} is not an http(s) URL with a host")
    path = sp.path or "/"
    target = urllib.parse.quote(path + ("?" + sp.query if sp.query else ""), safe=_SAFE)
    return sp.scheme.lower(), sp.hostname, port, target


_SAFE = "!#$%&'()*+,/:;=?@[]~"  # kept as they are in a request target; the rest encoded


def _follow(url: str, cap: int, deadline: float, conns: list) -> bytes:
    """GET ``url``, following at most ``MAX_REDIRECTS`` redirects, within the deadline."""
    first = _shown(url)
    for _ in range(MAX_REDIRECTS + 1):
        scheme, host, port, target = _target(url)
        kind = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
        conn = kind(host, port, timeout=max(0.05, deadline - time.monotonic()))
        conns.append(conn)
        try:
            conn.request("GET", target, headers=HEADERS)
            r = conn.getresponse()
            if r.status in REDIRECTS:
                url = _next(url, r.getheader("Location"), first, r.status)
                continue
            if r.status != 200:
                raise ImageError(f"cannot fetch {first} (HTTP {r.status})")
            ctype = r.headers.get_content_type()
            if not ctype.startswith("image/"):
                raise ImageError(f"{first} is {ctype}, not an image")
            return _read(r, first, cap)
        finally:
            conn.close()
    raise ImageError(f"cannot fetch {first} (over {MAX_REDIRECTS} redirects)")


HEADERS = {"User-Agent": "dflash-mlx", "Accept": "image/*"}
REDIRECTS = (301, 302, 303, 307, 308)


def _next(url: str, location: str | None, first: str, status: int) -> str:
    """Where a redirect goes: http(s) only."""
    if not location:
        raise ImageError(f"cannot fetch {first} (HTTP {status} without a Location)")
    new = urllib.parse.urljoin(url, location.strip())
    if not new.lower().startswith(("http://", "https://")):
        raise ImageError(f"{first} redirects away from http(s) (to {_shown(new[:80])})")
    return new


def _read(r, url: str, cap: int) -> bytes:
    """The body, refused past ``cap`` bytes (announced or read)."""
    length = r.headers.get("Content-Length")
    if length and length.isdigit() and int(length) > cap:
        raise ImageError(
            f"{url} is {int(length):,} bytes; at most {cap:,} are taken (--max-image-bytes)",
            "too_large",
        )
    data = bytearray()
    while chunk := r.read1(1 << 16):
        data += chunk
        if len(data) > cap:
            raise ImageError(
                f"{url} is over {cap:,} bytes; at most {cap:,} are taken (--max-image-bytes)",
                "too_large",
            )
    return bytes(data)
