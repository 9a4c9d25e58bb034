"""The reasoning splitter (server/reasoning.py): markers from a tokenizer, a prompt that opens
the reasoning, and whole or streamed answers split into reasoning and content."""

import pytest

from dflash_mlx.server.reasoning import Splitter, markers, split, starts_open

M = ("<think>", "</think>")


class FakeTokenizer:
    def __init__(self, vocab, template):
        self.vocab, self.chat_template = vocab, template

    def get_vocab(self):
        return self.vocab


def streamed(text: str, marks, started_open: bool, step: int = 1):
    s = Splitter(marks, started_open)
    out = []
    for i in range(0, len(text), step):
        out += s.feed(text[i : i + step])
    out += s.close()
    joined = {"reasoning": "", "content": ""}
    for kind, val in out:
        joined[kind] += val
    return joined["reasoning"], joined["content"]


def test_markers_need_both_tokens_and_a_template_that_mentions_them():
    vocab = {"<think>": 5, "</think>": 6}
    assert markers(FakeTokenizer(vocab, "x {{ '<think>' }} y")) == M
    assert markers(FakeTokenizer(vocab, "no thinking here")) is None
    assert markers(FakeTokenizer({"<think>": 5}, "<think></think>")) is None
    assert markers(FakeTokenizer(vocab, None)) is None


def test_starts_open_reads_the_last_marker_of_the_prompt():
    tok = FakeTokenizer({"<think>": 5, "</think>": 6}, "<think>")
    assert starts_open(tok, [1, 2, 5, 7])
    assert not starts_open(tok, [1, 5, 7, 6, 8])  # enable_thinking false: opened and closed
    assert not starts_open(tok, [1, 2, 3])
    assert starts_open(tok, "a<think>\n")
    assert not starts_open(tok, "a<think>\n\n</think>\n\n")
    assert not starts_open(FakeTokenizer({}, ""), [5])  # no markers: never


@pytest.mark.parametrize(
    "text, started_open, want",
    [
        ("\nLet me see.\n</think>\n\nHello", True, ("Let me see.", "Hello")),
        ("<think>\nhmm\n</think>\n\nHi", False, ("hmm", "Hi")),
        ("  <think>a</think>b", False, ("a", "b")),
        ("Hi <think>x</think>", False, (None, "Hi <think>x</think>")),
        ("still thinking\n", True, ("still thinking", "")),
        ("</think>\n\nHi", True, ("", "Hi")),
        ("a\n\nb</think>c\n\nd", True, ("a\n\nb", "c\n\nd")),
        ("\n\n x", False, (None, "\n\n x")),
    ],
)
def test_split_separates_reasoning_from_content(text, started_open, want):
    assert split(text, M, started_open) == want


def test_split_without_markers_is_all_content():
    assert split("<think>a</think>b", None, True) == (None, "<think>a</think>b")


@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_streamed_pieces_join_to_the_whole_split(step):
    for text, started in [
        ("\nI think\n\nso.\n</think>\n\n<tool_call>x", True),
        ("<think>\nhmm</thi nk</think>\n\nHi\n", False),
        ("<thin", False),
        ("\n\n<think>", False),
    ]:
        whole = split(text, M, started)
        got = streamed(text, M, started, step)
        assert got == (whole[0] or "", whole[1]), (text, step)


def test_a_partial_closing_marker_is_held_back_until_it_is_decided():
    s = Splitter(M, True)
    assert s.feed("abc</thi") == [("reasoning", "abc")]
    assert s.feed("nk>\n\nok") == [("content", "ok")]
    s = Splitter(M, True)
    assert s.feed("abc</thi") == [("reasoning", "abc")]
    assert s.feed("s is text") == [("reasoning", "</this is text")]


def test_an_answer_that_does_not_open_the_reasoning_streams_as_content_at_once():
    s = Splitter(M, False)
    assert s.feed("  ") == []  # might still open with <think>
    assert s.feed("Hello") == [("content", "  Hello")]
    assert s.feed(" <think>") == [("content", " <think>")]


def test_tool_calls_are_parsed_after_the_reasoning_only():
    from dflash_mlx.server.structured import DeltaStream, message
    from dflash_mlx.server.tool_request import ToolSpec

    spec = ToolSpec(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    call = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    text = f"\nmaybe {call}?\n</think>\n\n{call}"
    msg, finish = message(text, spec, "stop", M, True)
    assert msg["reasoning_content"] == f"maybe {call}?"  # a call while reasoning is not one
    assert msg["content"] is None and len(msg["tool_calls"]) == 1 and finish == "tool_calls"
    stream, deltas = DeltaStream(spec, M, True), []
    for i in range(0, len(text), 5):
        deltas += stream.deltas(text[i : i + 5], i + 5 >= len(text))
    assert "".join(d.get("reasoning_content", "") for d in deltas) == msg["reasoning_content"]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert [c["function"]["arguments"] for c in calls] == ['{"x": 1}']
    assert stream.finish("stop") == "tool_calls"


def test_a_model_without_markers_keeps_its_answer_as_content():
    from dflash_mlx.server.structured import DeltaStream, message

    msg, _ = message("<think>a</think>b", None, "stop")
    assert msg == {"role": "assistant", "content": "<think>a</think>b"}
    assert DeltaStream(None).deltas("<think>a", False) == [{"content": "<think>a"}]


def test_other_single_token_marker_pairs_are_found():
    vocab = {"<|think:start|>": 7, "<|think:end|>": 8}
    tok = FakeTokenizer(vocab, "{{ '<|think:start|>' }}")
    assert markers(tok) == ("<|think:start|>", "<|think:end|>")
    assert starts_open(tok, [1, 7]) and not starts_open(tok, [7, 8])


def test_template_variables_the_template_cannot_use_are_a_one_line_error():
    from dflash_mlx.decoding.prompt import chat_ids
    from dflash_mlx.errors import DFlashError

    class Strict(FakeTokenizer):
        def apply_chat_template(self, messages, **kw):
            return "x" + kw["budget"]  # a template adding a str to the variable

    tok = Strict({}, "{{ budget }}")
    with pytest.raises(DFlashError, match=r"\['budget'\].*TypeError"):
        chat_ids(tok, [{"role": "user", "content": "hi"}], template_kwargs={"budget": 5})
    with pytest.raises(KeyError):  # without template variables: not the input's fault
        chat_ids(tok, [{"role": "user", "content": "hi"}])


def test_reasoning_tokens_are_the_thinking_section_with_the_markers_the_model_wrote():
    from dflash_mlx.server.reasoning import ReasoningTokens

    tok = FakeTokenizer({"<think>": 5, "</think>": 6}, "<think>")
    opened = ReasoningTokens(tok, M, True)  # the prompt wrote <think>: not the answer's
    for piece in ([1, 2], [3, 6, 4], [5, 7]):
        opened.feed(piece)
    assert opened.count == 4  # 1, 2, 3 and </think>
    own = ReasoningTokens(tok, M, False)
    own.feed([5, 1, 1, 6, 2])
    assert own.count == 4  # <think>, 1, 1, </think>
    none = ReasoningTokens(tok, M, False)
    none.feed([1, 5, 2])  # no opening marker first: no reasoning
    assert none.count == 0
    assert ReasoningTokens(tok, None, True).count is None
