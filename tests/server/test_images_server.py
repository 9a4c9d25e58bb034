"""Images over HTTP (``server/images.py``): each API's image parts become ``{"type": "image"}``
parts and pictures in reading order, and every bad image is a 4xx in that API's own shape
(413 too large, 400 the rest) while the server keeps answering. Served in this process on
the tiny text pair, so an image that passes every check ends at the model's own refusal
(``model_not_vision``): that answer proves the image was taken."""

from __future__ import annotations

import base64

import pytest

pytest.importorskip("PIL", reason="images need Pillow (pip install -e '.[vision]')")
from image_helpers import bad_idat_crc, data_url, encoded, png_declaring, post

from dflash_mlx.settings import ServerConfig
from dflash_mlx.vision.images import ImageLimits

CHAT, MESSAGES, RESPONSES = "/v1/chat/completions", "/v1/messages", "/v1/responses"


def png(size=(8, 6), fmt="PNG") -> bytes:
    return encoded(fmt, size)


BOMB = data_url(png_declaring(30000, 30000))


def chat(*parts) -> dict:
    return {"messages": [{"role": "user", "content": list(parts)}], "max_tokens": 2}


def image_url(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def anthropic_image(data: str, media="image/png") -> dict:
    return {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": media, "data": data},
                    },
                ],
            }
        ],
        "max_tokens": 2,
    }


def responses_image(url: str) -> dict:
    part = {"type": "input_image", "image_url": url}
    return {"input": [{"role": "user", "content": [part]}], "max_output_tokens": 2}


