"""The HTTP plumbing under both APIs: reading a request body (or dropping one an early answer
did not need), JSON answers and errors, the stdlib's own errors as JSON, the API key, and
telling a client that went away from one that only half-closed its connection.

``http.Handler`` adds the routes and the answers on top of ``Connection``."""

from __future__ import annotations

import hmac
import json
import logging
import select
import socket
import time
from http.server import BaseHTTPRequestHandler

from .schema import APIError, bad

logger = logging.getLogger("dflash_mlx.server")

MAX_BODY = 32 * 1024 * 1024  # at least; ``body_limit`` raises it to fit one image at its cap
MAX_DRAIN = 2 * MAX_BODY  # bytes of an unread body dropped after an early answer (401, 413)
DRAIN_SECONDS = 10.0  # ... and for how long at most
PROBE_EVERY = 1.0  # seconds between two writes that check a half-closed connection
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


def body_limit(limits) -> int:
    """The largest request body: ``MAX_BODY``, or more when one image at ``--max-image-bytes``
    would not fit in it base64-encoded (4/3 of its bytes) with 1 MiB of text beside it.
    Several images share the limit; the body stays bounded either way.

    Args:
        limits: the server's ``vision.images.ImageLimits``.
    """
    return max(MAX_BODY, -(-limits.max_bytes * 4 // 3) + (1 << 20))


class Connection(BaseHTTPRequestHandler):
    """One HTTP exchange's plumbing; the shared state lives on ``self.server``."""

    server_version = "dflash-mlx"
    protocol_version = "HTTP/1.0"
    timeout = 600  # seconds a stalled client may block its own handler thread
    body_timeout = 10.0  # seconds between two pieces of a request body before a 408
    _checked = 0.0  # when the connection was last checked for a disconnect
    _probed = 0.0  # when a half-closed connection was last written to
    _body_read = False  # the body was read (or dropped): nothing left to drain
    _started = False  # an answer of server-sent events began
    _cors: str | None = None  # the page origin answers name (``--allow-origin``), if any

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

    def end_headers(self) -> None:
        if self._cors:  # a page --allow-origin names may read the answer
            self.send_header("Access-Control-Allow-Origin", self._cors)
            self.send_header("Vary", "Origin")
        super().end_headers()

    def _error(self, err: APIError) -> None:
        headers = [("Retry-After", RETRY_AFTER)] if err.status == 503 else []
        if err.status == 405:
            headers.append(("Allow", "GET, POST"))
        self._send_json(err.status, err.body(), headers)

    def _safe_error(self, err: APIError) -> None:
        try:
            self._error(err)
        except OSError:
            pass

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

    def start_events(self) -> None:
        """Begin a 200 answer of server-sent events."""
        self._started = True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()

    # ------------------------------------------------------------------ the body
    def body(self) -> bytes:
        """The request body (a Content-Length is required).

        Raises:
            APIError: 400 without a Content-Length, 413 over the server's ``max_body``
            (``body_limit``), 408 when it stalls.
        """
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise bad("a Content-Length header is required") from None
        cap = getattr(self.server, "max_body", MAX_BODY)
        if length > cap:
            raise APIError(413, f"request body over {cap} bytes; send a smaller one")
        return self._read_body(length)

    def _read_body(self, length: int) -> bytes:
        """The request body, or a 408 when the client stops sending before Content-Length
        bytes came (else a short body holds the connection for ``timeout`` seconds)."""
        self._body_read = True
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

    def discard_body(self) -> None:
        """Read and drop a body that an answer sent before it did not need (401, 404, 413):
        a client still sending it (Python's ``http.client`` sends all of it before reading)
        would otherwise get a reset instead of the answer. At most ``MAX_DRAIN`` bytes for
        ``DRAIN_SECONDS``; a larger body gets the answer and a closed connection."""
        if self._body_read or self.headers is None:
            return
        self._body_read = True
        length = self.headers.get("Content-Length")
        if length is None and not self.headers.get("Transfer-Encoding"):
            return  # no body
        try:
            left = int(length or "")
        except ValueError:  # a body of unknown length (chunked?): read what comes briefly
            return self._drain()
        if left > MAX_DRAIN:
            return
        deadline = time.monotonic() + DRAIN_SECONDS
        self.connection.settimeout(self.body_timeout)
        try:
            while left > 0 and time.monotonic() < deadline:
                got = self.rfile.read1(min(left, 1 << 16))
                if not got:
                    break
                left -= len(got)
        except OSError:
            pass
        finally:
            self.connection.settimeout(self.timeout)

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

    # ------------------------------------------------------------------ the client
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

    def _client_gone(self) -> bool:
        """Whether the client went away. The end of its input does not say so alone: a
        client may half-close (shut its side down after the request) and still read the
        answer, so the connection is then written to (``_probe``); a client that closed
        answers that with a reset, seen here at the next check."""
        try:
            r, _, _ = select.select([self.connection], [], [], 0)
            if not r or self.connection.recv(1, socket.MSG_PEEK) != b"":
                return False
        except (OSError, ValueError):
            return True
        return not self._probe()

    def _probe(self) -> bool:
        """Write something harmless to a connection whose input ended (at most every
        ``PROBE_EVERY`` seconds): an interim '100 Continue' before the answer (clients of
        HTTP/1.1 skip it), an SSE comment inside a stream. False when that cannot be done:
        an HTTP/1.0 client, which takes no interim answer, counts as gone."""
        if not self._started and self.request_version < "HTTP/1.1":
            return False
        now = time.monotonic()
        if now - self._probed < PROBE_EVERY:
            return True
        self._probed = now
        line = f"{self.protocol_version} 100 Continue\r\n\r\n".encode()
        try:
            self.wfile.write(b": \n\n" if self._started else line)
            self.wfile.flush()
        except OSError:
            return False
        return True
