"""`dflash chat` driven in a real pseudo-terminal (pexpect), plus the session logic in-process."""

from __future__ import annotations

import io
import re
import sys
import time

import pytest
from cli_helpers import REPO_ROOT, build_pair, cli_env

pexpect = pytest.importorskip("pexpect")

PROMPT = ">>> "
STATS = re.compile(
    r"prefilled (\d+) of (\d+) prompt tokens.*?generated (\d+) tokens.*?(\d+) tokens in cache",
    re.DOTALL,
)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("chatpair"))


def spawn(pair, *extra):
    args = [
        "-m",
        "dflash_mlx.cli",
        "chat",
        "--model",
        str(pair / "target"),
        "--drafter",
        str(pair / "drafter"),
        *map(str, extra),
    ]
    child = pexpect.spawn(
        sys.executable,
        args,
        env=cli_env(),
        cwd=str(REPO_ROOT),
        encoding="utf-8",
        codec_errors="replace",  # the tty echoes ^C between a character's bytes at times
        timeout=60,
        dimensions=(50, 250),
    )
    child.expect("dflash chat")
    child.expect_exact(PROMPT)
    return child


def stats(child):
    child.sendline("/stats")
    child.expect(STATS)
    m = [int(x) for x in child.match.groups()]
    child.expect_exact(PROMPT)
    return {"prefilled": m[0], "prompt": m[1], "generated": m[2], "cached": m[3]}


def turn(child, text):
    child.sendline(text)
    child.expect(r"new prompt tokens")
    child.expect_exact(PROMPT)


def test_two_turns_reuse_cache_then_reset_and_exit(pair):
    c = spawn(pair, "--max-tokens", 16)
    try:
        turn(c, "hello there")
        s1 = stats(c)
        assert s1["prefilled"] == s1["prompt"] > 0 and s1["generated"] > 0
        turn(c, "and a second question")
        s2 = stats(c)
        # The whole first turn (prompt + answer; the answer's last token was never fed) came
        # from the cache: only the new turn's own tokens were prefilled.
        first = s1["prompt"] + s1["generated"]
        assert s2["prompt"] > first
        assert s2["prefilled"] <= s2["prompt"] - first + 1
        assert s2["prompt"] - s2["prefilled"] >= first - 1
        c.sendline("/help")
        c.expect("/reset")
        c.expect_exact(PROMPT)
        c.sendline("/reset")
        c.expect("conversation cleared")
        c.expect_exact(PROMPT)
        assert stats(c)["cached"] == 0
        turn(c, "hello there")
        s3 = stats(c)
        assert s3["prefilled"] == s3["prompt"] == s1["prompt"]  # a fresh conversation
        # A paste of several lines is one message: one answer, not three.
        c.send("pasted one\npasted two\npasted three\n")
        c.expect(r"new prompt tokens")
        c.expect_exact(PROMPT)
        c.sendline("/stats")
        c.expect(r"session:\s+(\d+) answers")
        assert int(c.match.group(1)) == 4
        c.expect_exact(PROMPT)
        c.sendline("/exit")
        c.expect(pexpect.EOF)
    finally:
        c.close()
    assert c.exitstatus == 0


def test_ctrl_c_stops_answer_and_keeps_session(pair):
    c = spawn(pair, "--max-tokens", 20000)
    try:
        c.sendline("hello there")
        time.sleep(1.0)  # mid-answer
        c.sendintr()
        c.expect(r"stopped")
        c.expect_exact(PROMPT)
        s1 = stats(c)
        assert 0 < s1["generated"] < 20000
        # A multi-line message (trailing backslash), also interrupted.
        c.sendline("first line \\")
        c.expect_exact("... ")
        c.sendline("second line")
        time.sleep(0.5)
        c.sendintr()
        c.expect(r"stopped")
        c.expect_exact(PROMPT)
        s2 = stats(c)
        assert s2["prompt"] - s2["prefilled"] >= s1["prompt"] + s1["generated"] - 1
        # Ctrl-C at the input prompt does not leave; Ctrl-D does.
        c.sendintr()
        c.expect("Ctrl-D or /exit to leave")
        c.expect_exact(PROMPT)
        c.sendeof()
        c.expect(pexpect.EOF)
    finally:
        c.close()
    assert c.exitstatus == 0


def test_session_logic_without_a_terminal(pair):
    from dflash_mlx import load
    from dflash_mlx.cli.chat import ChatSession
    from dflash_mlx.settings import GenerationConfig

    model, tok = load(str(pair / "target"), drafter=str(pair / "drafter"))
    lines = "/bogus\n/system you are terse\nmulti \\\nline\n/stats\n/exit\nnever read\n"
    out = io.StringIO()
    gen = GenerationConfig(max_tokens=6, block_size=8)
    s = ChatSession(model, tok, "tiny", gen, stdin=io.StringIO(lines), stdout=out)
    s.loop()
    text = out.getvalue()
    assert "unknown command /bogus" in text and "system prompt set" in text
    assert s.history[0] == {"role": "user", "content": "multi \nline"}
    assert s.messages()[0] == {"role": "system", "content": "you are terse"}
    assert "prefilled" in text and len(s.history) == 2
    ids = tok.apply_chat_template(s.messages()[:2], add_generation_prompt=True)
    assert s.prev_ids[: len(ids)] == list(ids)


class _TTY(io.StringIO):
    def isatty(self):
        return True


def test_markdown_rendered_in_place_once_a_turn_ends(pair, monkeypatch):
    import types

    from dflash_mlx import generation, load
    from dflash_mlx.cli.chat import ChatSession
    from dflash_mlx.cli.terminal import looks_like_markdown, rows_used
    from dflash_mlx.settings import GenerationConfig

    assert looks_like_markdown("# Title\ntext") and looks_like_markdown("use `x` here")
    assert looks_like_markdown("- a\n- b") and not looks_like_markdown("plain words, 3 * 4.")
    assert rows_used("ab\ncdefg", 4) == 3 and rows_used("a\x08b", 80) is None

    model, tok = load(str(pair / "target"), drafter=str(pair / "drafter"))
    reply = "## Plan\n\n- **one**\n- two\n"

    def fake_stream(*a, **k):
        yield types.SimpleNamespace(
            text=reply,
            tokens=tok.encode(reply, add_special_tokens=False),
            finish_reason="stop",
            prompt_tokens=5,
            prompt_processed=5,
            prompt_tps=1.0,
            generation_tokens=3,
            generation_tps=1.0,
            tau=1.0,
            cycles=1,
            peak_memory=0.0,
            acceptance=[],
        )

    monkeypatch.setattr(generation, "stream_generate", fake_stream)
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("LINES", "40")
    out = _TTY()
    gen = GenerationConfig(max_tokens=4)
    s = ChatSession(model, tok, "tiny", gen, stdin=io.StringIO(""), stdout=out)
    s.answer("plan it")
    text = out.getvalue()
    n = rows_used(reply + "\n", 80) - 1
    assert text.startswith(reply + "\n" + f"\x1b[{n}F\x1b[J")
    assert "•" in text and "Plan" in text  # rich's rendering of the list and heading
    plain = _TTY()
    s = ChatSession(model, tok, "tiny", gen, stdin=io.StringIO(""), stdout=plain, markdown=False)
    s.answer("plan it")
    assert plain.getvalue().startswith(reply + "\n") and "F\x1b[J" not in plain.getvalue()
