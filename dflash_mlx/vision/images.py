"""Images at the door: bytes from a file, base64 or a ``data:`` URL checked before anything
decodes them (size, format by its magic bytes, pixel count from the header, a PNG's chunk
CRCs), decoded only when the model's processor takes them (``Picture.pil``, EXIF orientation
applied as mlx-vlm's ``load_image`` does), under a budget of pixels decoded at once across
every request (``PixelBudget``). Pillow only; nothing here imports MLX or mlx-vlm.

A decompression bomb (a small file declaring a huge canvas) is refused from its header,
before a pixel is decoded; a corrupt or truncated file is refused when it is decoded.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import struct
import sys
import zlib
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
# a declared media type (data: URL, Anthropic's media_type, a fetched Content-Type) must
# name the bytes' format: one rule for every API
MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/gif": "GIF", "image/webp": "WEBP"}
MAX_PIXELS = 4096 * 4096  # per image; a model's processor resizes further
MAX_BYTES = 20 * 1024 * 1024
MAX_IMAGES = 8  # per request
MAX_DECODED = MAX_IMAGES * MAX_PIXELS  # pixels decoded at once, all requests (~1 GB)
# what a limit may be set to: beyond these a flag would make the body limit or a decode
# unbounded (Pillow itself refuses over 2 x 89.5 M pixels as a bomb)
_LIMIT_NAMES = (
    ("max_pixels", "--max-image-pixels", 16384 * 8192),
    ("max_bytes", "--max-image-bytes", 1 << 30),
    ("max_images", "--max-images", 256),
)


class ImageError(DFlashError):
    """An image that cannot be taken; ``kind`` says why, for the server's status code:
    ``invalid`` (not an image, corrupt, unsupported format), ``too_large`` (bytes or
    pixels), ``too_many``, ``not_allowed`` (a URL when URLs are off), ``no_vision`` (a
    text-only model), ``busy`` (the decode budget stayed full)."""

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
        max_decoded: pixels decoded at once across every request (``vision.budget``;
            None: ``decoded``'s default).
    """

    max_pixels: int = MAX_PIXELS
    max_bytes: int = MAX_BYTES
    max_images: int = MAX_IMAGES
    max_decoded: int | None = None  # pixels decoded at once, all requests (None: ``decoded``)

    @property
    def decoded(self) -> int:
        """The pixels decoded at once across requests: ``max_decoded``, or one request at
        its limits (``max_images`` x ``max_pixels``) up to ``MAX_DECODED``, never under
        one image at ``max_pixels``."""
        full = min(self.max_images * self.max_pixels, MAX_DECODED)
        return self.max_decoded or max(self.max_pixels, full)

    def validate(self, flags: bool = False) -> ImageLimits:
        """Check that each limit is a whole number in its range; return self.

        Args:
            flags: name the limits by their ``dflash serve`` flags in messages.

        Raises:
            ImageError: naming the limit and the value.
        """
        for name, flag, top in _LIMIT_NAMES:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= top:
                shown = flag if flags else name
                raise ImageError(f"{shown} must be a whole number in 1..{top:,} (got {v!r})")
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
    positions), its format and its size from the header; its pixels are decoded only when
    asked (``pil``), and not kept. A Pillow image given as it is keeps that image."""

    data: bytes = field(repr=False)
    sha256: str
    format: str
    width: int
    height: int
    image: object = field(default=None, repr=False, compare=False)  # a given PIL image, RGB

    @property
    def pixels(self) -> int:
        return self.width * self.height

    def pil(self, name: str = "image"):
        """The decoded RGB image (a ``PIL.Image.Image``), EXIF orientation applied.

        Raises:
            ImageError: a corrupt or truncated file.
        """
        if self.image is not None:
            return self.image
        from PIL import Image

        try:
            with Image.open(io.BytesIO(self.data), formats=[self.format]) as im:
                return _decode(im)
        except Image.DecompressionBombError:
            raise ImageError(f"{name} declares too many pixels (a decompression bomb)", "too_large")
        except (OSError, ValueError, SyntaxError) as exc:
            raise ImageError(
                f"{name} is not a readable {self.format} image ({_why(exc)})"
            ) from None


def _format(data: bytes, name: str) -> str:
    for magic, fmt, _ in _MAGIC:
        if data.startswith(magic):
            return fmt
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    raise ImageError(f"{name} is not a supported image (send {SUPPORTED})")


def _too_many_pixels(name: str, w: int, h: int, limits: ImageLimits) -> None:
    if w * h > limits.max_pixels:
        raise ImageError(
            f"{name} is {w}x{h} = {w * h:,} pixels; at most {limits.max_pixels:,} are "
            "taken (--max-image-pixels to change it)",
            "too_large",
        )


def from_bytes(data: bytes, limits: ImageLimits = ImageLimits(), name: str = "image") -> Picture:
    """Check one image's encoded bytes without decoding its pixels.

    Args:
        data: the file's bytes. limits: the sizes allowed. name: how errors call it.

    Raises:
        ImageError: empty, too many bytes, not PNG/JPEG/WebP/GIF, more pixels than
            ``limits.max_pixels`` (read from the header), a PNG chunk that is cut short
            or fails its CRC, an unreadable header.
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
    if fmt == "PNG":
        _png_chunks(data, name)
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data), formats=[fmt]) as im:  # reads the header only
            w, h = im.size
            _too_many_pixels(name, w, h, limits)
            # a JPEG's or WebP's EXIF is in its header (a PNG's may follow its pixels)
            if fmt != "PNG" and _orientation(im) in (5, 6, 7, 8):
                w, h = h, w  # shown turned a quarter: the size the model sees
    except ImageError:
        raise
    except Image.DecompressionBombError:  # Pillow's own bound, past ours
        raise ImageError(f"{name} declares too many pixels (a decompression bomb)", "too_large")
    except (OSError, ValueError, SyntaxError) as exc:
        raise ImageError(f"{name} is not a readable {fmt} image ({_why(exc)})") from None
    return Picture(data, hashlib.sha256(data).hexdigest(), fmt, w, h)


