"""A thinking model's reasoning kept apart from its answer, end to end: a server on a tiny
qwen3 pair whose tokenizer has ``<think>`` / ``</think>`` and a Qwen3-style template (the
generation prompt opens ``<think>\\n``). The random model never closes its reasoning by
itself, so the thinking budget does: after N reasoning tokens the server forces ``</think>``,
and what follows is the answer (free text, a forced tool call, a JSON schema).

Expected texts are plain mlx-lm greedy decoding of the same prompt with the same budget
processor, split by ``reasoning.split``."""

import json

import pytest
from test_server import KEY, _http, _start, _stop
from tiny_models import thinking_pair

from dflash_mlx.decoding.thinking import ThinkingGate
from dflash_mlx.server.reasoning import marker_ids, markers, split

openai = pytest.importorskip("openai")

CLOSE = 321  # </think> in the tiny thinking vocabulary
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_EOS = {"3": -100}  # <|im_end|>: the answer runs to max_tokens
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def think_dirs(tmp_path_factory):
    return thinking_pair(tmp_path_factory.mktemp("thinking"))


@pytest.fixture(scope="module")
def served(think_dirs, tmp_path_factory):
    proc, url, _ = _start(tmp_path_factory.mktemp("think_srv"), *think_dirs, "--api-key", KEY)
    yield url
    _stop(proc)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served + "/v1", api_key=KEY, timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def plain(think_dirs):
    """Plain mlx-lm greedy (text, tokens) of a chat with a thinking budget (no speculation)."""
    import mlx_lm
    from mlx_lm.sample_utils import make_logits_processors

    model, tok = mlx_lm.load(str(think_dirs[0]))

    def run(messages, budget, max_tokens, enable_thinking=True):
        ids = tok.apply_chat_template(
            messages, add_generation_prompt=True, enable_thinking=enable_thinking
        )
        opened, closed = marker_ids(tok, markers(tok))
        gate = ThinkingGate(opened, closed, enable_thinking, budget=budget)
        procs = make_logits_processors({3: -100}) + [gate]
        steps = list(
            mlx_lm.stream_generate(model, tok, ids, max_tokens=max_tokens, logits_processors=procs)
        )
        return "".join(r.text for r in steps), [r.token for r in steps]

    return run


def _ask(client, **kw):
    return client.chat.completions.create(
        model="think_t", messages=ASK, temperature=0, logit_bias=NO_EOS, **kw
    )


def test_the_budget_closes_the_reasoning_and_the_split_equals_plain_greedy(client, plain):
    r = _ask(client, max_tokens=14, extra_body={"thinking_budget": 5})
    msg = r.choices[0].message
    text, tokens = plain(ASK, 5, 14)
    assert tokens[5] == CLOSE  # forced after 5 reasoning tokens
    reasoning, content = split(text, ("<think>", "</think>"), True)
    assert (msg.reasoning_content, msg.content) == (reasoning, content)
    assert r.usage.completion_tokens_details.reasoning_tokens == 6  # 5 and </think>
    assert content and "</think>" not in msg.content and "<think>" not in reasoning


def test_streamed_reasoning_and_content_join_to_the_whole_answer(client):
    whole = _ask(client, max_tokens=14, extra_body={"thinking_budget": 5}).choices[0].message
    parts = {"reasoning_content": "", "content": ""}
    for ch in _ask(client, max_tokens=14, stream=True, extra_body={"thinking_budget": 5}):
        delta = ch.choices[0].delta if ch.choices else None
        for k in parts:
            parts[k] += (getattr(delta, k, None) or "") if delta else ""
    assert parts == {"reasoning_content": whole.reasoning_content, "content": whole.content}


def test_without_a_budget_an_unclosed_answer_is_all_reasoning(client, plain):
    msg = _ask(client, max_tokens=8).choices[0].message
    text, _ = plain(ASK, None, 8)
    assert (msg.reasoning_content, msg.content) == (text.strip("\n"), "")


