"""The engine's prompt checks (``dflash_mlx.decoding.prompt`` through ``encode_prompt`` and
``stream_generate``): valid UTF-8, the context length found in one place, a cheap bound that
refuses megabytes without tokenizing them, ``max_tokens`` clamped to the room left, and the
default chat format of a tokenizer without a template."""

from __future__ import annotations

import types

import pytest
from cli_helpers import build_pair

from dflash_mlx import generate, stream_generate
from dflash_mlx.decoding.prompt import (
    check_chars,
    context_length,
    default_format,
    default_stops,
    end_of_turn_ids,
)
from dflash_mlx.errors import ContextLengthError, DFlashError
from dflash_mlx.generation import encode_prompt


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A pair whose target has a 96-token context and no chat template."""
    from dflash_mlx import load

    root = build_pair(tmp_path_factory.mktemp("small"), chat_template=False, context=96)
    return load(str(root / "target"), drafter=str(root / "drafter"))


def test_context_length_is_the_targets_max_position_embeddings(pairs, small):
    assert context_length(pairs("qwen3", "d2")[0]) == 4096
    assert context_length(pairs("qwen3_5", "d2")[0]) == 4096
    assert context_length(small[0]) == 96
    assert context_length(types.SimpleNamespace(target=None, target_path="")) is None


def test_context_length_of_a_gguf_is_its_context_length(tmp_path):
    from tiny_gguf import write_tiny_gguf

    from dflash_mlx.loading.gguf import load_gguf

    write_tiny_gguf(tmp_path / "tiny.gguf", tmp_path)
    model, _, _ = load_gguf(tmp_path / "tiny.gguf")
    assert context_length(model) == 256  # llama.context_length in the file


def test_stream_generate_refuses_a_prompt_longer_than_the_context(small):
    model, tok = small
    with pytest.raises(ContextLengthError, match=r"the prompt is \d+ tokens; this model's "):
        next(stream_generate(model, tok, "hello world " * 60, raw=True))
    with pytest.raises(ContextLengthError, match="context is 96 tokens"):
        generate(model, tok, list(range(5, 101)), max_tokens=2)  # exactly 96: no room left


def test_stream_generate_clamps_max_tokens_to_the_room_left(small):
    model, tok = small
    ids = list(range(10, 10 + 90))
    rs = list(stream_generate(model, tok, ids, max_tokens=50, logit_bias={3: -100}))
    assert rs[-1].finish_reason == "length" and rs[-1].generation_tokens == 96 - 90


def test_megabytes_are_refused_before_tokenizing(small, monkeypatch):
    _, tok = small
    calls = []
    monkeypatch.setattr(type(tok), "encode", lambda *a, **k: calls.append(1) or [1], raising=False)
    with pytest.raises(ContextLengthError, match=r"the prompt is 1000000 characters, at least"):
        encode_prompt(tok, "x" * 1_000_000, raw=True, context=96)
    assert calls == []
    check_chars(tok, 10, 96)  # short text passes
    check_chars(tok, 10**9, None)  # no context known: no bound


def test_text_that_is_not_utf8_is_a_one_line_error(pairs):
    model, tok = pairs("qwen3", "d2")
    bad = "def f(\udcff):"  # byte 0xff read with surrogateescape
    with pytest.raises(DFlashError, match=r"the prompt is not valid UTF-8 \(byte 0xff at char"):
        generate(model, tok, bad)
    with pytest.raises(DFlashError, match=r"messages\[1\].content is not valid UTF-8"):
        encode_prompt(
            tok, [{"role": "user", "content": "a"}, {"role": "user", "content": "\ud800"}]
        )
    with pytest.raises(DFlashError, match="the system prompt is not valid UTF-8"):
        encode_prompt(tok, "hi", system="\udc80")


def test_token_ids_outside_the_vocabulary_are_refused(pairs):
    model, tok = pairs("qwen3", "d2")
    with pytest.raises(DFlashError, match="outside this model's vocabulary"):
        generate(model, tok, [5, 10**6], max_tokens=2)
    with pytest.raises(DFlashError, match="outside this model's vocabulary"):
        generate(model, tok, "hi", max_tokens=2, logit_bias={10**6: 1.0})
    with pytest.raises(DFlashError, match="a prompt is a str, a list of token ids"):
        generate(model, tok, [object()], max_tokens=2)


def test_default_chatml_format_without_a_template(small, capsys):
    model, tok = small
    assert default_format(tok) == "chatml" and default_stops(tok) == []
    start, end = (tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>"))
    assert end_of_turn_ids(tok) == {end}
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = encode_prompt(tok, msgs)
    assert ids.count(start) == 3 and ids.count(end) == 2
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi")
    assert text.endswith("<|im_start|>assistant\n")
    assert encode_prompt(tok, "hi", system="be brief") == ids  # a str with a system message
    assert tok.decode(encode_prompt(tok, "hi")) == "hi"  # a bare str stays a completion
    encode_prompt(tok, msgs)
    err = capsys.readouterr().err
    assert err.count("note: this model has no chat template") == 1 and "ChatML" in err
    r = list(stream_generate(model, tok, msgs, max_tokens=4))[-1]
    assert r.finish_reason in ("stop", "length")


class _PlainTok:
    """A tokenizer without a template or ChatML tokens (characters as ids)."""

    chat_template = None
    bos_token = None

    def get_vocab(self):
        return {chr(i): i for i in range(32, 127)}

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]


def test_default_plain_format_without_chatml_tokens(capsys):
    tok = _PlainTok()
    assert default_format(tok) == "plain" and default_stops(tok) == ["\nUser:"]
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
    ]
    text = "".join(chr(i) for i in encode_prompt(tok, msgs))
    assert text == "System: be brief\n\nUser: hi\n\nAssistant: hello\n\nUser: bye\n\nAssistant:"
    assert end_of_turn_ids(tok) == set()
    encode_prompt(tok, msgs)
    err = capsys.readouterr().err
    assert err.count("note: this model has no chat template") == 1 and '"User: ..."' in err
