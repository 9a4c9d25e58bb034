"""Small images for the tests of images in (Pillow): encoded files, data URLs, and a PNG
whose header declares a huge canvas (a decompression bomb of a few dozen bytes); ``post``
for the server tests that send them."""

from __future__ import annotations

import base64
import io
import json
import struct
import urllib.error
import urllib.request
import zlib


def encoded(fmt: str = "PNG", size=(8, 6), mode: str = "RGB", **kw) -> bytes:
    """An image of ``size`` encoded as ``fmt`` (any format Pillow writes)."""
    from PIL import Image

    im = Image.new(mode, size, (200, 30, 90) if mode == "RGB" else 1)
    buf = io.BytesIO()
    im.save(buf, format=fmt, **kw)
    return buf.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def png_declaring(width: int, height: int) -> bytes:
    """A few dozen bytes of PNG whose header declares ``width`` x ``height``."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def bad_idat_crc(data: bytes) -> bytes:
    """A PNG (``encoded``'s) with its first IDAT chunk's CRC flipped, its pixels intact."""
    at = data.index(b"IDAT") - 4
    end = at + 12 + struct.unpack(">I", data[at : at + 4])[0]
    return data[: end - 1] + bytes([data[end - 1] ^ 0xFF]) + data[end:]


def exif_rotated_jpeg(size=(64, 32)) -> bytes:
    """A JPEG of ``size`` whose EXIF Orientation is 6 (shown turned 90 degrees: 32x64)."""
    from PIL import Image

    im = Image.new("RGB", size, (10, 200, 30))
    im.paste((250, 0, 0), (0, 0, size[0] // 2, size[1] // 4))  # a corner marks the turn
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    im.save(buf, format="JPEG", exif=exif)
    return buf.getvalue()


def post(port: int, path: str, body: dict):
    """POST ``body`` as JSON to the local server: (status, the JSON answer), errors too."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), method="POST"
    )
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