def still_answers(port: int) -> None:
    st, out = post(port, CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert st == 200 and out["choices"][0]["message"]["role"] == "assistant", out


def openai_error(st, out, status: int, code: str) -> str:
    assert st == status and set(out["error"]) == {"message", "type", "param", "code"}, out
    assert out["error"]["code"] == code and out["error"]["type"] == "invalid_request_error", out
    return out["error"]["message"]


GOOD = data_url(png())
BAD_CHAT = [
    (image_url(data_url(b"plain text, no image", "image/png")), 400, "invalid_image"),
    (image_url(data_url(png(fmt="TIFF"), "image/tiff")), 400, "invalid_image"),
    (image_url(data_url(png((64, 64))[:80])), 400, "invalid_image"),
    (image_url(data_url(bad_idat_crc(png()))), 400, "invalid_image"),
    (image_url(data_url(png(), "image/jpeg")), 400, "invalid_image"),  # Anthropic's rule too
    (image_url("data:image/png;base64,@@@@"), 400, "invalid_image"),
    (image_url(BOMB), 413, "image_too_large"),
    (image_url(data_url(png((200, 200)))), 413, "image_too_large"),  # over the pixel limit
    (image_url("https://example.com/cat.png"), 400, "image_urls_off"),
    (image_url("file:///etc/passwd"), 400, "image_urls_off"),
    (image_url(GOOD), 400, "model_not_vision"),  # every check passed: the model refuses
]


@pytest.mark.parametrize("part,status,code", BAD_CHAT)
def test_openai_chat_refuses_each_bad_image_in_its_shape(inproc, part, status, code):
    _, port = inproc(config=ServerConfig(image_limits=ImageLimits(max_pixels=10_000)))
    st, out = post(port, CHAT, chat({"type": "text", "text": "what is this?"}, part))
    msg = openai_error(st, out, status, code)
    assert out["error"]["param"] == "messages" and "\n" not in msg
    if code == "image_urls_off":
        assert "--allow-image-urls" in msg or "data:" in msg
    if code == "model_not_vision":
        assert "load a vision-language model" in msg
    still_answers(port)


def test_too_many_images_are_refused_before_the_extra_ones_are_decoded(inproc):
    _, port = inproc(config=ServerConfig(image_limits=ImageLimits(max_images=2)))
    junk = image_url("data:image/png;base64,AAAA")  # never decoded: the count comes first
    st, out = post(port, CHAT, chat(image_url(GOOD), image_url(GOOD), junk))
    assert "--max-images" in openai_error(st, out, 400, "too_many_images")
    still_answers(port)


@pytest.mark.parametrize(
    "data,media,status,words",
    [
        (base64.b64encode(png()).decode(), "image/jpeg", 400, "media_type says image/jpeg"),
        (base64.b64encode(png()).decode(), "image/tiff", 400, "media_type must be one of"),
        (base64.b64encode(bad_idat_crc(png())).decode(), "image/png", 400, "CRC check"),
        ("not base64!", "image/png", 400, "not valid base64"),
        (BOMB.split(",", 1)[1], "image/png", 413, "pixels"),
        (base64.b64encode(png()).decode(), "image/png", 400, "takes no images"),
    ],
)
def test_anthropic_image_blocks_are_checked_in_anthropics_shape(inproc, data, media, status, words):
    _, port = inproc()
    st, out = post(port, MESSAGES, anthropic_image(data, media))
    assert st == status and out["type"] == "error", out
    kind = "request_too_large" if status == 413 else "invalid_request_error"
    assert out["error"]["type"] == kind and words in out["error"]["message"], out
    assert "messages.0.content.1" in out["error"]["message"] or "takes no images" in words
    still_answers(port)


def test_anthropic_url_sources_follow_the_url_policy(inproc):
    _, port = inproc()
    body = anthropic_image("")
    body["messages"][0]["content"][1]["source"] = {"type": "url", "url": "https://x.example/a.png"}
    st, out = post(port, MESSAGES, body)
    assert st == 400 and "--allow-image-urls" in out["error"]["message"], out


@pytest.mark.parametrize(
    "url,status,code",
    [
        (GOOD, 400, "model_not_vision"),
        (BOMB, 413, "image_too_large"),
        (data_url(png(), "image/jpeg"), 400, "invalid_image"),
        ("http://x.example/a.png", 400, "image_urls_off"),
        (None, 400, None),
    ],
)
def test_responses_input_images_are_checked_in_openais_shape(inproc, url, status, code):
    _, port = inproc()
    st, out = post(port, RESPONSES, responses_image(url))
    assert st == status and out["error"]["param"] == "input", out
    assert code is None or out["error"]["code"] == code, out
    assert "input[0].content[0]" in out["error"]["message"] or code == "model_not_vision"
    still_answers(port)


def test_count_tokens_refuses_images_for_a_text_model(inproc):
    _, port = inproc(worker=False)
    st, out = post(port, MESSAGES + "/count_tokens", anthropic_image(GOOD.split(",", 1)[1]))
    assert st == 400 and "takes no images" in out["error"]["message"], out


def test_the_body_limit_fits_one_image_at_its_byte_cap(inproc):
    from dflash_mlx.server.connection import MAX_BODY, body_limit

    assert body_limit(ImageLimits()) == MAX_BODY  # 20 MB base64 is under 32 MiB
    big = ImageLimits(max_bytes=60 * 2**20)
    assert body_limit(big) >= 60 * 2**20 * 4 // 3 + 2**20
    httpd, _ = inproc(serve=False, config=ServerConfig(image_limits=big))
    assert httpd.max_body == body_limit(big)


def test_bad_limits_are_refused_by_name():
    from dflash_mlx.vision.images import ImageError

    with pytest.raises(ImageError, match="max_images"):
        ImageLimits(max_images=0).validate()


def test_a_text_only_server_refuses_images_without_decoding_a_pixel(inproc, monkeypatch):
    from dflash_mlx.vision import images

    decoded = []
    real = images._decode
    monkeypatch.setattr(images, "_decode", lambda im: decoded.append(im.size) or real(im))
    _, port = inproc()
    big = image_url(data_url(png((64, 64))))
    for path, body in [
        (CHAT, chat(big, big)),
        (MESSAGES, anthropic_image(base64.b64encode(png()).decode())),
        (RESPONSES, responses_image(GOOD)),
    ]:
        st, out = post(port, path, body)
        assert st == 400 and "takes no images" in out["error"]["message"], out
    assert decoded == []  # checked from their headers, refused before any decode
    still_answers(port)


def test_images_are_decoded_only_for_a_request_the_queue_admits(inproc, monkeypatch):
    httpd, port = inproc()
    monkeypatch.setattr(httpd.engine, "has_room", lambda: False)
    st, out = post(port, CHAT, chat(image_url(GOOD)))  # 503 before the model is asked
    assert st == 503 and out["error"]["code"] == "server_busy", out


def test_a_mislabelled_data_url_is_one_rule_in_every_api_streaming_too(inproc):
    _, port = inproc(worker=False)
    lie = data_url(png(), "image/jpeg")
    for path, body in [
        (CHAT, chat(image_url(lie))),
        (MESSAGES, anthropic_image(lie.split(",", 1)[1], "image/jpeg")),
        (RESPONSES, responses_image(lie)),
    ]:
        st, out = post(port, path, {**body, "stream": True})
        assert st == 400 and "says image/jpeg but the data is PNG" in out["error"]["message"]
        assert out["error"]["type"] == "invalid_request_error", out
