"""Type-ahead in `dflash chat`, in a real pseudo-terminal: lines typed while an answer
streams are read as typed (one message or command each, not one pasted message), also when
the answer ends inside an open code fence (the markdown re-render must not eat them)."""

from __future__ import annotations

import io
import sys
import textwrap
import time

import pytest
from cli_helpers import REPO_ROOT, build_pair, cli_env

pexpect = pytest.importorskip("pexpect")

# A chat session over the tiny pair whose answers are a slow, scripted stream ending in an
# open code fence at the token limit (what the demo model does with "and now a test").
SCRIPT = textwrap.dedent(
    """
    import sys, time, types
    from dflash_mlx import generation, load
    from dflash_mlx.cli.chat import ChatSession
    from dflash_mlx.settings import GenerationConfig

    model, tok = load(sys.argv[1] + "/target", drafter=sys.argv[1] + "/drafter")
    PIECES = ["Sure:\\n", "```python\\n", "def test_add():\\n"] + ["    assert 1\\n"] * 12

    def slow_stream(*a, **k):
        for i, p in enumerate(PIECES):
            time.sleep(0.15)
            yield types.SimpleNamespace(
                text=p, tokens=tok.encode(p, add_special_tokens=False),
                finish_reason="length" if i == len(PIECES) - 1 else None,
                prompt_tokens=5, prompt_processed=5, prompt_tps=1.0,
                generation_tokens=i + 1, generation_tps=1.0, tau=1.0, cycles=1,
                peak_memory=0.0, acceptance=[], blocks={}, copied=0, siblings=0,
            )

    generation.stream_generate = slow_stream
    ChatSession(model, tok, "tiny", GenerationConfig(max_tokens=48)).loop()
    print("session closed")
    """
)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("typeahead"))


def spawn(pair):
    child = pexpect.spawn(
        sys.executable,
        ["-c", SCRIPT, str(pair)],
        env=cli_env(),
        cwd=str(REPO_ROOT),
        encoding="utf-8",
        codec_errors="replace",  # the tty echoes ^C between a character's bytes at times
        timeout=60,
        dimensions=(50, 120),
    )
    child.logfile_read = io.StringIO()  # the whole transcript, for counting answers
    child.expect("dflash chat")
    child.expect_exact(">>> ")
    return child


def test_reset_then_exit_typed_during_an_open_fence_answer_are_commands(pair):
    c = spawn(pair)
    try:
        c.sendline("and now a test")
        c.expect_exact("```python")  # the answer is streaming
        c.sendline("/reset")
        time.sleep(0.6)
        c.sendline("/exit")  # still streaming: the answer takes about 2 s
        c.expect_exact("conversation cleared", timeout=30)
        c.expect_exact("session closed", timeout=30)
        c.expect(pexpect.EOF, timeout=30)
    finally:
        c.close(force=True)
    seen = c.logfile_read.getvalue()
    assert seen.count("new prompt tokens") == 1, seen  # /reset was not sent as a message
    assert "unknown command" not in seen


def test_two_messages_typed_ahead_are_answered_one_by_one(pair):
    c = spawn(pair)
    try:
        c.sendline("first")
        c.expect_exact("```python")
        c.sendline("second")
        c.sendline("/stats")
        for _ in range(2):  # "second" gets its own answer, then /stats runs as a command
            c.expect_exact("new prompt tokens", timeout=30)
        c.expect_exact("session:", timeout=30)
        c.expect_exact(">>> ")
        c.sendline("/exit")
        c.expect(pexpect.EOF, timeout=30)
    finally:
        c.close(force=True)
    assert c.logfile_read.getvalue().count("new prompt tokens") == 2


def test_a_paste_at_the_prompt_is_still_one_message(pair):
    c = spawn(pair)
    try:
        c.send("line one\nline two\n")  # both lines arrive at once, at an idle prompt
        c.expect_exact("new prompt tokens", timeout=30)
        c.expect_exact(">>> ")
        c.sendline("/exit")
        c.expect(pexpect.EOF, timeout=30)
    finally:
        c.close(force=True)
    assert c.logfile_read.getvalue().count("new prompt tokens") == 1  # one answer, not two
