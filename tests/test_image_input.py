"""Images at the door (``vision/images.py``): every format taken, and every bad input refused
with its kind before anything large is decoded. Pillow only; no mlx-vlm needed."""

from __future__ import annotations

import base64
import hashlib
import time

import pytest

PIL = pytest.importorskip("PIL", reason="images need Pillow (pip install -e '.[vision]')")
from image_helpers import encoded, png_declaring

from dflash_mlx.vision.images import (
    ImageError,
    ImageLimits,
    Picture,
    from_base64,
    from_bytes,
    from_data_url,
    from_path,
    read,
    read_all,
)


def kind_of(fn, *args) -> tuple[str, str]:
    with pytest.raises(ImageError) as e:
        fn(*args)
    return e.value.kind, str(e.value)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_each_supported_format_decodes_to_rgb_with_its_size_and_hash(fmt):
    data = encoded(fmt)
    pic = from_bytes(data)
    assert (pic.format, pic.width, pic.height) == (fmt, 8, 6)
    assert pic.pil().mode == "RGB" and pic.pil().size == (8, 6)
    assert pic.sha256 == hashlib.sha256(data).hexdigest()


def test_a_palette_or_grey_image_is_converted_to_rgb():
    pic = from_bytes(encoded("PNG", mode="L"))
    assert pic.pil().mode == "RGB"


def test_empty_and_non_images_are_invalid():
    assert kind_of(from_bytes, b"")[0] == "invalid"
    kind, msg = kind_of(from_bytes, b"hello, this is text and not an image")
    assert kind == "invalid" and "PNG, JPEG, WebP or GIF" in msg


@pytest.mark.parametrize("fmt", ["TIFF", "BMP"])
def test_unsupported_formats_are_refused_by_their_magic(fmt):
    kind, msg = kind_of(from_bytes, encoded(fmt))
    assert kind == "invalid" and "not a supported image" in msg


def test_a_truncated_or_corrupt_file_is_refused_when_decoded():
    data = encoded("PNG", size=(64, 64))
    kind, msg = kind_of(from_bytes, data[: len(data) // 2])
    assert kind == "invalid" and "not a readable PNG" in msg
    jpeg = bytearray(encoded("JPEG", size=(64, 64)))
    jpeg[20:] = b"\x00" * (len(jpeg) - 20)
    assert kind_of(from_bytes, bytes(jpeg))[0] == "invalid"


def test_too_many_bytes_is_too_large_before_anything_is_read():
    data = encoded("PNG")
    kind, msg = kind_of(from_bytes, data, ImageLimits(max_bytes=len(data) - 1))
    assert kind == "too_large" and "--max-image-bytes" in msg


@pytest.mark.parametrize("side", [5000, 30000])
def test_a_decompression_bomb_is_refused_from_its_header(side):
    bomb = png_declaring(side, side)
    assert len(bomb) < 200
    t = time.perf_counter()
    kind, msg = kind_of(from_bytes, bomb)
    assert time.perf_counter() - t < 1.0  # nothing was decoded
    assert kind == "too_large" and "pixels" in msg


def test_the_pixel_limit_counts_width_times_height():
    data = encoded("PNG", size=(10, 10))
    assert from_bytes(data, ImageLimits(max_pixels=100)).width == 10
    kind, msg = kind_of(from_bytes, data, ImageLimits(max_pixels=99))
    assert kind == "too_large" and "10x10" in msg and "--max-image-pixels" in msg


def test_base64_with_or_without_padding_and_line_breaks():
    data = encoded("PNG")
    b64 = base64.b64encode(data).decode()
    assert from_base64(b64).data == data
    assert from_base64(b64.rstrip("=")).data == data
    wrapped = "\n".join(b64[i : i + 76] for i in range(0, len(b64), 76))
    assert from_base64(wrapped).data == data


def test_bad_base64_and_oversized_base64_are_refused():
    assert kind_of(from_base64, "not*base64!")[0] == "invalid"
    big = base64.b64encode(b"\0" * 4000).decode()
    assert kind_of(from_base64, big, ImageLimits(max_bytes=1000))[0] == "too_large"


def test_data_urls():
    data = encoded("JPEG")
    url = "data:image/jpeg;base64," + base64.b64encode(data).decode()
    assert from_data_url(url).format == "JPEG"
    for bad in ("data:image/png,rawbytes", "image/png;base64,AAAA", "data:image/png;base64"):
        kind, msg = kind_of(from_data_url, bad)
        assert kind == "invalid" and "data URL" in msg


def test_a_data_url_whose_media_type_is_not_an_image_is_refused():
    url = "data:text/plain;base64," + base64.b64encode(encoded("PNG")).decode()
    kind, msg = kind_of(from_data_url, url)
    assert kind == "invalid" and "text/plain" in msg


def test_files_and_read_of_each_source(tmp_path):
    data = encoded("GIF")
    f = tmp_path / "a.gif"
    f.write_bytes(data)
    pic = from_path(f)
    assert read(pic) is pic and read(data).sha256 == pic.sha256 == read(str(f)).sha256
    assert kind_of(from_path, tmp_path / "missing.png")[0] == "invalid"
    kind, msg = kind_of(from_path, f, ImageLimits(max_bytes=10))
    assert kind == "too_large" and "--max-image-bytes" in msg
    assert kind_of(read, 42)[0] == "invalid"


def test_read_all_counts_before_decoding():
    data = encoded("PNG")
    assert read_all(None) == []
    assert [p.format for p in read_all(data)] == ["PNG"]
    assert all(isinstance(p, Picture) for p in read_all([data, data]))
    kind, msg = kind_of(read_all, [b"junk"] * 3, ImageLimits(max_images=2))
    assert kind == "too_many" and "--max-images" in msg  # counted before the junk is read


@pytest.mark.parametrize("field", ["max_pixels", "max_bytes", "max_images"])
def test_limits_must_be_positive_whole_numbers(field):
    with pytest.raises(ImageError) as e:
        ImageLimits(**{field: 0}).validate(flags=True)
    assert "--max-image" in str(e.value)
    assert ImageLimits().validate() == ImageLimits()
