"""OpenAI response shapes of ``dflash_mlx.server``: ``chat.completion`` / ``text_completion``
objects, their streamed chunks, usage and the ``dflash`` statistics. No MLX."""

from __future__ import annotations

import time
import uuid
from typing import Any

from .. import __version__

SYSTEM_FINGERPRINT = f"dflash-mlx-{__version__}"


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int, prompt_processed: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": max(0, prompt_tokens - prompt_processed)},
    }


def dflash_stats(last, accepted: int, block_size) -> dict:
    """Speculative-decoding stats from the last GenerationResponse (an extra field):
    ``blocks`` counts the steps of each block size ("1" = a plain step), ``copied_cycles``
    the verify cycles whose drafts were copied from the context, ``sibling_cycles`` those
    that committed a sibling of the first draft (a greedy tree); ``notes``, only when there
    are any, what the request ran without and why (``vision/notes.py``); ``schedule``, only
    when there is any, what ``auto`` chose when it switched between plain and speculative
    cycles (in a batch: the verify width and each row's kind, ``decoding/batch_auto.py``)."""
    out = {
        "tau": round(last.tau, 4),
        "accepted_tokens": accepted,
        "cycles": last.cycles,
        "block_size": block_size,
        "blocks": {str(b): n for b, n in last.blocks.items()},
        "plain_share": round(last.plain_share, 4),
        "copied_cycles": last.copied,
        "sibling_cycles": last.siblings,
        "prompt_tokens_processed": last.prompt_processed,
        "prompt_tps": round(last.prompt_tps, 2),
        "generation_tps": round(last.generation_tps, 2),
        "peak_memory_gb": round(last.peak_memory, 3),
    }
    if getattr(last, "notes", None):
        out["notes"] = list(last.notes)
    if getattr(last, "schedule", None):
        out["schedule"] = list(last.schedule)
    return out


def _base(kind: str, rid: str, model: str, created: int, chunk: bool) -> dict:
    obj = "chat.completion" if kind == "chat" else "text_completion"
    return {
        "id": rid,
        "object": obj + (".chunk" if chunk and kind == "chat" else ""),
        "created": created,
        "model": model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }


def completion(
    kind: str,
    rid: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str | None,
    usage_: dict,
    stats: dict,
) -> dict:
    """A whole (non-streamed) response."""
    out = _base(kind, rid, model, created, False)
    if kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    out.update(choices=[choice], usage=usage_, dflash=stats)
    return out


def chunk(
    kind: str,
    rid: str,
    model: str,
    created: int,
    text: str | None,
    finish_reason: str | None = None,
    role: bool = False,
    include_usage: bool = False,
) -> dict:
    """One streamed chunk carrying text (or the role, or the finish reason)."""
    out = _base(kind, rid, model, created, True)
    if kind == "chat":
        delta: dict[str, Any] = {}
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


def delta_chunks(
    kind: str,
    rid: str,
    model: str,
    created: int,
    deltas: list[dict],
    finish_reason: str | None,
    include_usage: bool = False,
) -> list[dict]:
    """The chunks of one streamed piece: one per delta (chat: the delta as it is, content or
    tool calls; completion: its content as text), then the finish chunk if it ends here."""
    chat = kind == "chat"
    out = []
    for delta in deltas:
        text = None if chat else delta["content"]
        piece = chunk(kind, rid, model, created, text, include_usage=include_usage)
        if chat:
            piece["choices"][0]["delta"] = delta
        out.append(piece)
    if finish_reason:
        end = None if chat else ""
        out.append(
            chunk(kind, rid, model, created, end, finish_reason, include_usage=include_usage)
        )
    return out


def usage_chunk(kind: str, rid: str, model: str, created: int, usage_: dict, stats: dict) -> dict:
    """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
    out = _base(kind, rid, model, created, True)
    out.update(choices=[], usage=usage_, dflash=stats)
    return out


def now() -> int:
    return int(time.time())
