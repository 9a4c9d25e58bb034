"""What the server accepts of the JSON it reads itself (``dflash_mlx.server.limits``): depth,
size and finite numbers, schemas that some finite value can match, and each API's spelling of
a field's path. Pure Python, no server."""

from __future__ import annotations

import pytest

from dflash_mlx.server.limits import (
    ANTHROPIC,
    MAX_BODY_DEPTH,
    MAX_DEPTH,
    OPENAI,
    InputError,
    check_body,
    check_json,
    check_schema,
    load_json,
)


def _nest(n: int, leaf, wrap):
    for _ in range(n):
        leaf = wrap(leaf)
    return leaf


def _refused(fn, *args) -> str:
    with pytest.raises(InputError) as e:
        fn(*args)
    return str(e.value)


def test_depth_size_and_numbers_are_bounded_and_the_path_is_named():
    where = "tools[0].function.parameters"
    ok = _nest(MAX_DEPTH - 1, {}, lambda s: {"a": s})
    check_json(ok, where)
    msg = _refused(check_json, {"a": ok}, where)
    assert msg.startswith(f"{where} is nested too deeply") and f"at {where}.a.a" in msg
    assert "is NaN; numbers must be finite" in _refused(check_json, {"b": [1, float("nan")]}, "x")
    assert "x.b[1] is NaN" in _refused(check_json, {"b": [1, float("nan")]}, "x")
    assert "x.b.1 is Infinity" in _refused(check_json, {"b": [1, float("inf")]}, "x", ANTHROPIC)
    # the list counts as a value too
    assert "more than 10 values" in _refused(check_json, list(range(10)), "x", OPENAI, 64, 10)
    check_json(list(range(9)), "x", OPENAI, 64, 10)


def test_a_body_is_bounded_in_depth_only_and_names_its_top_field():
    check_body({"temperature": float("nan"), "stop": [[1]]})  # the field's own check says so
    deep = {"tools": [_nest(MAX_BODY_DEPTH, 1, lambda s: [s])]}
    with pytest.raises(InputError) as e:
        check_body(deep)
    assert e.value.field == "tools" and "(at tools[0][0]" in str(e.value)
    with pytest.raises(InputError, match=r"\(at tools\.0\.0"):
        check_body(deep, ANTHROPIC)


def test_embedded_json_text_is_parsed_within_the_limits():
    where = "messages[1].tool_calls[0].function.arguments"
    assert load_json('{"a": [1, 2]}', where) == {"a": [1, 2]}
    for text in ("[" * 5000 + "]" * 5000, "[" * 100 + "]" * 100):  # the reader's limit; ours
        assert _refused(load_json, text, where).startswith(f"{where} is nested too deeply")
    assert "is NaN" in _refused(load_json, '{"x": NaN}', where)
    assert "not valid JSON" in _refused(load_json, "{oops", where)


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#"},
        {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
        {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        {"anyOf": [{"$ref": "#"}, {"allOf": [{"$ref": "#"}]}]},
    ],
)
def test_schemas_no_finite_value_matches_are_refused(schema):
    assert "no finite JSON value matches" in _refused(check_schema, schema, "s")


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {"$ref": "#"}}},  # optional
        {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#"}}}},
        {  # a way out through another definition
            "$defs": {
                "a": {"anyOf": [{"$ref": "#/$defs/b"}, {"type": "string"}]},
                "b": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}},
            },
            "$ref": "#/$defs/b",
            "required": ["x"],
        },
        {"$ref": "#/$defs/missing"},  # llguidance names this one
        {"$ref": ["not", "a", "string"]},
        {"type": ["null", "object"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    ],
)
def test_schemas_with_a_way_out_pass(schema):
    check_schema(schema, "s")


def test_names_spell_paths_as_each_api_does():
    assert OPENAI.tool(2, "parameters") == "tools[2].function.parameters"
    assert ANTHROPIC.tool(2, "parameters") == "tools.2.input_schema"
    assert ANTHROPIC.tool(0, "name") == "tools.0.name"
    assert (OPENAI.choice_name, ANTHROPIC.choice_name) == (
        "tool_choice.function.name",
        "tool_choice.name",
    )
    keys = tuple(range(10))
    assert OPENAI.path("x", keys, shown=2) == "x[0][1]..."
    assert ANTHROPIC.path("x", ("a", 0)) == "x.a.0"