def _png_chunks(data: bytes, name: str) -> None:
    """Every PNG chunk up to IEND whole and matching its CRC (Pillow skips the IDAT
    chunks' CRCs, so a damaged file would decode to other pixels unnoticed)."""
    view, at = memoryview(data), 8
    while at + 12 <= len(data):
        size = int.from_bytes(view[at : at + 4], "big")
        kind, end = bytes(view[at + 4 : at + 8]), at + 12 + size
        if end > len(data):
            break
        if zlib.crc32(view[at + 4 : end - 4]) != int.from_bytes(view[end - 4 : end], "big"):
            why = f"its {kind.decode('latin-1')} chunk fails its CRC check"
            raise ImageError(f"{name} is not a readable PNG image ({why})")
        if kind == b"IEND":
            return
        at = end
    raise ImageError(f"{name} is not a readable PNG image (truncated before its IEND chunk)")


def _decode(im):
    """Every pixel of the first frame, turned as its EXIF orientation says, as RGB (as
    mlx-vlm's ``load_image``; a truncated file raises here)."""
    from PIL import ImageOps

    im.seek(0)
    im.load()
    if _orientation(im) not in (1, None):  # else exif_transpose would only copy every pixel
        im = ImageOps.exif_transpose(im)
    return im.convert("RGB")


def _orientation(im):
    """The EXIF Orientation tag (0x0112), 1 when there is none or the EXIF is unreadable."""
    try:
        return im.getexif().get(0x0112, 1)
    except (OSError, ValueError, SyntaxError, KeyError, IndexError, TypeError, struct.error):
        return 1


def _why(exc: BaseException) -> str:
    text = str(exc).split(" <_io.")[0]  # Pillow names the in-memory file object
    return text.splitlines()[0][:120] if text else type(exc).__name__


def from_pil(image, limits: ImageLimits = ImageLimits()) -> Picture:
    """A Pillow image given as it is, taken as mlx-vlm takes one (EXIF orientation applied,
    then RGB); its key is the SHA-256 of those pixels.

    Raises:
        ImageError: more pixels than ``limits.max_pixels``; pixels that cannot be read.
    """
    from PIL import Image

    _too_many_pixels("the PIL image", *image.size, limits)
    try:
        rgb = _decode(image)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise ImageError(f"the PIL image cannot be read ({_why(exc)})") from None
    digest = hashlib.sha256(b"%dx%d:" % rgb.size + rgb.tobytes()).hexdigest()
    return Picture(b"", digest, image.format or "PIL", *rgb.size, image=rgb)


