"""OpenAI request parsing and response shapes for ``dflash_mlx.server``.

Pure functions, no MLX: a request body becomes a ``CompletionRequest`` whose decoding
settings are a validated ``GenerationConfig`` (or an ``APIError`` carrying the HTTP status and
OpenAI's error object). The response shapes are ``shapes.py``'s (importable from here).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from ..settings import MAX_TOKENS, GenerationConfig, SettingError
from .limits import OPENAI, InputError, Names, check_body
from .shapes import (  # noqa: F401  (the response shapes, importable from here as before)
    SYSTEM_FINGERPRINT,
    chunk,
    completion,
    delta_chunks,
    dflash_stats,
    new_id,
    now,
    usage,
    usage_chunk,
)

# The server's decoding defaults when ``dflash serve`` gives none.
DEFAULTS = GenerationConfig(max_tokens=MAX_TOKENS["serve"])

# Request fields that are decoding settings, and the GenerationConfig field each one sets.
SETTINGS = {
    "max_completion_tokens": "max_tokens",
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "logit_bias": "logit_bias",
    "block_size": "block_size",
    "use_selector": "use_selector",
    "lookup": "lookup",
    "tree": "tree",
    "seed": "seed",
    "stop": "stop",
    "kv_bits": "kv_bits",
    "kv_group_size": "kv_group_size",
    "quantized_kv_start": "quantized_kv_start",
}

ROLES = {"system", "developer", "user", "assistant", "tool"}
TOOL_FIELDS = ("tool_calls", "tool_call_id", "name")  # checked by tool_request.history_fields


class APIError(Exception):
    """An error answered to the client as ``{"error": {...}}`` with an HTTP status."""

    TYPES: ClassVar[dict[int, str]] = {
        401: "authentication_error",
        500: "server_error",
        503: "server_error",
    }
    MAX_MESSAGE = 1000  # a message quoting a huge value stays readable

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        if len(message) > self.MAX_MESSAGE:
            message = message[: self.MAX_MESSAGE - 3] + "..."
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "invalid_request_error")
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def shutting_down() -> APIError:
    """The answer of a request the server's stop ended before it was complete."""
    return APIError(
        503,
        "the server is shutting down and ended this request before its answer was complete; "
        "retry it when the server is back",
        code="server_shutting_down",
    )


def ended(last) -> APIError | None:
    """The error of a job that ended without a finished result (``last``: its last
    GenerationResponse, or None): only a stop does that, and it is never a whole answer."""
    return shutting_down() if last is None or not last.finish_reason else None


@dataclass
class CompletionRequest:
    """A validated request.

    Attributes:
        kind: "chat" or "completion". model: the name asked for (None: the served one).
        prompt: messages (chat), a str or a list of token ids (completion).
        stream, include_usage: SSE options. gen: the decoding settings.
        body: the request object. tools, grammar, template_tools, template_kwargs (e.g.
            ``enable_thinking``), thinking_budget: set by ``structured.prepare`` (chat
            only). marks, started_open: the thinking markers and whether the prompt opens
            the reasoning (``reasoning.py``; set when the job is queued). names: how the
            client's API writes a field in an error (``limits.OPENAI`` / ``limits.ANTHROPIC``).
        images: the pictures (``vision.images.Picture``) of the messages' ``{"type":
            "image"}`` parts, in reading order (``server/images.py``). vision: with images,
            the prompt the engine prepared (``vision.prompt.VisionPrompt``: its ids, and the
            keys the prompt pool matches, an image's rows by its hash; ``app.tokenize``).
    """

    kind: str
    model: str | None
    prompt: Any
    stream: bool = False
    include_usage: bool = False
    gen: GenerationConfig = DEFAULTS
    body: dict | None = None
    tools: Any = None
    grammar: str | None = None
    template_tools: list | None = None
    template_kwargs: dict | None = None
    thinking_budget: int | None = None
    marks: tuple[str, str] | None = None
    started_open: bool = False
    names: Names = OPENAI
    images: list = field(default_factory=list)
    vision: Any = None


def _n(body: dict) -> None:
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise bad("only n=1 is supported", "n")


def _logit_bias(lb) -> Any:
    """JSON object keys are strings: token ids come back as ints (values are checked later)."""
    if not isinstance(lb, dict):
        return lb
    out = {}
    for k, v in lb.items():
        try:
            out[int(k)] = v
        except (TypeError, ValueError):
            raise bad(f"'logit_bias' key {k!r} is not a token id", "logit_bias") from None
    return out or None


