"""Images in the server's requests: OpenAI ``image_url`` parts, Anthropic ``image`` blocks and
Responses ``input_image`` parts, checked into ``Picture``s and ``{"type": "image"}`` parts.

Each is checked by ``vision.images`` (size, format, pixels from the header; docs/server.md
"Images"); the i-th ``{"type": "image"}`` part of the messages, in reading order, is
``CompletionRequest.images[i]``.

A ``data:`` URL (or Anthropic's base64 source) is always taken; an http(s) URL only with
``dflash serve --allow-image-urls``, fetched with a deadline, a byte cap enforced while
reading, an ``image/*`` content type and at most ``MAX_REDIRECTS`` redirects, never another
scheme. A text-only model's refusal (``no_vision``) is the engine's
(``vision/request.py``). Every refusal is an ``APIError`` (each API puts it in its own shape): 413 for an image
too large, 400 for the rest. No MLX; Pillow only when an image is sent.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from typing import Any

from ..vision.images import ImageError, ImageLimits, Picture, from_base64, from_bytes, from_data_url
from .schema import APIError

IMAGE = {"type": "image"}  # a message part standing for the next picture
URL_SECONDS = 10.0  # the whole fetch of one image URL: connect, redirects, every byte
MAX_REDIRECTS = 3
URLS_OFF = "image URLs are off; send a data: URL or start the server with --allow-image-urls"
MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/gif": "GIF", "image/webp": "WEBP"}
STATUS = {"too_large": 413}  # every other kind: 400
CODES = {
    "invalid": "invalid_image",
    "too_large": "image_too_large",
    "too_many": "too_many_images",
    "not_allowed": "image_urls_off",
    "no_vision": "model_not_vision",
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
        if pic.format != MEDIA_TYPES[media]:
            e = ImageError(f"media_type says {media} but the data is {pic.format}; fix one")
            raise api_error(e, f"{where}.source")
        return {"type": "image", "picture": pic}

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


class _Redirects(urllib.request.HTTPRedirectHandler):
    """At most ``MAX_REDIRECTS`` redirects, each to http(s) only."""

    max_redirections = MAX_REDIRECTS

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if not newurl.lower().startswith(("http://", "https://")):
            raise ImageError(f"the image URL redirects to {newurl[:80]!r}; only http(s) is taken")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def fetch(url: str, limits: ImageLimits) -> bytes:
    """An image URL's bytes, read within ``URL_SECONDS`` and ``limits.max_bytes``.

    Raises:
        ImageError: unreachable, an HTTP error, not ``image/*``, too many bytes, too slow,
            too many redirects, a redirect to another scheme.
    """
    deadline = time.monotonic() + URL_SECONDS
    opener = urllib.request.build_opener(_Redirects())
    req = urllib.request.Request(url, headers={"User-Agent": "dflash-mlx", "Accept": "image/*"})
    try:
        with opener.open(req, timeout=URL_SECONDS) as r:
            ctype = r.headers.get_content_type()
            if not ctype.startswith("image/"):
                raise ImageError(f"{url} is {ctype}, not an image")
            return _read(r, url, limits.max_bytes, deadline)
    except ImageError:
        raise
    except urllib.error.HTTPError as e:
        redirect = f"over {MAX_REDIRECTS} redirects, or one away from http(s)"  # urllib refuses
        why = redirect if 300 <= e.code < 400 else f"HTTP {e.code}"
        raise ImageError(f"cannot fetch {url} ({why})") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        raise ImageError(f"cannot fetch {url} ({reason})") from None


def _read(r, url: str, cap: int, deadline: float) -> bytes:
    """The body, refused past ``cap`` bytes (announced or read) or past the deadline."""
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
        if time.monotonic() > deadline:
            raise ImageError(f"{url} took over {URL_SECONDS:g} s to fetch; send a data: URL")
    return bytes(data)
