"""What the server accepts of the JSON it reads itself: how deep and how large a request
body, a JSON schema (``response_format``, tool parameters) or a tool call's arguments may be,
finite numbers only, and schemas that some JSON value can match; and how each API spells the
path to a field in its errors (OpenAI ``tools[0].function.parameters``, Anthropic
``tools.0.input_schema``).

Every check walks iteratively (no Python recursion) and raises ``InputError``, whose message
names the field; each API wraps it in its own error shape. No MLX.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

MAX_BODY_DEPTH = 96  # arrays and objects nested in a request body
MAX_DEPTH = 64  # ... in one schema, tool parameters or tool call's arguments
MAX_SCHEMA_VALUES = 10_000  # values in one schema (each costs grammar compile time)
MAX_ARGUMENT_VALUES = 100_000  # values in one tool call's arguments
REF_BUDGET = 200_000  # schema nodes visited to decide that a self-reference can end


class InputError(ValueError):
    """A JSON value the server refuses; the message names the field and says why.

    Attributes:
        field: the request's top-level field at fault, when known (OpenAI's ``param``).
    """

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Names:
    """How an API writes the path to a field in its error messages.

    Attributes:
        api: "openai" (``tools[0].function.parameters``) or "anthropic"
            (``tools.0.input_schema``, with the Messages API's own field names).
    """

    api: str

    @property
    def anthropic(self) -> bool:
        return self.api == "anthropic"

    def key(self, path: str, k: Any) -> str:
        """``path`` followed by one key (a name) or index (a number)."""
        if isinstance(k, int) and not self.anthropic:
            return f"{path}[{k}]"
        return f"{path}.{k}" if path else str(k)

    def path(self, path: str, keys: tuple, shown: int = 8) -> str:
        """``path`` followed by ``keys`` (the first ``shown`` of them, then '...')."""
        for k in keys[:shown]:
            path = self.key(path, k)
        return path + ("..." if len(keys) > shown else "")

    def tool(self, i: int, field: str = "") -> str:
        """A tool's field: OpenAI ``tools[i].function.<field>``, Anthropic ``tools.i.<field>``
        (``parameters`` is Anthropic's ``input_schema``)."""
        if self.anthropic:
            field = {"parameters": "input_schema"}.get(field, field)
            return f"tools.{i}" + (f".{field}" if field else "")
        return f"tools[{i}].function" + (f".{field}" if field else "")

    @property
    def choice_name(self) -> str:
        """The name of a forced tool in ``tool_choice``."""
        return "tool_choice.name" if self.anthropic else "tool_choice.function.name"


OPENAI, ANTHROPIC = Names("openai"), Names("anthropic")


def _problem(
    value: Any, max_depth: int, max_values: int | None, finite: bool = True
) -> tuple[str, Any, tuple] | None:
    """("depth" | "values" | "number", the number, the keys to it) or None; ``finite``:
    NaN and Infinity are problems."""
    stack, count = [(value, 1, ())], 0
    while stack:
        node, depth, keys = stack.pop()
        count += 1
        if depth > max_depth:
            return "depth", None, keys
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            if isinstance(v, (dict, list)):
                stack.append((v, depth + 1, (*keys, k)))
                continue
            count += 1
            if finite and isinstance(v, float) and not math.isfinite(v):
                return "number", v, (*keys, k)
        if max_values is not None and count > max_values:
            return "values", None, ()
    return None


def check_json(
    value: Any,
    where: str,
    names: Names = OPENAI,
    max_depth: int = MAX_DEPTH,
    max_values: int | None = None,
) -> None:
    """Refuse a JSON value nested too deeply, too large, or holding NaN / Infinity.

    Args:
        value: a parsed JSON value. where: its field, as ``names`` writes it.
        max_depth: arrays and objects nested at most this deep. max_values: at most this
            many values (None: any number).

    Raises:
        InputError: naming ``where`` (and the path inside it).
    """
    if isinstance(value, float) and not math.isfinite(value):
        raise InputError(f"{where} is {json.dumps(value)}; numbers must be finite")
    found = _problem(value, max_depth, max_values) if isinstance(value, (dict, list)) else None
    if found is None:
        return
    kind, number, keys = found
    if kind == "number":
        raise InputError(
            f"{names.path(where, keys)} is {json.dumps(number)}; numbers must be finite"
        )
    if kind == "values":
        raise InputError(f"{where} is too large: more than {max_values} values")
    raise InputError(
        f"{where} is nested too deeply: more than {max_depth} levels of arrays and objects "
        f"(at {names.path(where, keys)}); flatten it"
    )


def check_body(body: dict, names: Names = OPENAI) -> None:
    """Refuse a request body that nests arrays and objects over ``MAX_BODY_DEPTH`` deep,
    before anything reads it further (``repr``, ``json.dumps`` and the template recurse).

    Raises:
        InputError: naming the path to the deepest part and, as ``field``, its top field.
    """
    found = _problem(body, MAX_BODY_DEPTH, None, finite=False)  # fields check their numbers
    if found is None:
        return
    keys = found[2]
    raise InputError(
        f"the request body is nested too deeply: more than {MAX_BODY_DEPTH} levels of arrays "
        f"and objects (at {names.path('', keys)}); flatten it",
        str(keys[0]) if keys else None,
    )


def load_json(text: str, where: str, names: Names = OPENAI) -> Any:
    """JSON text that a field carries (a tool call's ``arguments``), parsed and checked
    (``MAX_DEPTH`` deep, ``MAX_ARGUMENT_VALUES`` values, finite numbers).

    Raises:
        InputError: not JSON, or over a limit, naming ``where``.
    """
    try:
        value = json.loads(text)
    except RecursionError:
        raise InputError(
            f"{where} is nested too deeply: more than {MAX_DEPTH} levels of arrays and objects"
        ) from None
    except ValueError as e:
        raise InputError(f"{where} is not valid JSON ({e})") from None
    check_json(value, where, names, MAX_DEPTH, MAX_ARGUMENT_VALUES)
    return value


def check_schema(schema: Any, where: str, names: Names = OPENAI) -> None:
    """Refuse a JSON schema before a grammar is built from it: nested over ``MAX_DEPTH``,
    over ``MAX_SCHEMA_VALUES`` values, a number that is not finite (``"minimum": NaN``), or
    no finite JSON value can match it (a ``$ref`` that can only refer back to itself, as
    ``{"$ref": "#"}`` or a required property whose schema is its parent's).

    Raises:
        InputError: naming ``where``.
    """
    check_json(schema, where, names, MAX_DEPTH, MAX_SCHEMA_VALUES)
    if isinstance(schema, dict):
        loop = _endless_ref(schema)
        if loop is not None:
            raise InputError(
                f"{where}: no finite JSON value matches this schema ('$ref': {loop!r} can only "
                "refer back to itself); give the self-reference a way out (optional or in "
                "an array that may be empty)"
            )


# ------------------------------------------------------------------ self-references


class _OutOfBudget(Exception):
    pass


def _resolve(root: dict, ref: str) -> Any:
    """The schema a local ``$ref`` ('#' or a '#/a/b' JSON pointer) names; None otherwise."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _refs(schema: dict) -> dict[str, Any]:
    """Every local ``$ref`` of a schema that resolves, and the schema it names."""
    out, stack = {}, [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref not in out:
                target = _resolve(schema, ref)
                if target is not None:
                    out[ref] = target
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return out


def _endless_ref(schema: dict) -> str | None:
    """A ``$ref`` that keeps the schema from matching any finite value, or None.

    Which refs can end is a least fixpoint: a ref ends once its schema can be matched with
    refs already known to end. What this does not model (keywords, external refs) counts as
    matchable, so a schema is refused only when no finite value can match it."""
    refs = _refs(schema)
    pending, budget = set(refs), [REF_BUDGET]
    try:
        changed = True
        while changed:
            changed = False
            for ref in sorted(pending):
                if _ends(refs[ref], pending, budget):
                    pending.discard(ref)
                    changed = True
        if _ends(schema, pending, budget):
            return None
    except _OutOfBudget:  # too large to decide here: llguidance decides
        return None
    return min(pending) if pending else None


def _ends(node: Any, pending: set, budget: list) -> bool:
    """Whether some finite JSON value matches ``node`` while the refs in ``pending`` are not
    known to end."""
    budget[0] -= 1
    if budget[0] < 0:
        raise _OutOfBudget
    if not isinstance(node, dict):
        return node is not False
    ref = node.get("$ref")
    if isinstance(ref, str) and ref in pending:
        return False
    if "const" in node or "enum" in node:
        return True
    if not all(_ends(s, pending, budget) for s in _list(node.get("allOf"))):
        return False
    for key in ("anyOf", "oneOf"):
        options = _list(node.get(key))
        if options and not any(_ends(s, pending, budget) for s in options):
            return False
    types = node.get("type")
    if isinstance(types, str):
        types = [types]
    if not isinstance(types, list):
        return True  # any type: a string matches
    return any(_type_ends(t, node, pending, budget) for t in types)


def _list(v: Any) -> list:
    return v if isinstance(v, list) else []


def _type_ends(kind: Any, node: dict, pending: set, budget: list) -> bool:
    """Whether a finite value of JSON type ``kind`` matches ``node``."""
    if kind == "object":
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        required = [r for r in _list(node.get("required")) if isinstance(r, str)]
        return all(_ends(props.get(r, True), pending, budget) for r in required)
    if kind == "array":
        least = node.get("minItems", 0)
        least = least if isinstance(least, int) and not isinstance(least, bool) else 0
        prefix = _list(node.get("prefixItems"))
        if not all(_ends(s, pending, budget) for s in prefix[:least]):
            return False
        items = node.get("items", True)
        return least <= len(prefix) or isinstance(items, list) or _ends(items, pending, budget)
    return True
