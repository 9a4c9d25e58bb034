"""Images at the door: bytes from a file, base64 or a ``data:`` URL checked before anything
decodes them (size, format by its magic bytes, pixel count from the header), then decoded
once, fully, into RGB. Pillow only; nothing here imports MLX or mlx-vlm.

A decompression bomb (a small file declaring a huge canvas) is refused from its header,
before a pixel is decoded; a corrupt or truncated file is refused when it is decoded.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DFlashError

# (magic prefix, Pillow's format name, what a person calls it)
_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "PNG", "PNG"),
    (b"\xff\xd8\xff", "JPEG", "JPEG"),
    (b"GIF87a", "GIF", "GIF"),
    (b"GIF89a", "GIF", "GIF"),
)
SUPPORTED = "PNG, JPEG, WebP or GIF"
MAX_PIXELS = 4096 * 4096  # per image; a model's processor resizes further
MAX_BYTES = 20 * 1024 * 1024
MAX_IMAGES = 8  # per request
_LIMIT_NAMES = (
    ("max_pixels", "--max-image-pixels"),
    ("max_bytes", "--max-image-bytes"),
    ("max_images", "--max-images"),
)


class ImageError(DFlashError):
    """An image that cannot be taken; ``kind`` says why, for the server's status code:
    ``invalid`` (not an image, corrupt, unsupported format), ``too_large`` (bytes or
    pixels), ``too_many``, ``not_allowed`` (a URL when URLs are off), ``no_vision`` (a
    text-only model)."""

    def __init__(self, message: str, kind: str = "invalid"):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class ImageLimits:
    """What one request may send.

    Args:
        max_pixels: width x height of one image, read from its header before decoding.
        max_bytes: one image's encoded size.
        max_images: images in one request.
    """

    max_pixels: int = MAX_PIXELS
    max_bytes: int = MAX_BYTES
    max_images: int = MAX_IMAGES

    def validate(self, flags: bool = False) -> ImageLimits:
        """Check that each limit is a whole number >= 1; return self.

        Args:
            flags: name the limits by their ``dflash serve`` flags in messages.

        Raises:
            ImageError: naming the limit and the value.
        """
        for name, flag in _LIMIT_NAMES:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                shown = flag if flags else name
                raise ImageError(f"{shown} must be a whole number >= 1 (got {v!r})")
        return self

    def count(self, n: int) -> None:
        """Refuse more than ``max_images`` images in one request."""
        if n > self.max_images:
            raise ImageError(
                f"{n} images in one request; at most {self.max_images} are taken "
                "(--max-images to change it)",
                "too_many",
            )


@dataclass(frozen=True)
class Picture:
    """One checked image: its encoded bytes, their SHA-256 (the prompt cache's key for its
    positions), its format and size, and its pixels decoded once as RGB."""

    data: bytes = field(repr=False)
    sha256: str
    format: str
    width: int
    height: int
    image: object = field(repr=False, compare=False)  # PIL.Image.Image, RGB

    def pil(self):
        """The decoded RGB image (a ``PIL.Image.Image``)."""
        return self.image


def _format(data: bytes, name: str) -> str:
    for magic, fmt, _ in _MAGIC:
        if data.startswith(magic):
            return fmt
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    raise ImageError(f"{name} is not a supported image (send {SUPPORTED})")


def from_bytes(data: bytes, limits: ImageLimits = ImageLimits(), name: str = "image") -> Picture:
    """Check and decode one image's encoded bytes.

    Args:
        data: the file's bytes. limits: the sizes allowed. name: how errors call it.

    Raises:
        ImageError: empty, too many bytes, not PNG/JPEG/WebP/GIF, more pixels than
            ``limits.max_pixels`` (read from the header, before decoding), or corrupt.
    """
    if not data:
        raise ImageError(f"{name} is empty")
    if len(data) > limits.max_bytes:
        raise ImageError(
            f"{name} is {len(data):,} bytes; at most {limits.max_bytes:,} are taken "
            "(--max-image-bytes to change it)",
            "too_large",
        )
    fmt = _format(data, name)
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data), formats=[fmt]) as im:  # reads the header only
            w, h = im.size
            if w * h > limits.max_pixels:
                raise ImageError(
                    f"{name} is {w}x{h} = {w * h:,} pixels; at most {limits.max_pixels:,} are "
                    "taken (--max-image-pixels to change it)",
                    "too_large",
                )
            rgb = _decode(im)
    except ImageError:
        raise
    except Image.DecompressionBombError:  # Pillow's own bound, past ours
        raise ImageError(f"{name} declares too many pixels (a decompression bomb)", "too_large")
    except (OSError, ValueError, SyntaxError) as exc:
        raise ImageError(f"{name} is not a readable {fmt} image ({_why(exc)})") from None
    return Picture(data, hashlib.sha256(data).hexdigest(), fmt, w, h, rgb)


def _decode(im):
    """Every pixel of the first frame, as RGB (a truncated file raises here)."""
    im.seek(0)
    im.load()
    return im.convert("RGB")


def _why(exc: BaseException) -> str:
    text = str(exc).split(" <_io.")[0]  # Pillow names the in-memory file object
    return text.splitlines()[0][:120] if text else type(exc).__name__


def from_path(path: str | Path, limits: ImageLimits = ImageLimits()) -> Picture:
    """Check and decode an image file (the size is checked before the file is read).

    Args:
        path: the file. limits: the sizes allowed.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise ImageError(f"no image file at {path}: give the path of a {SUPPORTED} file")
    size = p.stat().st_size
    if size > limits.max_bytes:
        raise ImageError(
            f"{path} is {size:,} bytes; at most {limits.max_bytes:,} are taken "
            "(--max-image-bytes to change it)",
            "too_large",
        )
    return from_bytes(p.read_bytes(), limits, name=str(path))


