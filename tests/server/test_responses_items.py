"""The Responses API's request side without a server: items and fields translated into the
chat request the server speaks, errors naming this API's fields, and the bounded store."""

import pytest

from dflash_mlx.server.responses import respell, to_chat
from dflash_mlx.server.responses_store import Store
from dflash_mlx.server.schema import APIError, bad

CALL = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"a": 1}'}


def _chat(body, store=None):
    return to_chat(body, store or Store())[0]


def _refused(body, store=None, status=400) -> dict:
    with pytest.raises(APIError) as e:
        to_chat(body, store or Store())
    assert e.value.status == status and "\n" not in e.value.message
    return e.value.body()["error"]


def test_a_string_input_and_instructions_become_system_and_user_messages():
    chat = _chat({"input": "hi", "instructions": "Be brief.", "max_output_tokens": 7})
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    assert chat["max_tokens"] == 7 and "max_output_tokens" not in chat


def test_items_become_messages_tool_calls_and_tool_results():
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "x"}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "ok"}],
        },
        CALL,
        {**CALL, "call_id": "call_2", "arguments": ""},
        {"type": "function_call_output", "call_id": "call_1", "output": "one"},
        {
            "type": "function_call_output",
            "call_id": "call_2",
            "output": [{"type": "input_text", "text": "two"}],
        },
    ]
    msgs = _chat({"input": items})["messages"]
    assert [m["role"] for m in msgs] == ["developer", "user", "assistant", "tool", "tool"]
    turn = msgs[2]
    assert turn["content"] == "ok"  # the reasoning item left nothing behind
    assert [c["id"] for c in turn["tool_calls"]] == ["call_1", "call_2"]
    assert [c["function"]["arguments"] for c in turn["tool_calls"]] == ['{"a": 1}', "{}"]
    assert msgs[3] == {"role": "tool", "tool_call_id": "call_1", "content": "one"}
    assert msgs[4]["content"] == "two"


def test_flat_function_tools_choice_and_text_format_become_chat_fields():
    params = {"type": "object", "properties": {}}
    body = {
        "input": "x",
        "tools": [{"type": "function", "name": "f", "description": "d", "parameters": params}],
        "tool_choice": {"type": "function", "name": "f"},
        "text": {"format": {"type": "json_schema", "name": "s", "schema": params}},
        "temperature": 0.5,
        "top_p": 0.9,
        "parallel_tool_calls": False,
    }
    chat = _chat(body)
    fn = {"name": "f", "description": "d", "parameters": params}
    assert chat["tools"] == [{"type": "function", "function": fn}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "s", "schema": params},
    }
    assert (chat["temperature"], chat["top_p"], chat["parallel_tool_calls"]) == (0.5, 0.9, False)


def test_previous_response_id_prepends_the_held_conversation_without_its_instructions():
    store = Store()
    held = [{"type": "message", "role": "user", "content": "first"}, CALL]
    store.put({"id": "resp_a"}, held)
    body = {
        "previous_response_id": "resp_a",
        "instructions": "new rules",
        "input": [{"type": "function_call_output", "call_id": "call_1", "output": "42"}],
    }
    chat, items = to_chat(body, store)
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool"]
    assert chat["messages"][0]["content"] == "new rules"
    assert items == held + body["input"]  # what the next turn resumes


@pytest.mark.parametrize(
    "body,param,words",
    [
        ({"input": 5}, "input", "'input' must be a string or a list"),
        ({"input": []}, "input", "'input' is empty"),
        ({"input": [{"type": "computer_call"}]}, "input", "input[0].type 'computer_call'"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "item_reference"),
        ({"input": [{"role": "robot", "content": "a"}]}, "input", "input[0].role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input",
            "input[0].content[0].image_url must be a data: URL",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": ["x"]}]}]},
            "input",
            "only text and image parts",
        ),
        ({"input": [{**CALL, "arguments": "{"}]}, "input", "input[0].arguments is not valid"),
        ({"input": [{**CALL, "arguments": "[1]"}]}, "input", "must be a JSON object"),
        ({"input": [{**CALL, "call_id": None}]}, "input", "input[0].call_id"),
        ({"input": "a", "instructions": 3}, "instructions", "'instructions' must be a string"),
        ({"input": "a", "tools": [{"type": "web_search"}]}, "tools", "only function tools"),
        ({"input": "a", "tools": {}}, "tools", "'tools' must be a list"),
        ({"input": "a", "tool_choice": {"type": "mcp"}}, "tool_choice", "'tool_choice' must"),
        ({"input": "a", "text": {"format": {"type": "xml"}}}, "text", "'text.format.type'"),
        ({"input": "a", "text": {"format": {"type": "json_schema"}}}, "text", "schema"),
        ({"input": "a", "background": True}, "background", "background"),
        ({"input": "a", "previous_response_id": 1}, "previous_response_id", "a string"),
        ({"input": "a", "store": "yes"}, "store", "'store' must be a boolean"),
        ("text", None, "JSON object"),
    ],
)
def test_bad_input_is_a_400_naming_the_responses_field(body, param, words):
    err = _refused(body)
    assert err["param"] == param and words in err["message"], err
    assert err["type"] == "invalid_request_error"


def test_a_previous_response_not_held_is_a_404():
    err = _refused({"input": "a", "previous_response_id": "resp_gone"}, status=404)
    assert err["param"] == "previous_response_id" and "resp_gone" in err["message"]
    assert err["code"] == "previous_response_not_found"


def test_chat_errors_are_respelled_in_this_apis_field_names():
    e = respell(bad("'max_tokens' must be at least 1 (got 0)", "max_tokens"))
    assert e.param == "max_output_tokens" and "'max_output_tokens'" in e.message
    e = respell(bad("'response_format.json_schema.schema' is not usable", "response_format"))
    assert e.param == "text" and "'text.format.schema'" in e.message


def test_the_store_drops_the_oldest_past_its_count_and_its_bytes():
    store = Store(max_held=2, max_bytes=10_000)
    for rid in ("a", "b", "c"):
        store.put({"id": rid}, [])
    assert store.get("a") is None and store.get("b") and store.get("c")
    store.put({"id": "big"}, ["x" * 9_980])  # with "c", past the bytes
    assert store.get("b") is None and store.get("c") is None and store.get("big")
    store.put({"id": "huge"}, ["x" * 20_000])  # larger than the cap alone: not held
    assert store.get("huge") is None and store.get("big")
