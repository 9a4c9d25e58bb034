"""Images at the door (``vision/images.py``): every format taken, and every bad input refused
with its kind before anything large is decoded. Pillow only; no mlx-vlm needed."""

from __future__ import annotations

import base64
import hashlib

import pytest

PIL = pytest.importorskip("PIL", reason="images need Pillow (pip install -e '.[vision]')")
from image_helpers import bad_idat_crc, encoded, exif_rotated_jpeg, png_declaring

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
    kind, msg = kind_of(from_bytes, data[: len(data) // 2])  # its chunks, before decoding
    assert kind == "invalid" and "not a readable PNG" in msg
    jpeg = bytearray(encoded("JPEG", size=(64, 64)))
    jpeg[200:] = b"\x00" * (len(jpeg) - 200)  # the header reads; the pixels do not
    pic = from_bytes(bytes(jpeg))
    kind, msg = kind_of(pic.pil, "b.jpg")
    assert kind == "invalid" and "b.jpg is not a readable JPEG" in msg


def test_a_png_whose_idat_crc_is_wrong_is_refused_though_pillow_would_decode_it():
    bad = bad_idat_crc(encoded("PNG", size=(16, 16)))
    from PIL import Image

    Image.open(__import__("io").BytesIO(bad)).load()  # Pillow's tolerance: it decodes
    kind, msg = kind_of(from_bytes, bad)
    assert kind == "invalid" and "IDAT chunk fails its CRC check" in msg


def test_exif_orientation_is_applied_as_mlx_vlm_does():
    load_image = pytest.importorskip("mlx_vlm.utils").load_image
    data = exif_rotated_jpeg((64, 32))
    pic = from_bytes(data)
    theirs = load_image(__import__("io").BytesIO(data))
    assert pic.pil().size == theirs.size == (pic.width, pic.height) == (32, 64)
    assert pic.pil().tobytes() == theirs.tobytes()


def test_a_pil_image_is_taken_as_mlx_vlm_takes_it():
    from PIL import Image

    load_image = pytest.importorskip("mlx_vlm.utils").load_image
    data = exif_rotated_jpeg((64, 32))
    given = Image.open(__import__("io").BytesIO(data))
    pic = read(given)
    assert pic.pil().tobytes() == load_image(given).tobytes() and (pic.width, pic.height) == (
        32,
        64,
    )
    assert read(Image.new("L", (4, 4))).sha256 != read(Image.new("L", (4, 5))).sha256
    assert [p.format for p in read_all(Image.new("RGBA", (3, 3)))] == ["PIL"]
    assert (
        kind_of(read, Image.new("RGB", (200, 200)), ImageLimits(max_pixels=100))[0] == "too_large"
    )


@pytest.mark.parametrize("bad", [123, True, 1.5, {"a": 1}, iter([])])
def test_images_of_another_type_are_one_line_naming_images(bad):
    kind, msg = kind_of(read_all, bad)
    assert kind == "invalid" and msg.startswith("images must be") and type(bad).__name__ in msg
    kind, msg = kind_of(read_all, [bad])
    assert msg.startswith("each of images must be") and type(bad).__name__ in msg


@pytest.mark.parametrize(
    "path,why",
    [("/proc/self/mem", "Input/output error"), ("~dflash-no-such-user/x.png", "home directory")],
)
def test_an_unreadable_path_is_one_line_naming_it(path, why):
    kind, msg = kind_of(read_all, [path])
    assert kind == "invalid" and f"cannot read the image file {path}" in msg and why in msg


def test_a_declared_media_type_must_name_the_bytes_format():
    png = base64.b64encode(encoded("PNG")).decode()
    kind, msg = kind_of(from_data_url, "data:image/jpeg;base64," + png)
    assert kind == "invalid" and "says image/jpeg but the data is PNG" in msg
    assert kind_of(from_data_url, "data:image/bmp;base64," + png)[0] == "invalid"
    jpeg = base64.b64encode(encoded("JPEG")).decode()
    assert from_data_url("data:image/jpg;base64," + jpeg).format == "JPEG"  # a common spelling


def test_too_many_bytes_is_too_large_before_anything_is_read():
    data = encoded("PNG")
    kind, msg = kind_of(from_bytes, data, ImageLimits(max_bytes=len(data) - 1))
    assert kind == "too_large" and "--max-image-bytes" in msg


@pytest.mark.parametrize("side", [5000, 30000])
def test_a_decompression_bomb_is_refused_from_its_header(side, monkeypatch):
    from PIL import Image

    bomb = png_declaring(side, side)
    assert len(bomb) < 200

    def decoded(*a, **k):
        raise AssertionError("the bomb's pixels were decoded")

    monkeypatch.setattr(Image.Image, "load", decoded)
    kind, msg = kind_of(from_bytes, bomb)
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
@pytest.mark.parametrize("value", [0, 99999999999999999999])
def test_limits_must_be_whole_numbers_in_their_range(field, value):
    with pytest.raises(ImageError) as e:
        ImageLimits(**{field: value}).validate(flags=True)
    assert "--max-image" in str(e.value) and "must be a whole number in 1.." in str(e.value)
    assert ImageLimits().validate() == ImageLimits()


def test_the_pixel_budget_bounds_the_pixels_decoded_at_once_across_threads():
    import threading

    from dflash_mlx.vision.budget import PixelBudget

    budget = PixelBudget(100, wait=0.2)
    with pytest.raises(ImageError) as e, budget.hold(101):
        pass
    assert e.value.kind == "too_large" and "at most 100 are decoded at once" in str(e.value)
    held, release = threading.Event(), threading.Event()

    def other_request():
        with budget.hold(60):
            held.set()
            release.wait(5)

    t = threading.Thread(target=other_request)
    t.start()
    held.wait(5)
    with pytest.raises(ImageError) as e, budget.hold(50):  # 60 + 50 > 100: waits, then busy
        pass
    assert e.value.kind == "busy" and budget.used == 60
    with budget.hold(40):
        assert budget.used == 100
    threading.Timer(0.05, release.set).start()
    budget.wait = 5
    with budget.hold(50):  # room once the other request is done with its pixels
        assert budget.used == 50
    t.join(5)
    assert budget.used == 0


def test_the_decode_budget_sits_inside_max_memory():
    from dflash_mlx.vision.budget import BYTES_PER_PIXEL, share_of

    limits = ImageLimits()
    assert (
        limits.decoded == limits.max_images * limits.max_pixels and share_of(None, limits) is None
    )
    assert ImageLimits(max_images=64).decoded == limits.decoded  # more images: not more memory
    assert ImageLimits(max_pixels=2**27).decoded == 2**27  # one image always fits
    assert share_of(4.0, limits) == int(4e9 / 10 / BYTES_PER_PIXEL)  # a tenth of it
    assert share_of(0.01, limits) == limits.max_pixels  # one image always fits
    assert share_of(1e6, limits) == limits.decoded  # never more than one full request