def from_base64(text: str, limits: ImageLimits = ImageLimits(), name: str = "image") -> Picture:
    """Check and decode a base64 image (its encoded length is checked before decoding).

    Args:
        text: base64, standard alphabet, padding optional, line breaks allowed (MIME
            wraps lines). limits: the sizes allowed. name: how errors call it.
    """
    if any(c in text for c in "\r\n \t"):
        text = "".join(text.split())
    if len(text) > limits.max_bytes * 4 // 3 + 4:
        raise ImageError(
            f"{name} is over {limits.max_bytes:,} bytes; send a smaller image", "too_large"
        )
    try:
        data = base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{name} is not valid base64") from None
    return from_bytes(data, limits, name)


def from_data_url(url: str, limits: ImageLimits = ImageLimits(), name: str = "image") -> Picture:
    """Check and decode a ``data:image/...;base64,...`` URL.

    Args:
        url: the URL. limits: the sizes allowed. name: how errors call it.
    """
    head, sep, body = url.partition(",")
    if not sep or not head.startswith("data:") or not head.endswith(";base64"):
        raise ImageError(f"{name} is not a base64 data URL (data:image/png;base64,...)")
    media = head[5:].split(";")[0].strip().lower()
    if media and not media.startswith("image/"):  # a data URL of text, say: not an image
        raise ImageError(f"{name} is a data URL of {media}, not an image; send {SUPPORTED}")
    return from_base64(body, limits, name)


def read(source, limits: ImageLimits = ImageLimits()) -> Picture:
    """One image from what the Python API or the CLI was given.

    Args:
        source: a ``Picture``, the file's ``bytes``, a ``data:`` URL, or a path.
        limits: the sizes allowed.
    """
    if isinstance(source, Picture):
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        return from_bytes(bytes(source), limits)
    if isinstance(source, str) and source.startswith("data:"):
        return from_data_url(source, limits)
    if isinstance(source, (str, Path)):
        return from_path(source, limits)
    raise ImageError(f"an image must be a path, bytes or a data: URL (got {type(source).__name__})")


def read_all(sources, limits: ImageLimits = ImageLimits()) -> list[Picture]:
    """``read`` each of ``sources`` after checking their number.

    Args:
        sources: a sequence of what ``read`` takes (None: no images). limits: the sizes allowed.
    """
    if sources is None:
        return []
    if isinstance(sources, (str, bytes, Path, Picture)):
        sources = [sources]
    sources = list(sources)
    if not all(isinstance(s, Picture) for s in sources):  # Pictures were checked when made
        limits.count(len(sources))
    return [read(s, limits) for s in sources]