def test_enable_thinking_false_gives_no_reasoning(client, plain):
    r = _ask(client, max_tokens=8, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    text, _ = plain(ASK, None, 8, enable_thinking=False)
    msg = r.choices[0].message
    assert getattr(msg, "reasoning_content", None) is None
    assert msg.content == text
    off = _ask(client, max_tokens=8, reasoning_effort="none").choices[0].message
    assert getattr(off, "reasoning_content", None) is None and off.content == text


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_call_after_the_reasoning_is_a_tool_call(client, stream):
    kw = {"max_tokens": 120, "tools": [WEATHER], "tool_choice": "required"}
    kw["extra_body"] = {"thinking_budget": 4}
    if not stream:
        choice = _ask(client, **kw).choices[0]
        calls, reasoning = choice.message.tool_calls, choice.message.reasoning_content
        finish = choice.finish_reason
    else:
        calls, reasoning, finish = [], "", None
        for ch in _ask(client, stream=True, **kw):
            d = ch.choices[0].delta
            calls += d.tool_calls or []
            reasoning += getattr(d, "reasoning_content", None) or ""
            finish = ch.choices[0].finish_reason or finish
    assert reasoning and "<tool_call>" not in reasoning
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments)["city"] in ("Paris", "Rome")
    assert finish == "tool_calls"


def test_a_json_schema_applies_after_the_reasoning(client):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    rf = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    r = client.chat.completions.create(
        model="think_t", messages=ASK, temperature=0, max_tokens=60, response_format=rf,
        extra_body={"thinking_budget": 3},
    )  # fmt: skip
    msg = r.choices[0].message
    assert msg.reasoning_content and isinstance(json.loads(msg.content)["ok"], bool)


def test_earlier_reasoning_is_accepted_in_the_history(client):
    history = ASK + [
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "Paris is sunny."},
        {"role": "user", "content": "And Rome?"},
    ]
    r = client.chat.completions.create(
        model="think_t",
        messages=history,
        temperature=0,
        max_tokens=4,
        extra_body={"thinking_budget": 1},
    )
    assert r.choices[0].message.reasoning_content is not None


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"thinking_budget": -1}, "thinking_budget"),
        ({"thinking_budget": "many"}, "thinking_budget"),
        ({"chat_template_kwargs": "enable_thinking=false"}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"tokenize": True}}, "tokenize"),
        ({"chat_template_kwargs": {"enable_thinking": "no"}}, "enable_thinking"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"messages": ASK + [{"role": "assistant", "content": "a", "reasoning": 5}]}, "reasoning"),
    ],
)
def test_bad_reasoning_options_are_400_in_openais_shape(served, extra, words):
    body = {"messages": ASK, "max_tokens": 4, **extra}
    status, got = _http(served + "/v1/chat/completions", body)
    assert status == 400, got
    assert got["error"]["type"] == "invalid_request_error" and words in got["error"]["message"]
    ok, _ = _http(served + "/v1/chat/completions", {"messages": ASK, "max_tokens": 2})
    assert ok == 200  # the server keeps serving


# ----------------------------------------------------------------------------- Anthropic


def _messages(served, stream=False, **kw):
    """Anthropic's Messages answer: the whole message, or (thinking, text, event types)."""
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=served, api_key=KEY, timeout=120, max_retries=0)
    kw = {"model": "think_t", "messages": ASK, "max_tokens": 12, **kw}  # greedy: the default
    if not stream:
        return client.messages.create(**kw)
    thinking, text, kinds = "", "", []
    with client.messages.stream(**kw) as s:
        for ev in s:
            kinds.append(ev.type)
            if ev.type == "content_block_delta" and ev.delta.type == "thinking_delta":
                thinking += ev.delta.thinking
            elif ev.type == "content_block_delta" and ev.delta.type == "text_delta":
                text += ev.delta.text
    return thinking, text, kinds


def _openai(client, **kw):
    r = client.chat.completions.create(model="think_t", messages=ASK, max_tokens=12, **kw)
    return r.choices[0].message


def test_anthropic_thinking_blocks_hold_the_reasoning_whole_and_streamed(served, client):
    on = {"type": "enabled", "budget_tokens": 4}
    msg = _messages(served, thinking=on)
    want = _openai(client, temperature=0, extra_body={"thinking_budget": 4})
    assert [b.type for b in msg.content][:1] == ["thinking"]
    assert msg.content[0].thinking == want.reasoning_content
    text = "".join(b.text for b in msg.content if b.type == "text")
    assert text == want.content
    thinking, streamed, kinds = _messages(served, stream=True, thinking=on)
    assert (thinking, streamed) == (want.reasoning_content, want.content)
    assert "content_block_start" in kinds and kinds[-1] == "message_stop"


