"""`dflash chat` at its limits: a conversation that outgrows the context, a message that
cannot fit, text that is not UTF-8, and a model without a chat template."""

from __future__ import annotations

import io
import sys

import pytest
from cli_helpers import REPO_ROOT, build_pair, cli_env

from dflash_mlx import generate
from dflash_mlx.generation import encode_prompt
from dflash_mlx.settings import GenerationConfig


@pytest.fixture(scope="module")
def small_root(tmp_path_factory):
    """A pair with a 128-token context and no chat template (the default format applies)."""
    return build_pair(tmp_path_factory.mktemp("chatsmall"), chat_template=False, context=128)


@pytest.fixture(scope="module")
def small(small_root):
    from dflash_mlx import load

    return load(str(small_root / "target"), drafter=str(small_root / "drafter"))


def _session(small, stdin="", **gen):
    from dflash_mlx.cli.chat import ChatSession

    out = io.StringIO()
    cfg = GenerationConfig(max_tokens=8, logit_bias={3: -100}, **gen)
    s = ChatSession(*small, "small", cfg, system="be brief", stdin=io.StringIO(stdin), stdout=out)
    return s, out


def test_oldest_turns_are_dropped_when_the_next_would_not_fit(small):
    model, tok = small
    s, out = _session(small)
    message = "import os and print the path join of a and b please"
    dropped_at = None
    for turn in range(8):
        s.answer(f"{turn}: {message}")
        if "oldest turn" in out.getvalue() and dropped_at is None:
            dropped_at = turn
    assert dropped_at is not None, out.getvalue()
    assert "[dim]" not in out.getvalue() and "to fit the 128-token context" in out.getvalue()
    assert s.system == "be brief" and s.messages()[0]["role"] == "system"
    assert s.history[-2]["content"] == f"7: {message}" and s.history[0]["role"] == "user"
    assert not s.history[0]["content"].startswith("0:")  # the first turn went
    # the caches were rebuilt consistently: the last answer is what a cold run says
    ids = encode_prompt(tok, s.messages()[:-1])
    assert len(ids) + 8 <= 128
    want = generate(model, tok, ids, max_tokens=8, logit_bias={3: -100})
    assert s.history[-1]["content"] == want
    assert s.cache.tokens[: len(ids)] == ids


def test_a_message_longer_than_the_context_is_refused_and_the_session_goes_on(small, capsys):
    s, _out = _session(small)
    s.answer("hello there")
    history = list(s.history)
    s.answer("print(i) " * 60)  # fine by characters, too many tokens
    err = capsys.readouterr().err
    assert "error: this message makes a prompt of" in err and "context is 128 tokens" in err
    s.answer("x" * 100_000)  # refused before tokenizing
    assert "characters, at least" in capsys.readouterr().err
    assert s.history == history and s.turns == 1
    s.answer("and again")
    assert s.turns == 2


def test_a_line_that_is_not_utf8_is_refused_and_the_session_goes_on(small, capsys):
    s, _out = _session(small, stdin="bad \udcff line\nhello\n/exit\n")
    s.loop()
    err = capsys.readouterr().err
    assert "error: that message is not valid UTF-8 (byte 0xff at character 4); type it" in err
    assert s.turns == 1 and s.history[0]["content"] == "hello"


def test_chat_without_a_template_in_a_terminal(small_root):
    pexpect = pytest.importorskip("pexpect")
    args = ["-m", "dflash_mlx.cli", "chat", "--model", str(small_root / "target")]
    args += ["--drafter", str(small_root / "drafter"), "-m", "6"]
    c = pexpect.spawn(
        sys.executable,
        args,
        env=cli_env(),
        cwd=str(REPO_ROOT),
        encoding="utf-8",
        codec_errors="replace",
        timeout=60,
    )
    try:
        c.expect("note: this model has no chat template; chat messages use a default format")
        c.expect("dflash chat")
        c.expect_exact(">>> ")
        for text in ("hello there", "and again"):
            c.sendline(text)
            c.expect(r"new prompt tokens")
            c.expect_exact(">>> ")
        c.sendeof()
        c.expect(pexpect.EOF)
        assert "no chat template" not in c.before
    finally:
        c.close()
    assert c.exitstatus == 0
