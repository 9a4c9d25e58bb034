"""The HTTP exchange of the OpenAI-compatible server: routes, authentication, and answers
as one JSON object or as server-sent events.

``POST /v1/chat/completions``, ``/v1/completions``, ``GET /v1/models[/{id}]``, ``/health``.
Each connection has its own thread; generation runs in the worker (``worker.Engine``), and a
client that disconnects cancels its generation at the next cycle."""

from __future__ import annotations

import hmac
import json
import logging
import queue
import select
import socket
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler

from ..decoding.prompt import room, with_default_stops
from . import anthropic, structured
from .schema import (
    APIError,
    bad,
    chunk,
    completion,
    delta_chunks,
    dflash_stats,
    new_id,
    now,
    parse_request,
    usage,
    usage_chunk,
)
from .worker import Job

logger = logging.getLogger("dflash_mlx.server")

MAX_BODY = 32 * 1024 * 1024
RETRY_AFTER = "1"  # seconds; a 503 means the queue is full or the server is stopping

# The stdlib's own errors ({} is its short message): what went wrong and how to fix it.
HTTP_ERRORS = {
    400: "malformed HTTP request ({}); send 'METHOD /path HTTP/1.1' and valid headers",
    405: "method not allowed ({}); use GET or POST",
    414: "the URL is too long ({}); send data in the request body",
    431: "the request headers are too large ({}); send fewer, shorter headers",
    501: "method not supported ({}); use GET or POST",
    505: "HTTP version not supported ({}); use HTTP/1.1",
}
HTTP_CODES = {
    400: "invalid_request",
    405: "method_not_allowed",
    414: "uri_too_long",
    431: "headers_too_large",
    501: "method_not_allowed",
    505: "http_version_not_supported",
}


