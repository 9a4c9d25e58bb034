"""Images through every interface on the tiny VLM (greedy): the OpenAI chat, Anthropic and
Responses APIs, driven by the official ``openai`` and ``anthropic`` clients, return the text
``generate(..., images=...)`` gives for the same image and prompt; the same image in an
agent's next turn is a prompt-cache hit; ``dflash run --image`` and ``dflash chat``'s
``/image`` answer what the Python API answers."""

from __future__ import annotations

import base64
import io
import threading

import pytest
from typer.testing import CliRunner

from dflash_mlx import generate, load

ASK = "what is this?"
N = 6


@pytest.fixture(scope="module")
def vlm(tiny_vlm_dir):
    return load(str(tiny_vlm_dir[0]), drafter=str(tiny_vlm_dir[1]))


@pytest.fixture(scope="module")
def port(vlm):
    from dflash_mlx.server.app import make_server

    httpd = make_server(*vlm, "tiny-vlm", port=0)
    threads = [
        threading.Thread(target=f, daemon=True) for f in (httpd.serve_forever, httpd.engine.run)
    ]
    for t in threads:
        t.start()
    yield httpd.server_address[1]
    httpd.engine.stop()
    httpd.shutdown()
    for t in threads:
        t.join(30)
    httpd.server_close()


def turn(text: str = ASK, n: int = 1) -> dict:
    return {"role": "user", "content": [{"type": "image"}] * n + [{"type": "text", "text": text}]}


def expected(vlm, msgs, images, n=N) -> str:
    return generate(*vlm, msgs, images=images, max_tokens=n, temperature=0)


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def test_each_api_answers_the_python_apis_text(vlm, port, images):
    openai = pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    want = expected(vlm, [turn()], images[:1])
    url = f"http://127.0.0.1:{port}"
    oa = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    parts = [{"type": "image_url", "image_url": {"url": data_url(images[0])}}]
    parts.append({"type": "text", "text": ASK})
    r = oa.chat.completions.create(
        model="tiny-vlm", messages=[{"role": "user", "content": parts}], max_tokens=N, temperature=0
    )
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens > 4  # the image's rows are prompt tokens
    an = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=120)
    src = {"type": "base64", "media_type": "image/png", "data": data_url(images[0]).split(",")[1]}
    m = an.messages.create(
        model="m",
        max_tokens=N,
        messages=[
            {
                "role": "user",
                "content": [{"type": "image", "source": src}, {"type": "text", "text": ASK}],
            }
        ],
        extra_body={"temperature": 0},
    )
    assert m.content[0].text == want
    item = [
        {"type": "input_image", "image_url": data_url(images[0])},
        {"type": "input_text", "text": ASK},
    ]
    resp = oa.responses.create(
        model="tiny-vlm",
        input=[{"role": "user", "content": item}],
        max_output_tokens=N,
        temperature=0,
    )
    assert resp.output_text == want


def test_two_images_keep_their_reading_order(vlm, port, images, monkeypatch):
    openai = pytest.importorskip("openai")
    oa = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    for pair in (images[:2], images[1::-1]):
        want = expected(vlm, [turn(n=2)], pair)
        calls = []  # the server prepares a request once: mlx-vlm's processor runs once
        processor = vlm[0].target.processor

        def counted(*a, calls=calls, processor=processor, **k):
            calls.append(1)
            return processor(*a, **k)

        monkeypatch.setattr(vlm[0].target, "processor", counted)
        parts = [{"type": "image_url", "image_url": {"url": data_url(p)}} for p in pair]
        msgs = [{"role": "user", "content": [*parts, {"type": "text", "text": ASK}]}]
        r = oa.chat.completions.create(model="tiny-vlm", messages=msgs, max_tokens=N, temperature=0)
        assert r.choices[0].message.content == want
        assert len(calls) == 1
        monkeypatch.undo()


