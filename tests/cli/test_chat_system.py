"""`dflash chat`'s system prompt: a bad one is refused at `/system` (the session goes on) or
at start (`--system`), and when the system prompt is what overflows the context, the error
says so instead of "shorten the message"."""

from __future__ import annotations

import io

import pytest
from cli_helpers import build_pair
from typer.testing import CliRunner

from dflash_mlx.cli import app
from dflash_mlx.decoding.prompt import conversation_tokens
from dflash_mlx.settings import GenerationConfig

CONTEXT = 128


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A pair with a 128-token context and no chat template (the default format applies)."""
    return build_pair(tmp_path_factory.mktemp("chatsys"), chat_template=False, context=CONTEXT)


@pytest.fixture(scope="module")
def small(root):
    from dflash_mlx import load

    return load(str(root / "target"), drafter=str(root / "drafter"))


def session(small, stdin="", system="be brief"):
    from dflash_mlx.cli.chat import ChatSession

    cfg = GenerationConfig(max_tokens=8, logit_bias={3: -100})
    out = io.StringIO()
    s = ChatSession(*small, "small", cfg, system=system, stdin=io.StringIO(stdin), stdout=out)
    return s, out


def system_of(tok, lo: int, hi: int) -> str:
    """A system prompt that takes lo .. hi tokens with an empty first message."""
    text = ""
    while (conversation_tokens(tok, [{"role": "system", "content": text}]) or 0) < lo:
        text += "import os and print the path "
    msgs = [{"role": "system", "content": text}, {"role": "user", "content": ""}]
    assert lo <= conversation_tokens(tok, msgs) <= hi
    return text


@pytest.mark.parametrize(
    "bad,why",
    [
        ("be \udcff brief", "byte 0xff at character 3"),
        ("a \ud800", "lone surrogate U+D800 at character 2"),
    ],
)
def test_a_system_prompt_that_is_not_utf8_is_refused_at_the_command(small, capsys, bad, why):
    s, out = session(small, stdin=f"/system {bad}\nhello\n/exit\n")
    s.loop()  # used to end the session (exit 2) at the next message
    err = capsys.readouterr().err
    assert f"error: that system prompt is not valid UTF-8 ({why}" in err and "type it again" in err
    assert s.system == "be brief" and "system prompt set" not in out.getvalue()
    assert s.turns == 1 and s.history[0]["content"] == "hello"


def test_a_system_prompt_that_alone_cannot_fit_is_refused_at_the_command(small, capsys):
    s, _out = session(small)
    s.answer("hello")
    history = list(s.history)
    s.command("/system " + "print(i) " * 80)
    err = capsys.readouterr().err
    assert "error: that system prompt alone makes a prompt of" in err
    assert f"this model's context is {CONTEXT} tokens; shorten it" in err
    s.command("/system " + "x" * 100_000)  # refused before tokenizing
    assert "100000 characters, far more than this model's 128-token" in capsys.readouterr().err
    assert s.system == "be brief" and s.history == history
    s.answer("and again")
    assert s.turns == 2


def test_when_the_system_prompt_overflows_it_is_blamed(small, capsys):
    _model, tok = small
    s, _out = session(small, system=system_of(tok, 100, 118))
    s.answer("print the path join of a and b please, import os first and then sys too")
    err = capsys.readouterr().err
    assert "error: this message and the system prompt make a prompt of" in err
    assert "shorten the system prompt (/system) or the message" in err
    assert s.turns == 0 and s.history == []
    s.answer("hi")  # a short message still fits beside it
    assert s.turns == 1
    s, _out = session(small, system=None)
    s.answer("print(i) " * 60)  # no system prompt: the message's fault, as before
    err = capsys.readouterr().err
    assert "shorten the message" in err and "system prompt" not in err


def test_a_refused_prompt_drops_the_message_not_the_session(small, capsys):
    s, _out = session(small, system="be \udcff brief")  # set without the command's check
    s.answer("hello")
    assert "is not valid UTF-8" in capsys.readouterr().err
    assert s.history == [] and s.turns == 0


def test_a_bad_system_flag_is_one_error_line_at_start(root, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = ["chat", "--model", str(root / "target"), "--drafter", str(root / "drafter")]
    r = CliRunner().invoke(app, [*args, "--system", "be \udcff brief"], input="")
    assert r.exit_code == 2, (r.stdout, r.stderr, r.exception)
    assert "error: the --system text is not valid UTF-8 (byte 0xff at character 3)" in r.stderr
    assert "Traceback" not in r.stdout + r.stderr