class Handler(BaseHTTPRequestHandler):
    """One HTTP exchange; the shared state lives on ``self.server``."""

    server_version = "dflash-mlx"
    protocol_version = "HTTP/1.0"
    timeout = 600  # seconds a stalled client may block its own handler thread
    body_timeout = 10.0  # seconds between two pieces of a request body before a 408
    _checked = 0.0  # when the connection was last checked for a disconnect

    # ------------------------------------------------------------------ plumbing
    def log_message(self, fmt, *args):
        logger.info("%s %s", self.address_string(), fmt % args)

    def _send_json(self, status: int, obj: dict, headers=()) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        self.wfile.flush()

    def _error(self, err: APIError) -> None:
        headers = [("Retry-After", RETRY_AFTER)] if err.status == 503 else []
        if err.status == 405:
            headers.append(("Allow", "GET, POST"))
        self._send_json(err.status, err.body(), headers)

    def send_error(self, code, message=None, explain=None):
        """The HTTP layer's own errors (a malformed request line, a URL or headers too
        large, an unknown method) in OpenAI's JSON shape instead of the stdlib's HTML page."""
        code = int(code)
        self.log_error("code %d, message %s", code, message)
        self.close_connection = True
        if self.request_version in ("", "HTTP/0.9"):  # the line was unreadable: answer 1.0
            self.request_version = "HTTP/1.0"
        text = HTTP_ERRORS.get(code, "{}").format(message or self.responses.get(code, ("",))[0])
        try:
            self._error(APIError(code, text, code=HTTP_CODES.get(code)))
            self._drain()
        except OSError:
            pass

    def _drain(self) -> None:
        """Read what the client still sends (briefly): closing a socket with unread input
        resets the connection, and the client may lose the answer."""
        try:
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(0.5)
            for _ in range(64):
                if not self.connection.recv(65536):
                    break
        except OSError:
            pass

    def _read_body(self, length: int) -> bytes:
        """The request body, or a 408 when the client stops sending before Content-Length
        bytes came (else a short body holds the connection for ``timeout`` seconds)."""
        if length <= 0:
            return b""
        self.connection.settimeout(self.body_timeout)
        try:
            data = self.rfile.read(length)
        except TimeoutError:
            self.close_connection = True
            msg = f"the request body stopped before its Content-Length ({length} bytes) for "
            msg += f"{self.body_timeout:g} s; send the whole body or fix the header"
            raise APIError(408, msg, code="request_timeout") from None
        finally:
            self.connection.settimeout(self.timeout)
        if len(data) < length:
            raise bad(f"the body has {len(data)} bytes but Content-Length says {length}")
        return data

    def _client_gone(self) -> bool:
        try:
            r, _, _ = select.select([self.connection], [], [], 0)
            return bool(r) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _authorized(self) -> bool:
        """The key as 'Authorization: Bearer <key>' or (Anthropic's clients) 'x-api-key'."""
        key = self.server.api_key
        if not key:
            return True
        got = self.headers.get("Authorization", "")
        token = got[7:].strip() if got[:7].lower() == "bearer " else ""
        token = token or self.headers.get("x-api-key", "").strip()
        # http.server decodes header bytes as latin-1: re-encode them to compare raw bytes
        got_bytes = token.encode("latin-1", "replace")
        return hmac.compare_digest(got_bytes, key.encode("utf-8", "surrogateescape"))

    def _guard(self, fn) -> None:
        try:
            fn()
        except APIError as e:
            self._safe_error(e)
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as e:
            logger.exception("request failed")
            self._safe_error(APIError(500, f"internal error: {type(e).__name__}: {e}"))

    def _safe_error(self, err: APIError) -> None:
        try:
            self._error(err)
        except OSError:
            pass

    # ------------------------------------------------------------------ routes
    def do_GET(self):
        self._guard(self._get)

    def do_POST(self):
        self._guard(self._post)

    def _not_allowed(self):
        self._safe_error(
            APIError(
                405,
                f"method {self.command} is not allowed on {self._path()}; use GET or POST",
                code="method_not_allowed",
            )
        )
        self._drain()

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed
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
        if path == "/v1/models":
            return self._send_json(200, {"object": "list", "data": [card]})
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
        kind = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}.get(path)
        if kind is None:
            raise APIError(404, f"no route {path}", code="not_found")
        if not self._authorized():
            raise self._unauthorized()
        srv = self.server
        req = parse_request(self.body(), kind, srv.defaults, srv.engine.model.block_size)
        job = self.submit(req)
        try:
            self._answer(req, job)
        finally:
            job.cancel.set()  # no-op when finished; stops the generation otherwise

    def body(self) -> bytes:
        """The request body (a Content-Length is required)."""
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise bad("a Content-Length header is required") from None
        if length > MAX_BODY:
            raise APIError(413, f"request body over {MAX_BODY} bytes")
        return self._read_body(length)

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
        ids = srv.tokenize(req)
        vocab = srv.engine.model.adapter.vocab_size
        if any(not 0 <= t < vocab for t in req.gen.logit_bias or {}):
            raise bad(f"'logit_bias' token ids must be in [0, {vocab})", "logit_bias")
        # the prompt fits (srv.tokenize checked it); the answer gets the room that is left
        req.gen = replace(req.gen, max_tokens=room(len(ids), req.gen.max_tokens, srv.context))
        if req.kind == "chat":
            req.gen = replace(req.gen, stop=with_default_stops(req.gen.stop, tok))
        job = Job(ids, req.gen, structured.processors(req, tok, vocab))
        if not srv.engine.submit(job):
            raise APIError(
                503, "the server is busy (request queue full); retry later", code="server_busy"
            )
        return job

    # ------------------------------------------------------------------ answering
    def start_events(self) -> None:
        """Begin a 200 answer of server-sent events."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()

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
        calls = structured.DeltaStream(req.tools)  # content and tool-call deltas (chat)
        texts, accepted, last, started = [], 0, None, False
        while True:
            item = self._next(job)
            if item is None:
                return
            tag, val = item
            if tag == "end":
                break
            if tag == "error":
                if not started:  # nothing sent yet: the error is the answer
                    raise val
                self._send_event(val.body())
                self.wfile.write(b"data: [DONE]\n\n")
                return
            last = val
            accepted += val.accepted
            if not req.stream:
                texts.append(val.text)
                continue
            if not started:
                started = True
                self._start_stream(req, head)
            if not self._stream(req, head, calls, val):
                job.cancel.set()
                return
        self._finish(req, head, "".join(texts), last, accepted)

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

    def _finish(self, req, head: tuple, text: str, last, accepted: int) -> None:
        """End the answer: the whole ``text`` as JSON, or the stream's usage chunk and [DONE].
        ``last``: the last GenerationResponse (None: the generation produced nothing);
        ``accepted``: draft tokens accepted over the whole generation."""
        if last is None:
            raise APIError(500, "the generation produced nothing")
        block = req.gen.block_size or self.server.engine.model.block_size
        use = usage(last.prompt_tokens, last.generation_tokens, last.prompt_processed)
        stats = dflash_stats(last, accepted, block)
        if not req.stream:
            out = completion(*head, text, last.finish_reason, use, stats)
            if req.kind == "chat":
                choice = out["choices"][0]
                choice["message"], choice["finish_reason"] = structured.message(
                    text, req.tools, last.finish_reason
                )
            return self._send_json(200, out)
        if req.include_usage:
            self._send_event(usage_chunk(*head, use, stats))
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