@pytest.mark.parametrize("thinking", [None, {"type": "disabled"}])
def test_anthropic_without_thinking_enabled_has_no_thinking_block(served, client, thinking):
    kw = {} if thinking is None else {"thinking": thinking}
    msg = _messages(served, **kw)
    off = _openai(
        client, temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert all(b.type != "thinking" for b in msg.content)
    assert "".join(b.text for b in msg.content if b.type == "text") == off.content
    thinking_text, _, kinds = _messages(served, stream=True, **kw)
    assert thinking_text == "" and kinds[-1] == "message_stop"


def test_anthropic_takes_earlier_thinking_blocks_as_input(served):
    turn = [
        {"type": "thinking", "thinking": "Paris is sunny.", "signature": "x"},
        {"type": "text", "text": "Sunny."},
    ]
    history = ASK + [{"role": "assistant", "content": turn}, {"role": "user", "content": "Rome?"}]
    msg = _messages(served, messages=history, thinking={"type": "enabled", "budget_tokens": 2})
    assert msg.content[0].type == "thinking"


@pytest.mark.parametrize(
    "thinking, words",
    [
        ({"type": "enabled", "budget_tokens": -1}, "budget_tokens"),
        ({"type": "enabled"}, "budget_tokens"),
        ({"type": "sometimes"}, "thinking.type"),
        ("on", "thinking.type"),
    ],
)
def test_anthropic_bad_thinking_is_400_in_anthropics_shape(served, thinking, words):
    body = {"model": "m", "messages": ASK, "max_tokens": 4, "thinking": thinking}
    status, got = _http(served + "/v1/messages", body)
    assert status == 400, got
    assert got["type"] == "error" and got["error"]["type"] == "invalid_request_error"
    assert words in got["error"]["message"]
    ok, _ = _http(served + "/v1/messages", {"model": "m", "messages": ASK, "max_tokens": 2})
    assert ok == 200


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_tool_use_after_thinking(served, stream):
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    body = {
        "model": "m", "messages": ASK, "max_tokens": 120, "tools": [tool],
        "tool_choice": {"type": "any"}, "thinking": {"type": "enabled", "budget_tokens": 3},
    }  # fmt: skip
    if not stream:
        status, msg = _http(served + "/v1/messages", body)
        assert status == 200, msg
        kinds = [b["type"] for b in msg["content"]]
        use = msg["content"][-1]
        assert kinds[0] == "thinking" and kinds[-1] == "tool_use"
        assert msg["stop_reason"] == "tool_use" and use["input"]["city"] in ("Paris", "Rome")
        return
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=served, api_key=KEY, timeout=120, max_retries=0)
    with client.messages.stream(**body) as s:
        final = s.get_final_message()
    assert final.content[0].type == "thinking"
    assert final.content[-1].type == "tool_use" and final.stop_reason == "tool_use"


def test_anthropic_count_tokens_renders_the_thinking_switch(served):
    def count(**kw):
        body = {"model": "m", "messages": ASK, **kw}
        status, got = _http(served + "/v1/messages/count_tokens", body)
        assert status == 200, got
        return got["input_tokens"]

    on = count(thinking={"type": "enabled", "budget_tokens": 8})
    assert count() == count(thinking={"type": "disabled"}) > on  # "<think>\n\n</think>\n\n"


def test_usage_adds_up_the_same_way_in_every_api(served, client):
    """One greedy answer (5 reasoning tokens, then </think> forced, 14 in all) through chat,
    Responses and Anthropic: the same prompt, output and reasoning tokens (the thinking
    section with its closing marker) in each; Anthropic's ``input_tokens`` is the uncached
    part of the prompt, ``cache_read_input_tokens`` the rest."""
    budget = {"thinking_budget": 5}  # no logit_bias: Anthropic's API has none
    chat = client.chat.completions.create(
        model="think_t", messages=ASK, max_tokens=14, temperature=0, extra_body=budget
    ).usage
    resp = client.responses.create(
        model="think_t", input=ASK, max_output_tokens=14, temperature=0, extra_body=budget
    ).usage
    body = {
        "model": "think_t",
        "messages": ASK,
        "max_tokens": 14,
        "thinking": {"type": "enabled", "budget_tokens": 5},
    }
    status, anth = _http(served + "/v1/messages", body)
    assert status == 200, anth
    anth = anth["usage"]
    assert chat.completion_tokens == resp.output_tokens == anth["output_tokens"] > 6
    reasoning = chat.completion_tokens_details.reasoning_tokens
    assert reasoning == resp.output_tokens_details.reasoning_tokens == 6
    assert anth["output_tokens_details"]["reasoning_tokens"] == 6
    cached = anth["cache_read_input_tokens"]
    assert cached > 0  # the same prompt a third time
    assert anth["input_tokens"] + cached == chat.prompt_tokens == resp.input_tokens