def test_the_same_image_in_the_next_turn_is_a_prompt_cache_hit(vlm, port, images):
    openai = pytest.importorskip("openai")
    from dflash_mlx.generation import request_ids
    from dflash_mlx.settings import GenerationConfig

    oa = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    first = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(images[2])}},
                {"type": "text", "text": "look"},
            ],
        }
    ]
    a = oa.chat.completions.create(model="tiny-vlm", messages=first, max_tokens=N, temperature=0)
    again = [
        *first,
        {"role": "assistant", "content": a.choices[0].message.content},
        {"role": "user", "content": "and now?"},
    ]
    b = oa.chat.completions.create(model="tiny-vlm", messages=again, max_tokens=N, temperature=0)
    msgs = [turn("look"), again[1], again[2]]
    _, _, vision = request_ids(*vlm, msgs, GenerationConfig(), images=images[2:3])
    image_end = vision.spans[0][1]
    assert b.usage.prompt_tokens_details.cached_tokens >= image_end, b.usage
    assert b.dflash["prompt_tokens_processed"] < b.usage.prompt_tokens - image_end  # type: ignore[attr-defined]
    # the fallbacks are in the answer's stats (a hybrid VLM: one request at a time)
    notes = [n.split(":")[0] for n in b.dflash["notes"]]  # type: ignore[attr-defined]
    assert notes == ["tree off", "rollback replays", "batch off"], b.dflash  # type: ignore[attr-defined]


def test_run_image_answers_the_python_apis_text(vlm, tiny_vlm_dir, images, tmp_path):
    from dflash_mlx.cli import app

    f = tmp_path / "a.png"
    f.write_bytes(images[0])
    args = ["run", "--model", str(tiny_vlm_dir[0]), "--drafter", str(tiny_vlm_dir[1])]
    r = CliRunner().invoke(app, [*args, "--image", str(f), "-m", str(N), "--temp", "0", "-q", ASK])
    assert r.exit_code == 0, (r.stdout, r.stderr, r.exception)
    assert r.stdout == expected(vlm, ASK, images[:1]) + "\n"
    assert "tree off" not in r.stderr  # --quiet: only the text
    r = CliRunner().invoke(app, [*args, "--image", str(f), "-m", "2", ASK])
    assert r.exit_code == 0, (r.stdout, r.stderr, r.exception)
    assert "note       tree off: a vision-language target (qwen3_5)" in r.stderr, r.stderr
    assert "note       rollback replays" in r.stderr


def test_chat_image_goes_with_the_next_message(vlm, images, tmp_path):
    from dflash_mlx.cli.chat import ChatSession
    from dflash_mlx.settings import GenerationConfig

    f = tmp_path / "a.png"
    f.write_bytes(images[1])
    out = io.StringIO()
    gen = GenerationConfig(max_tokens=N, temperature=0)
    lines = f"/image {f}\n{ASK}\n/exit\n"
    s = ChatSession(*vlm, "tiny-vlm", gen, stdin=io.StringIO(lines), stdout=out, markdown=False)
    s.loop()
    assert "attached to your next message" in out.getvalue()
    assert s.history[0] == turn() and len(s.images()) == 1
    assert s.history[1]["content"] == expected(vlm, [turn()], images[1:2])


def test_a_responses_chain_keeps_its_image_and_streams(vlm, port, images):
    openai = pytest.importorskip("openai")
    oa = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    item = [{"type": "input_image", "image_url": data_url(images[0])}]
    item.append({"type": "input_text", "text": "look"})
    first = oa.responses.create(
        model="tiny-vlm",
        input=[{"role": "user", "content": item}],
        max_output_tokens=N,
        temperature=0,
    )
    deltas, done = [], None
    stream = oa.responses.create(
        model="tiny-vlm",
        input="and now?",
        previous_response_id=first.id,
        max_output_tokens=N,
        temperature=0,
        stream=True,
    )
    for event in stream:
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        elif event.type in ("response.completed", "response.incomplete"):  # N tokens: incomplete
            done = event.response
    msgs = [turn("look"), {"role": "assistant", "content": first.output_text}]
    msgs.append({"role": "user", "content": "and now?"})
    assert "".join(deltas) == done.output_text == expected(vlm, msgs, images[:1])
    assert done.usage.input_tokens_details.cached_tokens >= 10  # the first turn's image rows


