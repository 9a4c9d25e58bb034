"""The HTTP exchange of the OpenAI-compatible server: routes, authentication, and answers
as one JSON object or as server-sent events.

``POST /v1/chat/completions``, ``/v1/completions``, ``GET /v1/models[/{id}]``, ``/health``;
Anthropic's ``/v1/messages`` (``anthropic.py``) and ``/v1/responses`` (``responses.py``).
Each connection has its own thread; generation runs in the worker (``worker.Engine``), and a
client that disconnects cancels its generation at the next cycle. The plumbing (bodies,
errors, the key, disconnects) is ``connection.Connection``."""

from __future__ import annotations

import json
import logging
import queue
import time
from dataclasses import replace

from ..decoding.prompt import room, with_default_stops
from . import anthropic, reasoning, responses, structured
from .access import ALLOWED_METHODS, MAX_AGE, check_json
from .connection import Connection
from .schema import (
    APIError,
    bad,
    chunk,
    completion,
    delta_chunks,
    dflash_stats,
    ended,
    new_id,
    now,
    parse_request,
    shutting_down,
    usage,
    usage_chunk,
)
from .worker import Job

logger = logging.getLogger("dflash_mlx.server")


class Handler(Connection):
    """One HTTP exchange; the shared state lives on ``self.server``."""

    def _guard(self, fn) -> None:
        """Run a route; every error becomes the route's API's error answer (Anthropic's shape
        on its routes), and a body the answer did not read is dropped after it. A request
        from a web page the server does not allow is refused first (``access``)."""
        with self.server.inflight:
            self._guarded(fn)

    def _guarded(self, fn) -> None:
        try:
            self.server.access.check(self.headers)
            self._cors = self.server.access.cors(self.headers.get("Origin"))
            if self.command == "POST":
                check_json(self.headers.get("Content-Type"))
            fn()
            return
        except (BrokenPipeError, ConnectionResetError):
            return
        except APIError as e:
            err = e
        except RecursionError:  # a value nested past what the checks bound: the input's fault
            logger.warning("request nested too deeply", exc_info=True)
            err = bad("the request is nested too deeply; flatten it", code="invalid_json")
        except Exception as e:
            logger.exception("request failed")
            err = APIError(500, f"internal error: {type(e).__name__}: {e}")
        if self._path() in anthropic.ROUTES:
            err = anthropic.AnthropicError.of(err)
        self._safe_error(err)
        self.discard_body()

    # ------------------------------------------------------------------ routes
    def do_GET(self):
        self._guard(self._get)

    def do_POST(self):
        self._guard(self._post)

    def do_OPTIONS(self):
        """A browser's preflight from a page ``--allow-origin`` names: 204 with the CORS
        headers; otherwise (and from anyone else) 405."""
        cors = self.server.access.cors(self.headers.get("Origin"))
        if cors is None or not self.headers.get("Access-Control-Request-Method"):
            return self._not_allowed()
        self._cors = cors
        self.send_response(204)
        self.send_header("Access-Control-Allow-Methods", ALLOWED_METHODS)
        asked = self.headers.get("Access-Control-Request-Headers", "")
        if asked and asked.isascii() and asked.isprintable():
            self.send_header("Access-Control-Allow-Headers", asked)
        self.send_header("Access-Control-Max-Age", MAX_AGE)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _not_allowed(self):
        self._safe_error(
            APIError(
                405,
                f"method {self.command} is not allowed on {self._path()}; use GET or POST",
                code="method_not_allowed",
            )
        )
        self._drain()

    do_PUT = do_DELETE = do_PATCH = _not_allowed
    do_HEAD = do_GET  # the same answer without its body (see _send_json)

    def _path(self) -> str:
        return self.path.split("?", 1)[0].rstrip("/") or "/"

    def _get(self):
        path = self._path()
        if path == "/health":
            eng = self.server.engine
            return self._send_json(
                200,
                {
                    "status": "ok",
                    "model": self.server.model_name,
                    "running": eng.running,
                    "batch": eng.occupancy,
                    "max_batch": eng.max_batch,
                    "queued": eng.jobs.qsize(),
                    "served": eng.served,
                    "cancelled": eng.cancelled,
                    "prompt_cache": eng.pool.stats(),
                },
            )
        if not path.startswith("/v1/"):
            raise APIError(404, f"no route {path}; see /v1/models", code="not_found")
        if not self._authorized():
            raise self._unauthorized()
        card = {
            "id": self.server.model_name,
            "object": "model",
            "created": self.server.created,
            "owned_by": "dflash-mlx",
        }
        if path == "/v1/cache":  # the prompt caches: entries, bytes, hit rate
            return self._send_json(
                200, {"object": "prompt_cache", **self.server.engine.pool.stats()}
            )
        if path == "/v1/models":
            return self._send_json(200, {"object": "list", "data": [card]})
        if path.startswith(responses.RESPONSES + "/"):
            return responses.get(self, path)
        if path.startswith("/v1/models/"):
            name = path[len("/v1/models/") :]
            if self.server.knows(name):
                return self._send_json(200, card)
            raise self._unknown_model(name)
        raise APIError(404, f"no route {path}", code="not_found")

    def _unauthorized(self) -> APIError:
        return APIError(
            401,
            "invalid or missing API key; send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
        )

    def _unknown_model(self, name) -> APIError:
        return APIError(
            404,
            f"model '{name}' is not served here; this server serves '{self.server.model_name}'",
            "model",
            "model_not_found",
        )

    def _post(self):
        path = self._path()
        if path in anthropic.ROUTES:
            return anthropic.handle(self, path)
        if path in responses.ROUTES:
            return responses.handle(self, path)
        kind = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}.get(path)
        if kind is None:
            raise APIError(404, f"no route {path}", code="not_found")
        if not self._authorized():
            raise self._unauthorized()
        srv = self.server
        images = srv.gather("messages")
        req = parse_request(self.body(), kind, srv.defaults, srv.engine.model.block_size, images)
        job = self.submit(req)
        try:
            self._answer(req, job)
        finally:
            job.cancel.set()  # no-op when finished; stops the generation otherwise

    def submit(self, req) -> Job:
        """Check a parsed request against the model, tokenize it and queue its job.

        Raises:
            APIError: 400 for what the model cannot take, 503 when the queue is full.
        """
        srv = self.server
        if req.model is not None and not srv.knows(req.model):
            raise self._unknown_model(req.model)
        tok = srv.engine.tokenizer
        if req.kind == "chat":
            structured.prepare(req, req.body, tok)
        else:
            structured.prepare_completion(req, req.body)
        if req.images and not srv.engine.has_room():  # images are decoded for queued jobs only
            self._refuse_full()
        ids = srv.tokenize(req)
        vocab = srv.engine.model.adapter.vocab_size
        if any(not 0 <= t < vocab for t in req.gen.logit_bias or {}):
            raise bad(f"'logit_bias' token ids must be in [0, {vocab})", "logit_bias")
        # the prompt fits (srv.tokenize checked it); the answer gets the room that is left
        req.gen = replace(req.gen, max_tokens=room(len(ids), req.gen.max_tokens, srv.context))
        if req.kind == "chat":
            req.gen = replace(req.gen, stop=with_default_stops(req.gen.stop, tok))
            req.marks = reasoning.markers(tok)  # a thinking model's answer opens as reasoning
            req.started_open = reasoning.starts_open(tok, ids, req.marks)
        job = Job(ids, req.gen, structured.processors(req, tok, vocab))
        job.vision = req.vision  # with images: the prompt prepared once (ids and images)
        if not srv.engine.submit(job):
            self._refuse_full()
        return job

    def _refuse_full(self):
        """503: the server is stopping, or its queue is full."""
        engine = self.server.engine
        if engine.closing or engine.stopping.is_set():
            raise shutting_down()
        raise APIError(
            503, "the server is busy (request queue full); retry later", code="server_busy"
        )

    # ------------------------------------------------------------------ answering
    def _next(self, job: Job):
        """Next item from the worker; None when the client went away meanwhile."""
        while True:
            now_ = time.monotonic()
            if now_ - self._checked > 0.1:
                self._checked = now_
                if self._client_gone():
                    job.cancel.set()
                    return None
            try:
                return job.out.get(timeout=0.1)
            except queue.Empty:
                pass

    def _answer(self, req, job: Job) -> None:
        """Relay the job's results to the client: one JSON object, or server-sent events
        when ``req.stream``. Returns early (the job cancelled) when the client goes away."""
        # (kind, id, model, created): the header every chunk and the whole answer share
        head = (req.kind, new_id(req.kind), self.server.model_name, now())
        # reasoning, content and tool-call deltas (chat)
        calls = structured.DeltaStream(req.tools, req.marks, req.started_open)
        thought = reasoning.ReasoningTokens(
            self.server.engine.tokenizer, req.marks, req.started_open
        )
        texts, accepted, last, started = [], 0, None, False
        while True:
            item = self._next(job)
            if item is None:
                return
            tag, val = item
            if tag == "end":
                tag, val = "error", ended(last)  # unfinished: the server stopped it
                if val is None:
                    break
            if tag == "error":
                if not started:  # nothing sent yet: the error is the answer
                    raise val
                self._send_event(val.body())  # the stream's error chunk, never a bare end
                self.wfile.write(b"data: [DONE]\n\n")
                return
            last = val
            accepted += val.accepted
            thought.feed(val.tokens)
            if not req.stream:
                texts.append(val.text)
                continue
            if not started:
                started = True
                self._start_stream(req, head)
            if not self._stream(req, head, calls, val):
                job.cancel.set()
                return
        self._finish(req, head, "".join(texts), last, accepted, thought.count)

    def _send_event(self, obj: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()

    def _start_stream(self, req, head: tuple) -> None:
        """Begin the events; a chat stream opens with the assistant's role."""
        self.start_events()
        if req.kind == "chat":
            self._send_event(chunk(*head, "", role=True, include_usage=req.include_usage))

    def _stream(self, req, head: tuple, calls: structured.DeltaStream, r) -> bool:
        """Send the chunks of one result ``r``; False when the client went away."""
        deltas = calls.deltas(r.text, bool(r.finish_reason))  # without tools: the text
        finish = calls.finish(r.finish_reason)  # "stop" after tool calls: "tool_calls"
        try:
            for piece in delta_chunks(*head, deltas, finish, req.include_usage):
                self._send_event(piece)
        except OSError:
            return False
        return True

    def _finish(self, req, head: tuple, text: str, last, accepted: int, thought=None) -> None:
        """End the answer: the whole ``text`` as JSON, or the stream's usage chunk and [DONE].
        ``last``: the last GenerationResponse (a finished one);
        ``accepted``: draft tokens accepted over the whole generation; ``thought``: its
        reasoning tokens (None: not a thinking model)."""
        block = req.gen.block_size or self.server.engine.model.block_size
        use = usage(last.prompt_tokens, last.generation_tokens, last.prompt_processed)
        if thought is not None:
            use["completion_tokens_details"] = {"reasoning_tokens": thought}
        stats = dflash_stats(last, accepted, block)
        if not req.stream:
            out = completion(*head, text, last.finish_reason, use, stats)
            if req.kind == "chat":
                choice = out["choices"][0]
                choice["message"], choice["finish_reason"] = structured.message(
                    text, req.tools, last.finish_reason, req.marks, req.started_open
                )
            return self._send_json(200, out)
        if req.include_usage:
            self._send_event(usage_chunk(*head, use, stats))
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
