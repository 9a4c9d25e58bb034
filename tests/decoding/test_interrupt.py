"""Stopping a prefill: it runs in chunks, a stop request is honoured between two of them, and
the caches then hold exactly the chunks that ran (``PromptCache.interrupt``, ``Interrupted``);
``dflash chat`` turns the first Ctrl-C into that request."""

from __future__ import annotations

import io
import os
import signal

import mlx.core as mx
import pytest

from dflash_mlx import generate, stream_generate
from dflash_mlx.decoding.state import Interrupted
from dflash_mlx.decoding.steps import prefill_chunk
from dflash_mlx.settings import GenerationConfig

PROMPT = [5 + (i * 7) % 300 for i in range(600)]


def test_prefill_chunks_are_small_enough_to_stop_within_a_second():
    assert prefill_chunk(2048) == (256 if mx.default_device() == mx.cpu else 2048)
    assert prefill_chunk(100) == 100 and prefill_chunk(0) == 1


def _stop_after_first_chunk(monkeypatch, model, on_call):
    real = type(model.adapter).__call__
    seen = []

    def call(self, ids, cache, **kw):
        seen.append(ids.shape[1])
        out = real(self, ids, cache, **kw)
        if len(seen) == 1:
            on_call()
        return out

    monkeypatch.setattr(type(model.adapter), "__call__", call)
    return seen


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_a_stop_between_prefill_chunks_leaves_a_consistent_cache(pairs, monkeypatch, kind):
    model, tok = pairs(kind, "d2")
    cold = generate(model, tok, PROMPT, max_tokens=12)
    cache = model.make_cache()
    seen = _stop_after_first_chunk(monkeypatch, model, cache.interrupt.set)
    with pytest.raises(Interrupted):
        list(stream_generate(model, tok, PROMPT, max_tokens=12, prompt_cache=cache))
    assert seen == [256]  # stopped after one chunk, not after the whole prompt
    assert cache.tokens == PROMPT[:256] and not cache.busy
    monkeypatch.undo()
    cache.interrupt.clear()
    rs = list(stream_generate(model, tok, PROMPT, max_tokens=12, prompt_cache=cache))
    assert "".join(r.text for r in rs) == cold
    assert rs[-1].prompt_processed == len(PROMPT) - 256  # the kept chunk was reused


def test_first_ctrl_c_requests_a_stop_and_the_second_interrupts():
    from dflash_mlx.cli.terminal import StopFlag

    calls = []
    with pytest.raises(KeyboardInterrupt), StopFlag(on_first=lambda: calls.append(1)) as flag:
        os.kill(os.getpid(), signal.SIGINT)
        assert flag.hit == 1 and calls == [1]
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10**6):  # the handler runs between bytecodes
            pass
    assert calls == [1]


def test_chat_ctrl_c_during_prefill_drops_the_message_and_keeps_the_cache(
    pairs, monkeypatch, capsys
):
    from dflash_mlx.cli.chat import ChatSession

    model, tok = pairs("qwen3", "d2")
    out = io.StringIO()
    s = ChatSession(model, tok, "tiny", GenerationConfig(max_tokens=6), stdout=out)
    long = " ".join(f"print({i})" for i in range(200))
    # the real signal, delivered while the first chunk runs
    seen = _stop_after_first_chunk(monkeypatch, model, lambda: os.kill(os.getpid(), 2))
    s.answer(long)
    assert len(seen) == 1 and s.history == [] and s.turns == 0 and s.last is None
    assert "before the answer began" in out.getvalue() and "tok/s" not in out.getvalue()
    held = list(s.cache.tokens)
    assert len(held) == 256 and not s.cache.busy
    monkeypatch.undo()
    s.answer(long)  # the same message again: the kept chunk is reused
    assert s.turns == 1 and s.last.prompt_processed == s.last.prompt_tokens - 256
    assert s.cache.tokens[:256] == held


def test_chat_stats_line_shows_no_rate_before_a_cycle(pairs):
    from types import SimpleNamespace

    from dflash_mlx.cli.chat import ChatSession

    model, tok = pairs("qwen3", "d2")
    s = ChatSession(model, tok, "tiny", GenerationConfig(max_tokens=6), stdout=io.StringIO())
    r = SimpleNamespace(
        prompt_processed=12, generation_tokens=1, generation_tps=7958.3, tau=0.0, cycles=0
    )
    assert s._stats_line(r) == "12 new prompt tokens · 1 tokens"
    r.cycles, r.generation_tokens, r.tau, r.generation_tps = 3, 7, 2.0, 50.0
    assert s._stats_line(r) == "12 new prompt tokens · 7 tokens at 50.0 tok/s · tau 2.00"
