"""The answer of a Responses API request (``responses.py``): output items (``message`` with
``output_text``, ``function_call``) built from the generated text, the response object, and
for ``stream: true`` the server-sent events the official SDK consumes, each with its
``sequence_number``: ``response.created``, ``response.in_progress``, then per item
``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta`` ... ``.done``, ``response.content_part.done`` (a message) or
``response.function_call_arguments.delta`` / ``.done`` (a call), ``response.output_item.done``,
and last ``response.completed`` (``response.incomplete`` when ``max_output_tokens`` ran out).

A whole answer goes through the same items with the events unsent, so both agree.
"""

from __future__ import annotations

import json
import time
import uuid

from . import reasoning
from .schema import APIError, dflash_stats, ended
from .tools import HERMES, CallStream


def new_id(prefix: str = "resp") -> str:
    """A fresh id: ``resp_``, ``msg_``, ``fc_`` or ``rs_`` and 24 hex digits.

    Args:
        prefix: the kind of object.
    """
    return f"{prefix}_" + uuid.uuid4().hex[:24]


def usage(last, reasoning_tokens: int = 0) -> dict:
    """The Responses ``usage`` of a generation.

    Args:
        last: the last GenerationResponse. reasoning_tokens: those of the answer's thinking
            section, markers included.
    """
    return {
        "input_tokens": last.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": max(0, last.prompt_tokens - last.prompt_processed)
        },
        "output_tokens": last.generation_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": last.prompt_tokens + last.generation_tokens,
    }


