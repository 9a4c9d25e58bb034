"""A thinking model in ``dflash run`` and ``dflash chat`` (the tiny thinking pair, whose
template opens ``<think>\\n``): the answer on stdout and the reasoning apart, ``--no-think``,
``--thinking-budget`` (the closing marker forced there) and chat's ``/think``."""

from __future__ import annotations

import io
import json

import pytest
from typer.testing import CliRunner

from dflash_mlx.cli import app
from dflash_mlx.server.reasoning import split

runner = CliRunner()
MARKS = ("<think>", "</think>")


@pytest.fixture(scope="module")
def think_pair(tmp_path_factory):
    from tiny_models import thinking_pair

    return thinking_pair(tmp_path_factory.mktemp("think_cli"))


@pytest.fixture(scope="module")
def loaded(think_pair):
    from dflash_mlx import load

    return load(str(think_pair[0]), drafter=str(think_pair[1]))


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def run(think_pair, *args):
    t, d = think_pair
    argv = ["run", "--model", str(t), "--drafter", str(d), "--max-tokens", "10", *args]
    return runner.invoke(app, [str(a) for a in argv])


def expected(loaded, budget=None, enable_thinking=True):
    """(reasoning, content) of the in-process generation of the run's prompt."""
    from dflash_mlx.cli.thinking import processors
    from dflash_mlx.generation import encode_prompt, stream_generate

    model, tok = loaded
    msgs = [{"role": "user", "content": "hi"}]
    ids = encode_prompt(tok, msgs, template_kwargs={"enable_thinking": enable_thinking})
    procs = processors(tok, ids, budget)
    text = "".join(
        r.text for r in stream_generate(model, tok, ids, max_tokens=10, logits_processors=procs)
    )
    return split(text, MARKS, enable_thinking)


def test_run_json_holds_the_reasoning_apart_from_the_answer(think_pair, loaded):
    r = run(think_pair, "hi", "--json", "--thinking-budget", "3")
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    reasoning, content = expected(loaded, budget=3)
    assert (got["reasoning"], got["text"]) == (reasoning, content)
    assert content  # the budget closed the reasoning: the rest is the answer


def test_run_streams_the_answer_to_stdout_and_the_reasoning_to_stderr(think_pair, loaded):
    r = run(think_pair, "hi", "--thinking-budget", "3")
    assert r.exit_code == 0, r.output
    reasoning, content = expected(loaded, budget=3)
    assert r.stdout == content + "\n"
    assert reasoning in r.stderr


def test_run_no_think_answers_without_reasoning(think_pair, loaded):
    r = run(think_pair, "hi", "--json", "--no-think")
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    assert "reasoning" not in got
    assert got["text"] == expected(loaded, enable_thinking=False)[1]


def test_a_negative_thinking_budget_is_one_error_line(think_pair):
    r = run(think_pair, "hi", "--thinking-budget", "-1")
    assert r.exit_code == 2
    assert "--thinking-budget" in r.output and "Traceback" not in r.output


def test_chat_think_switches_reasoning_and_keeps_it_apart_in_the_history(loaded):
    from dflash_mlx.cli.chat import ChatSession
    from dflash_mlx.settings import GenerationConfig

    model, tok = loaded
    lines = "hello\n/think\nagain\n/think maybe\n/think on\n/exit\n"
    out = io.StringIO()
    gen = GenerationConfig(max_tokens=8, logit_bias={3: -100})
    s = ChatSession(
        model, tok, "tiny", gen, stdin=io.StringIO(lines), stdout=out, thinking_budget=2
    )
    s.loop()
    text = out.getvalue()
    first, second = s.history[1], s.history[3]
    assert first["reasoning_content"] and "</think>" not in first["content"]
    assert "reasoning_content" not in second  # /think turned it off for the next answer
    assert "thinking off" in text and "usage: /think" in text and "thinking on" in text
    assert s.think is True