def _settings(body: dict, defaults: GenerationConfig, max_block: int | None):
    """The request's decoding settings over the server's defaults, validated.

    ``max_completion_tokens`` wins over ``max_tokens``; unset (null) fields keep the default.
    """
    got: dict[str, Any] = {}
    for key, name in SETTINGS.items():
        if body.get(key) is not None and name not in got:
            got[name] = body[key]
    if "logit_bias" in got:
        got["logit_bias"] = _logit_bias(got["logit_bias"])
    try:
        return replace(defaults, **got).validate(max_block)
    except SettingError as e:
        raise bad(str(e), e.field) from None


def _content(msg: dict, i: int, images) -> str | list:
    """A message's content: its text, or (with images) its text and ``{"type": "image"}``
    parts in order, the pictures kept by ``images`` (a ``server.images.Gather``; None:
    text only)."""
    c = msg.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if not isinstance(c, list):
        raise bad(f"messages[{i}].content must be a string or a list of parts", "messages")
    parts: list = []
    for j, p in enumerate(c):
        if isinstance(p, str):
            parts.append(p)
        elif isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
            parts.append(p["text"])
        elif images is not None and (img := images.part(p, f"messages[{i}].content[{j}]")):
            parts.append(img)
        else:
            kind = p.get("type") if isinstance(p, dict) else type(p).__name__
            raise bad(
                f"messages[{i}].content[{j}]: only text and image_url parts are supported "
                f"(got {kind!r})",
                "messages",
            )
    return images.content(parts) if images is not None else "".join(parts)


def _messages(body: dict, images=None) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m["role"] not in ROLES:
            raise bad(f"messages[{i}] needs a 'role' among {sorted(ROLES)}", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        extra = {k: m[k] for k in TOOL_FIELDS if m.get(k) is not None}
        thought = m.get("reasoning_content", m.get("reasoning"))  # vLLM's, mlx-lm's name
        if thought is not None and role == "assistant":
            if not isinstance(thought, str):
                raise bad(f"messages[{i}].reasoning_content must be a string", "messages")
            extra["reasoning_content"] = thought  # the template writes it back, or drops it
        out.append({"role": role, "content": _content(m, i, images), **extra})
    return out


def _prompt(body: dict):
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        if not p:
            raise bad("'prompt' is empty", "prompt")
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return list(p)
    if isinstance(p, list) and p and all(isinstance(t, (str, list)) for t in p):
        raise bad("only one prompt per request is supported", "prompt")
    raise bad("'prompt' must be a non-empty string or list of token ids", "prompt")


def parse_request(
    raw: bytes,
    kind: str,
    defaults: GenerationConfig | None = None,
    max_block_size: int | None = None,
    images=None,
) -> CompletionRequest:
    """Validate a request body for /v1/chat/completions (kind "chat") or /v1/completions.

    Args:
        raw: the body bytes. defaults: the server's decoding settings (``DEFAULTS``).
        max_block_size: the drafter's block size (upper bound for ``block_size``).
        images: a ``server.images.Gather`` taking the messages' image parts (None: none).

    Raises:
        APIError: 400 with a one-line message naming the field.
    """
    try:
        body = json.loads(raw.decode("utf-8") if raw else "")
    except RecursionError:  # json's reader recurses once per level of nesting
        raise bad(
            "the request body is nested too deeply; send a flat JSON object",
            code="invalid_json",
        ) from None
    except ValueError as e:  # not UTF-8, not JSON, or an integer of over 4300 digits
        raise bad(f"the request body is not valid JSON ({e})", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", code="invalid_json")
    try:
        check_body(body)
    except InputError as e:
        raise bad(str(e), e.field, "invalid_json") from None
    return parse_body(body, kind, defaults, max_block_size, images=images)


def parse_body(
    body: dict,
    kind: str,
    defaults: GenerationConfig | None = None,
    max_block_size: int | None = None,
    names: Names = OPENAI,
    images=None,
) -> CompletionRequest:
    """``parse_request`` of a body already read (and checked by ``limits.check_body``).

    Args:
        names: how errors write fields (Anthropic's requests come here translated).
        images: as for ``parse_request``; its pictures become ``images`` of the request.

    Raises:
        APIError: 400 with a one-line message naming the field.
    """
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    prompt = _messages(body, images) if kind == "chat" else _prompt(body)
    _n(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise bad("'stream' must be a boolean", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    gen = _settings(body, defaults or DEFAULTS, max_block_size)
    include_usage = opts.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise bad("'stream_options.include_usage' must be a boolean", "stream_options")
    req = CompletionRequest(kind, model, prompt, bool(stream), bool(include_usage), gen, body)
    req.names = names
    req.images = list(images.pictures) if images is not None else []
    return req
