"""Reasoning items of the Responses API on a thinking model: a server on a tiny qwen3 pair
whose tokenizer has ``<think>`` / ``</think>`` and a Qwen3-style template (the generation
prompt opens ``<think>\\n``). The random model never closes its reasoning by itself: then its
whole answer is reasoning (expected: the in-process greedy answer, split by
``reasoning.split``); a ``thinking_budget`` closes it, and the chat route's
``reasoning_content`` / ``content`` are the expected items."""

import pytest
from test_server import KEY, _start, _stop
from tiny_models import thinking_pair

from dflash_mlx import generate, load
from dflash_mlx.server.reasoning import markers, split

openai = pytest.importorskip("openai")

ASK = "What is the weather in Paris?"
NO_EOS = {"3": -100}  # <|im_end|>: the answer runs to max_output_tokens


@pytest.fixture(scope="module")
def think_dirs(tmp_path_factory):
    return thinking_pair(tmp_path_factory.mktemp("thinking"))


@pytest.fixture(scope="module")
def client(think_dirs, tmp_path_factory):
    proc, url, _ = _start(tmp_path_factory.mktemp("think_resp"), *think_dirs, "--api-key", KEY)
    yield openai.OpenAI(base_url=url + "/v1", api_key=KEY, timeout=120, max_retries=0)
    _stop(proc)


def _create(client, extra=None, **kw):
    kw.setdefault("input", ASK)
    kw.setdefault("max_output_tokens", 8)
    extra = {"logit_bias": NO_EOS, **(extra or {})}
    return client.responses.create(model="think_t", temperature=0, extra_body=extra, **kw)


def _chat(client, max_tokens, **kw):
    return (
        client.chat.completions.create(
            model="think_t",
            messages=[{"role": "user", "content": ASK}],
            max_tokens=max_tokens,
            temperature=0,
            logit_bias=NO_EOS,
            **kw,
        )
        .choices[0]
        .message
    )


def test_an_unclosed_thinking_answer_is_one_reasoning_item_equal_to_the_split(client, think_dirs):
    r = _create(client)
    model, tok = load(str(think_dirs[0]), drafter=str(think_dirs[1]))
    want = generate(
        model,
        tok,
        [{"role": "user", "content": ASK}],
        max_tokens=8,
        temperature=0,
        logit_bias={3: -100},
    )
    reasoning, content = split(want, markers(tok), True)
    assert content == "" and reasoning
    assert [o.type for o in r.output] == ["reasoning"] and r.output_text == ""
    item = r.output[0]
    assert item.id.startswith("rs_") and item.summary == []
    assert [(c.type, c.text) for c in item.content] == [("reasoning_text", reasoning)]
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens == 8


def test_streamed_reasoning_deltas_join_to_the_whole_item(client):
    whole = _create(client).output[0].content[0].text
    events = list(_create(client, stream=True))
    assert len(events) < 1_000
    types = [e.type for e in events]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert events[2].item.type == "reasoning" and events[3].part.type == "reasoning_text"
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    done = [e for e in events if e.type == "response.reasoning_text.done"]
    assert deltas == done[0].text == whole
    assert types[-2:] == ["response.output_item.done", "response.incomplete"]
    assert events[-1].response.output[0].content[0].text == whole
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_reasoning_input_items_are_dropped_from_the_prompt(client):
    turn = [
        {"role": "user", "content": ASK},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [{"type": "summary_text", "text": "hm"}],
            "content": [{"type": "reasoning_text", "text": "a long thought " * 20}],
        },
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "And Rome?"},
    ]
    without = [t for t in turn if t.get("type") != "reasoning"]
    a, b = _create(client, input=turn), _create(client, input=without)
    assert a.usage.input_tokens == b.usage.input_tokens
    assert a.output[0].content[0].text == b.output[0].content[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_a_thinking_budget_ends_the_reasoning_item_and_a_message_follows(client, stream):
    want = _chat(client, 14, extra_body={"thinking_budget": 5})
    kw = {"max_output_tokens": 14, "extra": {"thinking_budget": 5}}
    if stream:
        events = list(_create(client, stream=True, **kw))
        r = events[-1].response
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == want.content
    else:
        r = _create(client, **kw)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == want.reasoning_content
    assert r.output[1].content[0].text == want.content and want.content
    assert r.usage.output_tokens_details.reasoning_tokens == 6  # 5 and the closing marker


def test_reasoning_effort_none_answers_without_a_reasoning_item(client):
    want = _chat(client, 8, reasoning_effort="none")
    r = _create(client, reasoning={"effort": "none"})
    assert [o.type for o in r.output] == ["message"] and r.output_text == want.content
    assert r.usage.output_tokens_details.reasoning_tokens == 0
