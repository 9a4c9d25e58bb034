"""Images on the command line: ``dflash run --image PATH`` (repeatable) refuses a bad file or
a text-only model in one ``error:`` line with exit 2; ``dflash chat``'s ``/image PATH``
attaches a checked image to the next message, and a bad one is one message while the
session goes on."""

from __future__ import annotations

import io

import pytest
from cli_helpers import build_pair
from typer.testing import CliRunner

pytest.importorskip("PIL", reason="images need Pillow (pip install -e '.[vision]')")
from image_helpers import encoded, png_declaring

from dflash_mlx.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("imgpair"))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("imgs")
    made = {
        "good.png": encoded("PNG"),
        "good.jpg": encoded("JPEG"),
        "text.png": b"this is not an image",
        "scan.tiff": encoded("TIFF"),
        "cut.png": encoded("PNG", (64, 64))[:90],
        "bomb.png": png_declaring(30000, 30000),
    }
    for name, data in made.items():
        (d / name).write_bytes(data)
    return d


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def run(pair, *args):
    model = ["--model", str(pair / "target"), "--drafter", str(pair / "drafter")]
    return runner.invoke(app, ["run", *model, "-m", "2", *map(str, args)])


def one_error_line(r, needle: str) -> None:
    assert r.exit_code == 2, (r.exit_code, r.stdout, r.stderr, r.exception)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert needle in lines[0] and "Traceback" not in r.stderr, lines[0]
    assert "--max-image" not in lines[0]  # the server's flags, not this command's


@pytest.mark.parametrize(
    "name,needle",
    [
        ("missing.png", "no image file at"),
        ("text.png", "not a supported image"),
        ("scan.tiff", "not a supported image"),
        ("cut.png", "not a readable PNG"),
        ("bomb.png", "pixels"),
        ("good.png", "this model takes no images"),
        ("/proc/self/mem", "cannot read the image file /proc/self/mem (Input/output error)"),
        ("~dflash-no-such-user/x.png", "cannot read the image file ~dflash-no-such-user/x.png"),
    ],
)
def test_run_image_refusals_are_one_error_line(pair, files, name, needle):
    path = name if name[0] in "/~" else files / name  # a read error is not a write error
    one_error_line(run(pair, "--image", files / "good.jpg", "--image", path, "hi"), needle)


def test_run_image_needs_the_chat_template(pair, files):
    r = run(pair, "--image", files / "good.png", "--ignore-chat-template", "hi")
    one_error_line(r, "--image needs the chat template")


def test_run_help_lists_image():
    r = runner.invoke(app, ["run", "--help"])
    assert "--image" in r.stdout


def session(pair, lines: str):
    from dflash_mlx import load
    from dflash_mlx.cli.chat import ChatSession
    from dflash_mlx.settings import GenerationConfig

    model, tok = load(str(pair / "target"), drafter=str(pair / "drafter"))
    out = io.StringIO()
    gen = GenerationConfig(max_tokens=3, block_size=4)
    return ChatSession(model, tok, "tiny", gen, stdin=io.StringIO(lines), stdout=out), out


def test_chat_image_refusals_keep_the_session(pair, files, capsys):
    lines = f"/help\n/image\n/image {files / 'text.png'}\n/image /proc/self/mem\n"
    lines += f"/image {files / 'good.png'}\nhi\n"
    s, out = session(pair, lines)
    s.loop()
    text, err = out.getvalue(), capsys.readouterr().err
    assert "/image <path>" in text and "usage: /image PATH" in text
    assert "error: " in err and "not a supported image" in err
    assert "cannot read the image file /proc/self/mem (Input/output error)" in err
    assert "this model takes no images" in err
    assert s.pending == [] and len(s.history) == 2  # the message was answered, text only
    assert s.history[0] == {"role": "user", "content": "hi"}


def test_chat_attaches_images_to_the_next_message_in_reading_order(pair, files):
    from dflash_mlx.vision.images import from_path

    s, _ = session(pair, "")
    a, b = from_path(files / "good.png"), from_path(files / "good.jpg")
    s.pending = [a, b]
    first = s.user_turn("what is this?")
    assert first["content"] == [
        {"type": "image"},
        {"type": "image"},
        {"type": "text", "text": "what is this?"},
    ]
    s.history += [first, {"role": "assistant", "content": "a square"}]
    s.pending = [b]
    s.history.append(s.user_turn("and this?"))
    assert s.pending == [] and s.images() == [a, b, b]
    s.unsend()  # a message dropped: its image waits for the next one
    assert s.pending == [b] and s.images() == [a, b]
    s.reset()
    assert s.images() == [] and s.pending == []
