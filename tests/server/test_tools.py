"""Tool calls: parsing answers (whole and streamed) in the Hermes / Qwen3 and Llama 3 formats,
validating tools, rendering the history for templates with and without tool support, and the
grammar that forces a call."""

import json

import llguidance
import pytest

from dflash_mlx.server.schema import APIError
from dflash_mlx.server.tool_request import (
    FALLBACK_PROMPT,
    ToolSpec,
    call_grammar,
    history_fields,
    parse_tools,
    render,
)
from dflash_mlx.server.tools import HERMES, LLAMA3, CallStream, parse_calls, tool_format

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


class Tok:
    def __init__(self, template=None):
        self.chat_template = template


def test_hermes_calls_are_parsed_with_the_text_around_them():
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    text += '</tool_call>\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    content, calls = parse_calls(text, HERMES)
    assert content.strip() == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("f", {}),
    ]
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id


def test_only_calls_give_no_content_and_bad_json_stays_text():
    assert parse_calls('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>')[0] is None
    content, calls = parse_calls("<tool_call>{not json}</tool_call>")
    assert calls == [] and content == "<tool_call>{not json}</tool_call>"
    _, calls = parse_calls('<tool_call>{"name": "f", "arguments": {"a": 1}}')  # unterminated
    assert [c.name for c in calls] == ["f"]


def test_llama3_json_calls_with_python_tag_and_semicolons():
    _, calls = parse_calls('<|python_tag|>{"name": "a", "parameters": {"x": 1}}', LLAMA3)
    assert [(c.name, c.arguments) for c in calls] == [("a", '{"x": 1}')]
    _, calls = parse_calls(
        '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}', LLAMA3
    )
    assert [c.name for c in calls] == ["a", "b"]
    assert parse_calls("The answer is 4.", LLAMA3) == ("The answer is 4.", [])


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3])
def test_a_stream_cut_anywhere_gives_the_same_text_and_calls(fmt):
    if fmt == HERMES:
        text = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
        text += "\n</tool_call>"
    else:
        text = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    for cut in range(1, 12):
        s = CallStream(fmt)
        events = []
        for i in range(0, len(text), cut):
            events += s.feed(text[i : i + cut])
        events += s.close()
        texts = "".join(v for k, v in events if k == "text")
        calls = [(v.name, v.arguments) for k, v in events if k == "call"]
        assert calls == [("get_weather", '{"city": "Oslo"}')]
        assert texts.strip() == ("Sure." if fmt == HERMES else "")


def test_text_that_only_looks_like_a_call_start_is_released():
    s = CallStream(HERMES)
    assert s.feed("a <tool") == [("text", "a ")]
    assert s.feed("box> b") == [("text", "<toolbox> b")]


def test_template_formats():
    assert tool_format("{% if tools %}<tool_call>{% endif %}") == HERMES
    assert tool_format("<|python_tag|>{{ tools }}") == LLAMA3
    assert tool_format("{{ messages }}") == HERMES


@pytest.mark.parametrize(
    "body,field,words",
    [
        ({"tools": {"a": 1}}, "tools", "list"),
        ({"tools": [{"type": "function"}]}, "tools", "tools[0].function"),
        ({"tools": [{"function": {"name": "a b"}}]}, "tools", "name"),
        (
            {"tools": [{"function": {"name": "f", "parameters": {"type": "foo"}}}]},
            "tools",
            "parameters",
        ),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "one of"),
        ({"tools": [WEATHER], "tool_choice": {"function": {"name": "g"}}}, "tool_choice", "'g'"),
        ({"tool_choice": "required"}, "tool_choice", "no 'tools'"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "same name"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ],
)
def test_malformed_tools_are_400_naming_the_field(body, field, words):
    with pytest.raises(APIError) as e:
        parse_tools(body, Tok())
    assert e.value.status == 400 and e.value.param == field and words in e.value.message