@pytest.mark.parametrize(
    "bad", [123, True, 1.5, ["/proc/self/mem"], ["~dflash-no-such-user/x.png"]]
)
def test_bad_images_are_one_dflash_error_naming_them_in_every_entry(vlm, bad):
    from dflash_mlx import BatchGenerator, DFlashError, stream_generate

    calls = [
        lambda: generate(*vlm, ASK, images=bad, max_tokens=1),
        lambda: next(stream_generate(*vlm, ASK, images=bad, max_tokens=1)),
        lambda: BatchGenerator(*vlm).insert(ASK, images=bad, max_tokens=1),
    ]
    for call in calls:
        with pytest.raises(DFlashError) as e:
            call()
        msg = str(e.value)
        assert "\n" not in msg and ("images must be" in msg or f"image file {bad[0]}" in msg), msg


def test_a_pil_image_answers_what_its_file_answers(vlm, images):
    from PIL import Image

    pil = Image.open(io.BytesIO(images[0]))
    assert generate(*vlm, ASK, images=pil, max_tokens=N, temperature=0) == expected(
        vlm, ASK, images[:1]
    )


@pytest.mark.parametrize("mark", ["<|image_pad|>", "<|video_pad|>"])
def test_text_spelling_an_image_placeholder_is_refused(vlm, port, images, mark):
    from dflash_mlx import DFlashError

    with pytest.raises(DFlashError, match="spells the image placeholder"):
        generate(*vlm, f"what is {mark} this?", images=images[:1], max_tokens=1)
    with pytest.raises(DFlashError, match="spells the image placeholder"):
        generate(*vlm, [turn(f"look {mark}")], system="hi", images=images[:1], max_tokens=1)
    from image_helpers import post

    part = {"type": "image_url", "image_url": {"url": data_url(images[0])}}
    msgs = [{"role": "user", "content": [part, {"type": "text", "text": f"a {mark} b"}]}]
    st, out = post(port, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1})
    assert st == 400 and "spells the image placeholder" in out["error"]["message"], out


def test_batch_generate_with_images_answers_what_generate_does(vlm, images):
    from dflash_mlx import DFlashError, batch_generate

    out = batch_generate(
        *vlm, [ASK, ASK, ASK], images=[images[0], None, [images[1]]], max_tokens=N, temperature=0
    )
    want = [expected(vlm, ASK, images[:1]), generate(*vlm, ASK, max_tokens=N, temperature=0)]
    assert out.texts == [*want, expected(vlm, ASK, images[1:2])]
    with pytest.raises(DFlashError, match="one entry per prompt"):
        batch_generate(*vlm, [ASK, ASK], images=[images[0]], max_tokens=1)


def test_decoded_pixels_are_budgeted_and_given_back(vlm, images, monkeypatch):
    import gc
    import weakref

    from dflash_mlx.generation import request_ids
    from dflash_mlx.settings import GenerationConfig
    from dflash_mlx.vision import images as vision_images
    from dflash_mlx.vision.budget import DECODING, PixelBudget
    from dflash_mlx.vision.images import ImageError

    with pytest.raises(ImageError) as e:  # two 64x64 images over a budget of 8191 pixels
        request_ids(*vlm, ASK, GenerationConfig(), images=images[:2], budget=PixelBudget(8191))
    assert e.value.kind == "too_large" and "8,192 pixels together" in str(e.value)
    alive, real = [], vision_images._decode
    monkeypatch.setattr(vision_images, "_decode", lambda im: alive.append(real(im)) or alive[-1])
    vision = request_ids(*vlm, ASK, GenerationConfig(), images=images[:2])[2]
    refs = [weakref.ref(im) for im in alive]
    alive.clear()
    gc.collect()
    assert len(refs) == 2 and all(r() is None for r in refs) and DECODING.used == 0
    assert vision.length > 8  # the prompt kept only the processor's arrays