def from_path(path: str | Path, limits: ImageLimits = ImageLimits()) -> Picture:
    """Check an image file (never more than ``limits.max_bytes`` + 1 bytes are read).

    Args:
        path: the file. limits: the sizes allowed.
    """
    try:
        p = Path(path).expanduser()
        if not p.is_file():
            raise ImageError(f"no image file at {path}: give the path of a {SUPPORTED} file")
        with p.open("rb") as f:
            data = f.read(limits.max_bytes + 1)
    except ImageError:
        raise
    except (OSError, RuntimeError, ValueError) as e:  # EIO, a user with no home, a NUL
        why = getattr(e, "strerror", None) or str(e) or type(e).__name__
        raise ImageError(f"cannot read the image file {path} ({why})") from None
    if len(data) > limits.max_bytes:
        raise ImageError(
            f"{path} is over {limits.max_bytes:,} bytes; at most {limits.max_bytes:,} are "
            "taken (--max-image-bytes to change it)",
            "too_large",
        )
    return from_bytes(data, limits, name=str(path))


def from_base64(text: str, limits: ImageLimits = ImageLimits(), name: str = "image") -> Picture:
    """Check a base64 image (its encoded length is checked before decoding).

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


def declared(pic: Picture, media: str, name: str = "image") -> Picture:
    """``pic`` when ``media`` (a declared media type) names its format.

    Raises:
        ImageError: another image type, or one we do not take.
    """
    media = media.split(";")[0].strip().lower()
    if media == "image/jpg":  # a common spelling of image/jpeg
        media = "image/jpeg"
    if MEDIA_TYPES.get(media) != pic.format:
        taken = ", ".join(MEDIA_TYPES)
        why = "" if media in MEDIA_TYPES else f" ({taken} are taken)"
        raise ImageError(f"{name} says {media}{why} but the data is {pic.format}; fix one")
    return pic


def from_data_url(url: str, limits: ImageLimits = ImageLimits(), name: str = "image") -> Picture:
    """Check a ``data:image/...;base64,...`` URL; its media type must name the format.

    Args:
        url: the URL. limits: the sizes allowed. name: how errors call it.
    """
    head, sep, body = url.partition(",")
    if not sep or not head.startswith("data:") or not head.endswith(";base64"):
        raise ImageError(f"{name} is not a base64 data URL (data:image/png;base64,...)")
    media = head[5:].split(";")[0].strip().lower()
    if not media.startswith("image/"):  # a data URL of text, say: not an image
        raise ImageError(
            f"{name} is a data URL of {media or 'no media type'}, not an image; send {SUPPORTED}"
        )
    return declared(from_base64(body, limits, name), media, "the data URL")


def read(source, limits: ImageLimits = ImageLimits()) -> Picture:
    """One image from what the Python API or the CLI was given.

    Args:
        source: a ``Picture``, a ``PIL.Image.Image``, the file's ``bytes``, a ``data:``
            URL, or a path. limits: the sizes allowed.
    """
    if isinstance(source, Picture):
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        return from_bytes(bytes(source), limits)
    if isinstance(source, str) and source.startswith("data:"):
        return from_data_url(source, limits)
    if isinstance(source, (str, Path)):
        return from_path(source, limits)
    if _is_pil(source):
        return from_pil(source, limits)
    raise ImageError(
        "each of images must be a path, bytes, a data: URL or a PIL image "
        f"(got {type(source).__name__})"
    )


def _is_pil(x) -> bool:
    pil = sys.modules.get("PIL.Image")  # imported already when x is one
    return pil is not None and isinstance(x, pil.Image)


def read_all(sources, limits: ImageLimits = ImageLimits()) -> list[Picture]:
    """``read`` each of ``sources`` after checking their number.

    Args:
        sources: a list or tuple of what ``read`` takes, or one of them (None: no
            images). limits: the sizes allowed.

    Raises:
        ImageError: images of another type (one line naming ``images``), a bad image.
    """
    if sources is None:
        return []
    if isinstance(sources, (str, bytes, bytearray, Path, Picture)) or _is_pil(sources):
        sources = [sources]
    if not isinstance(sources, (list, tuple)):
        raise ImageError(
            "images must be a list of images (paths, bytes, data: URLs or PIL images) "
            f"or one image (got {type(sources).__name__})"
        )
    if not all(isinstance(s, Picture) for s in sources):  # Pictures were checked when made
        limits.count(len(sources))
    return [read(s, limits) for s in sources]