def test_history_calls_are_checked_and_arguments_become_objects():
    m = {
        "role": "assistant",
        "tool_calls": [
            {"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
        ],
    }
    assert history_fields(m, 1)["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}
    m["tool_calls"][0]["function"]["arguments"] = "{oops"
    with pytest.raises(APIError, match=r"messages\[1\].tool_calls\[0\].function.arguments"):
        history_fields(m, 1)


def test_fallback_render_writes_tools_calls_and_results_as_text():
    spec = parse_tools({"tools": [WEATHER], "tool_choice": "required"}, Tok("{{ messages }}"))
    assert not spec.native and spec.forced
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {}}}
    msgs = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]
    out, tools = render(msgs, spec)
    assert tools is None
    assert out[0]["role"] == "system" and '"get_weather"' in out[0]["content"]
    assert out[0]["content"].startswith(FALLBACK_PROMPT.split("{tools}")[0])
    assert out[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',
    }
    assert out[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}


def test_native_templates_get_the_tools_and_history_as_they_are():
    spec = parse_tools({"tools": [WEATHER]}, Tok("{% for t in tools %}<tool_call>{% endfor %}"))
    msgs = [{"role": "user", "content": "hi"}]
    assert spec.native and render(msgs, spec) == (msgs, spec.tools)


def _accepts(grammar, text):
    """Whether a byte-level matcher accepts text whole (one token per byte)."""

    class Bytes:
        eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
        tokens = [bytes([i]) for i in range(256)] + [b"</s>"]

        def __call__(self, s):
            return list(s)

    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Bytes()))
    m = llguidance.LLMatcher(tok, grammar, log_level=0)
    ids = list(text.encode())
    return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()


def test_forced_call_grammar_takes_exactly_the_named_call():
    spec = ToolSpec([WEATHER], "get_weather", True, HERMES)
    g = call_grammar(spec)
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    assert _accepts(g, good)
    assert not _accepts(g, good.replace('"city"', '"town"'))
    assert not _accepts(g, good + "\n" + good)  # a named function: one call
    many = call_grammar(ToolSpec([WEATHER], "required", True, HERMES))
    assert _accepts(many, good + "\n" + good)
    llama = call_grammar(ToolSpec([WEATHER], "required", False, LLAMA3))
    assert _accepts(llama, '{"name": "get_weather", "parameters": {"city": "Rome"}}')
    assert call_grammar(ToolSpec([WEATHER], "auto")) is None


NATIVE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}TOOL {{ t.function.name }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} "
    "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n"
)


def test_a_template_with_tool_support_renders_the_tools_and_the_calls(tiny_dir):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from dflash_mlx.generation import encode_prompt
    from dflash_mlx.server.schema import parse_request
    from dflash_mlx.server.structured import prepare

    tok = load_tokenizer(tiny_dir / "qwen3")
    tok._tokenizer.chat_template = NATIVE
    call = {"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    body = {
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        "tools": [WEATHER],
    }
    req = parse_request(json.dumps(body).encode(), "chat")
    prepare(req, req.body, tok)
    assert req.tools.native and req.template_tools == req.tools.tools
    text = tok.decode(encode_prompt(tok, req.prompt, tools=req.template_tools))
    assert "TOOL get_weather" in text
    assert '<tool_call>get_weather {"city": "Rome"}</tool_call>' in text
    assert "<|im_start|>tool\nsunny" in text


def test_parallel_calls_default_to_one_with_the_fallback_prompt_only():
    body = {"tools": [WEATHER], "tool_choice": "required"}
    assert not parse_tools(body, Tok("{{ messages }}")).parallel
    assert parse_tools(body, Tok("{{ tools }}<tool_call>")).parallel
    assert parse_tools({**body, "parallel_tool_calls": True}, Tok("{{ messages }}")).parallel
    assert not parse_tools({**body, "parallel_tool_calls": False}, Tok("{{ tools }}")).parallel
