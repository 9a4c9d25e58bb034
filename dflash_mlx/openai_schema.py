"""OpenAI request parsing and response shapes for ``dflash_mlx.server``.

Pure functions, no MLX: a request body becomes a ``CompletionRequest`` (or an ``APIError``
carrying the HTTP status and OpenAI's error object), and generation results become
``chat.completion`` / ``text_completion`` objects and their streaming chunks.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from . import __version__

SYSTEM_FINGERPRINT = f"dflash-mlx-{__version__}"

# Decoding settings a request (or the server's defaults) may set, with built-in defaults.
GEN_DEFAULTS: Dict[str, Any] = {
    "max_tokens": 512,
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": None,
    "block_size": None,
    "use_selector": True,
    "seed": None,
}

ROLES = {"system", "developer", "user", "assistant", "tool"}


class APIError(Exception):
    """An error answered to the client as ``{"error": {...}}`` with an HTTP status."""

    TYPES = {401: "authentication_error", 404: "invalid_request_error", 413: "invalid_request_error",
             503: "server_error", 500: "server_error"}

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param, code)


@dataclass
class CompletionRequest:
    """A validated request.

    Attributes:
        kind: "chat" or "completion". model: the name asked for (None: the served one).
        prompt: messages (chat), a str or a list of token ids (completion).
        stream, include_usage: SSE options. gen: keyword arguments for ``stream_generate``.
    """

    kind: str
    model: Optional[str]
    prompt: Any
    stream: bool = False
    include_usage: bool = False
    gen: Dict[str, Any] = field(default_factory=dict)


def _number(body: dict, name: str, lo=None, hi=None, integer=False, lo_open=False):
    v = body.get(name)
    if v is None:
        return None
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok:
        raise bad(f"'{name}' must be {'an integer' if integer else 'a number'} (got {v!r})", name)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise bad(f"'{name}' must be {'>' if lo_open else '>='} {lo} (got {v})", name)
    if hi is not None and v > hi:
        raise bad(f"'{name}' must be <= {hi} (got {v})", name)
    return v


def _content(msg: dict, i: int) -> str:
    c = msg.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for p in c:
            if isinstance(p, str):
                parts.append(p)
            elif isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
                parts.append(p["text"])
            else:
                kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                raise bad(f"messages[{i}].content: only text parts are supported (got {kind!r})",
                          "messages")
        return "".join(parts)
    raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")


def _messages(body: dict) -> List[Dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad(f"messages[{i}] needs a 'role' among {sorted(ROLES)}", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": _content(m, i)})
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


def _stop(body: dict) -> Optional[List[str]]:
    s = body.get("stop")
    if s is None:
        return None
    if isinstance(s, str):
        return [s] if s else None
    if isinstance(s, list) and all(isinstance(x, str) for x in s):
        return [x for x in s if x] or None
    raise bad("'stop' must be a string or a list of strings", "stop")


def _logit_bias(body: dict) -> Optional[Dict[int, float]]:
    lb = body.get("logit_bias")
    if lb is None:
        return None
    if not isinstance(lb, dict):
        raise bad("'logit_bias' must map token ids to numbers", "logit_bias")
    out = {}
    for k, v in lb.items():
        try:
            tid = int(k)
        except (TypeError, ValueError):
            raise bad(f"'logit_bias' key {k!r} is not a token id", "logit_bias") from None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise bad(f"'logit_bias' values must be numbers in [-100, 100] (got {v!r})",
                      "logit_bias")
        out[tid] = float(v)
    return out or None


def parse_request(raw: bytes, kind: str, defaults: Optional[dict] = None,
                  max_block_size: Optional[int] = None) -> CompletionRequest:
    """Validate a request body for /v1/chat/completions (kind "chat") or /v1/completions.

    Args:
        raw: the body bytes. defaults: server decoding defaults (GEN_DEFAULTS keys).
        max_block_size: the drafter's block size (upper bound for ``block_size``).

    Raises:
        APIError: 400 with a one-line message naming the field.
    """
    try:
        body = json.loads(raw.decode("utf-8") if raw else "")
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"the request body is not valid JSON ({e})", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", code="invalid_json")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    prompt = _messages(body) if kind == "chat" else _prompt(body)
    n = _number(body, "n", lo=1, integer=True)
    if n not in (None, 1):
        raise bad("only n=1 is supported", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise bad("'stream' must be a boolean", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    include_usage = bool(opts.get("include_usage", False))

    gen = {k: v for k, v in GEN_DEFAULTS.items()}
    gen.update({k: v for k, v in (defaults or {}).items() if k in GEN_DEFAULTS and v is not None})
    got = {
        "max_tokens": _number(body, "max_completion_tokens", lo=1, integer=True),
        "temperature": _number(body, "temperature", lo=0),
        "top_p": _number(body, "top_p", lo=0, hi=1, lo_open=True),
        "top_k": _number(body, "top_k", lo=0, integer=True),
        "min_p": _number(body, "min_p", lo=0, hi=1),
        "presence_penalty": _number(body, "presence_penalty", lo=-2, hi=2),
        "frequency_penalty": _number(body, "frequency_penalty", lo=-2, hi=2),
        "repetition_penalty": _number(body, "repetition_penalty", lo=0, lo_open=True),
        "block_size": _number(body, "block_size", lo=2, hi=max_block_size, integer=True),
        "seed": _number(body, "seed", integer=True),
    }
    if got["max_tokens"] is None:
        got["max_tokens"] = _number(body, "max_tokens", lo=1, integer=True)
    sel = body.get("use_selector")
    if sel is not None:
        if not isinstance(sel, bool):
            raise bad("'use_selector' must be a boolean", "use_selector")
        got["use_selector"] = sel
    gen.update({k: v for k, v in got.items() if v is not None})
    gen["stop"] = _stop(body)
    gen["logit_bias"] = _logit_bias(body)
    return CompletionRequest(kind, model, prompt, bool(stream), include_usage, gen)


# ----------------------------------------------------------------------------- responses


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int, prompt_processed: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": max(0, prompt_tokens - prompt_processed)},
    }


def dflash_stats(last, accepted: int, block_size: int) -> dict:
    """Speculative-decoding stats from the last GenerationResponse (an extra field)."""
    return {
        "tau": round(last.tau, 4),
        "accepted_tokens": accepted,
        "cycles": last.cycles,
        "block_size": block_size,
        "prompt_tokens_processed": last.prompt_processed,
        "prompt_tps": round(last.prompt_tps, 2),
        "generation_tps": round(last.generation_tps, 2),
        "peak_memory_gb": round(last.peak_memory, 3),
    }


def _base(kind: str, rid: str, model: str, created: int, chunk: bool) -> dict:
    obj = "chat.completion" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj + (".chunk" if chunk and kind == "chat" else ""),
            "created": created, "model": model, "system_fingerprint": SYSTEM_FINGERPRINT}


def completion(kind: str, rid: str, model: str, created: int, text: str,
               finish_reason: Optional[str], usage_: dict, stats: dict) -> dict:
    """A whole (non-streamed) response."""
    out = _base(kind, rid, model, created, False)
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    out.update(choices=[choice], usage=usage_, dflash=stats)
    return out


def chunk(kind: str, rid: str, model: str, created: int, text: Optional[str],
          finish_reason: Optional[str] = None, role: bool = False,
          include_usage: bool = False) -> dict:
    """One streamed chunk carrying text (or the role, or the finish reason)."""
    out = _base(kind, rid, model, created, True)
    if kind == "chat":
        delta: Dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    out["choices"] = [choice]
    if include_usage:
        out["usage"] = None
    return out


def usage_chunk(kind: str, rid: str, model: str, created: int, usage_: dict,
                stats: dict) -> dict:
    """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
    out = _base(kind, rid, model, created, True)
    out.update(choices=[], usage=usage_, dflash=stats)
    return out


def now() -> int:
    return int(time.time())