class Answer:
    """One Responses answer, whole or as events.

    Args:
        h: the ``http.Handler``. req: the translated chat request. job: its queued job.
        body: the Responses request (fields echoed in the response). rid: the response id.
        hold: called with the finished response before it is sent (the store), or None.
    """

    def __init__(self, h, req, job, body: dict, rid: str, hold=None):
        self.h, self.req, self.job, self.body, self.id = h, req, job, body, rid
        self.hold = hold
        self.created, self.seq, self.sending = int(time.time()), 0, False
        self.output: list[dict] = []  # the items so far; an open one is last
        self.open: dict | None = None  # the message whose text is streaming
        spec = req.tools
        self.tools = spec is not None and spec.active
        self.split = CallStream(spec.fmt if spec is not None else HERMES)
        self.accepted, self.tokens = 0, []
        tok = h.server.engine.tokenizer
        self.marks = reasoning.markers(tok)  # a thinking model's answer: reasoning first
        self.started_open = reasoning.starts_open(tok, job.ids, self.marks)
        self.think = reasoning.Splitter(self.marks, self.started_open)
        self.thought: dict | None = None  # the reasoning item whose text is streaming

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict | None:
        """Relay the job; the final response object, or None when the client went away or
        the generation failed after the events began."""
        last = None
        texts: list[str] = []
        while True:
            item = self.h._next(self.job)
            if item is None:
                return None
            tag, val = item
            if tag == "end":
                tag, val = "error", ended(last)  # unfinished: the server stopped it
                if val is None:
                    break
            if tag == "error":
                if not self.sending:  # nothing sent yet: the error is the answer
                    raise val
                self._fail(val)
                return None
            last = val
            self.accepted += val.accepted
            self.tokens += val.tokens
            texts.append(val.text)
            if self.req.stream:
                if not self.sending:
                    self._begin(last)
                self._feed(val.text)
        self._feed("" if self.req.stream else "".join(texts), True)
        self._close_reasoning()
        self._close_message()
        if not self.output:  # nothing at all was said: one empty message
            self._open_message()
            self._close_message()
        final = self.response(last)
        if self.hold is not None:  # held before sent: a continuation at once finds it
            self.hold(final)
        if self.req.stream:
            self.send({"type": f"response.{final['status']}", "response": final})
        else:
            self.h._send_json(200, final)
        return final

    def _begin(self, last) -> None:
        self.sending = True
        self.h.start_events()
        for kind in ("created", "in_progress"):
            self.send({"type": f"response.{kind}", "response": self.response(last, False)})

    def send(self, event: dict) -> None:
        """One server-sent event, numbered, when streaming (nothing otherwise).

        Args:
            event: the event object; its ``type`` names the event.
        """
        if not self.sending:
            return
        event["sequence_number"] = self.seq
        self.seq += 1
        data = json.dumps(event)
        self.h.wfile.write(f"event: {event['type']}\ndata: {data}\n\n".encode())
        self.h.wfile.flush()

    def _fail(self, err: APIError) -> None:
        """A generation that failed mid-stream: the error event, then ``response.failed``."""
        body = err.body()["error"]
        self.send(
            {
                "type": "error",
                "code": body["code"],
                "message": body["message"],
                "param": body["param"],
            }
        )
        failed = self.response(None, False)
        failed.update(status="failed", error={"code": "server_error", "message": err.message})
        self.send({"type": "response.failed", "response": failed})

    # ------------------------------------------------------------------ items
    def _feed(self, text: str, final: bool = False) -> None:
        """The items and events of a piece of the answer (``final``: the end of it)."""
        pieces = self.think.feed(text) + (self.think.close() if final else [])
        for kind, val in pieces:
            if kind == "reasoning":
                self._reasoning(val)
            else:
                self._content(val, False)
        if final:
            self._content("", True)

    def _content(self, text: str, final: bool) -> None:
        """What follows the reasoning: text and tool calls."""
        if self.tools:
            events = self.split.feed(text) + (self.split.close() if final else [])
        else:
            events = [("text", text)] if text else []
        for kind, val in events:
            if kind == "text":
                self._text(val)
            else:
                self._call(val)

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.output.index(item)}

    def _add(self, item: dict) -> dict:
        """Append an output item (``response.output_item.added``)."""
        self.output.append(item)
        self.send(
            {
                "type": "response.output_item.added",
                "output_index": len(self.output) - 1,
                "item": json.loads(json.dumps(item)),
            }
        )
        return item

    def _done(self, item: dict) -> None:
        item["status"] = "completed"
        self.send(
            {
                "type": "response.output_item.done",
                "output_index": self.output.index(item),
                "item": json.loads(json.dumps(item)),
            }
        )

    def _open(self, kind: str, item: dict) -> dict:
        """A message or reasoning item with one part of ``kind`` (output_text or
        reasoning_text) whose text streams."""
        self._add(item)
        part = {"type": kind, "text": ""} | ({"annotations": []} if kind == "output_text" else {})
        item["content"].append(part)
        self.send(
            {
                "type": "response.content_part.added",
                **self._where(item),
                "content_index": 0,
                "part": dict(part),
            }
        )
        return item

    def _delta(self, item: dict, text: str) -> None:
        part = item["content"][0]
        part["text"] += text
        event = {
            "type": f"response.{part['type']}.delta",
            **self._where(item),
            "content_index": 0,
            "delta": text,
        }
        self.send(event | ({"logprobs": []} if part["type"] == "output_text" else {}))

    def _close(self, item: dict | None) -> None:
        if item is None:
            return
        part, where = item["content"][0], self._where(item)
        event = {
            "type": f"response.{part['type']}.done",
            **where,
            "content_index": 0,
            "text": part["text"],
        }
        self.send(event | ({"logprobs": []} if part["type"] == "output_text" else {}))
        self.send(
            {"type": "response.content_part.done", **where, "content_index": 0, "part": dict(part)}
        )
        self._done(item)

    def _reasoning(self, text: str) -> None:
        if self.thought is None:
            item = {
                "id": new_id("rs"),
                "type": "reasoning",
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
            self.thought = self._open("reasoning_text", item)
        self._delta(self.thought, text)

    def _close_reasoning(self) -> None:
        self._close(self.thought)
        self.thought = None

    def _text(self, text: str) -> None:
        self._close_reasoning()
        if self.open is None:
            self._open_message()
        self._delta(self.open, text)

    def _open_message(self) -> None:
        item = {
            "id": new_id("msg"),
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        self.open = self._open("output_text", item)

    def _close_message(self) -> None:
        self._close(self.open)
        self.open = None

    def _call(self, call) -> None:
        """A whole tool call (``tools.ToolCall``) as a ``function_call`` item."""
        self._close_reasoning()
        self._close_message()
        item = self._add(
            {
                "id": new_id("fc"),
                "type": "function_call",
                "status": "in_progress",
                "call_id": call.id,
                "name": call.name,
                "arguments": "",
            }
        )
        item["arguments"] = call.arguments
        where = self._where(item)
        self.send(
            {"type": "response.function_call_arguments.delta", **where, "delta": call.arguments}
        )
        self.send(
            {
                "type": "response.function_call_arguments.done",
                **where,
                "name": call.name,
                "arguments": call.arguments,
            }
        )
        self._done(item)

    def _reasoning_tokens(self) -> int:
        """Tokens of the thinking section, counted as chat and Anthropic count them."""
        tok = self.h.server.engine.tokenizer
        count = reasoning.ReasoningTokens(tok, self.marks, self.started_open)
        count.feed(self.tokens)
        return count.count or 0

    # ------------------------------------------------------------------ the object
    def response(self, last, finished: bool = True) -> dict:
        """The response object.

        Args:
            last: the last GenerationResponse. finished: False for the object of
                ``response.created`` / ``in_progress`` (no output, no usage yet).
        """
        b, gen, spec = self.body, self.req.gen, self.req.tools
        status = "in_progress"
        if finished:
            status = "incomplete" if last.finish_reason == "length" else "completed"
        out = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": b.get("instructions"),
            "max_output_tokens": b.get("max_output_tokens"),
            "model": self.h.server.model_name,
            "output": self.output if finished else [],
            "parallel_tool_calls": spec.parallel if spec is not None else True,
            "previous_response_id": b.get("previous_response_id"),
            "reasoning": b.get("reasoning") or {"effort": None, "summary": None},
            "store": b.get("store") is not False,  # null: the default
            "temperature": gen.temperature,
            "top_p": gen.top_p,
            "text": b.get("text") or {"format": {"type": "text"}},
            "tool_choice": b.get("tool_choice") or "auto",
            "tools": b.get("tools") or [],
            "truncation": "disabled",
            "usage": None,
            "metadata": b.get("metadata") or {},
        }
        if finished:
            out["completed_at"] = int(time.time())
            block = gen.block_size or self.h.server.engine.model.block_size
            out.update(
                usage=usage(last, self._reasoning_tokens()),
                dflash=dflash_stats(last, self.accepted, block),
            )
        return out
