"""The Responses API's memory of finished responses (``responses.py``): each one's object,
for ``GET /v1/responses/{id}``, and its conversation items, for ``previous_response_id``;
the last ``MAX_HELD`` responses, at most ``MAX_HELD_BYTES`` of JSON, the oldest dropped
first. No MLX."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

MAX_HELD = 256  # responses held for previous_response_id and GET
MAX_HELD_BYTES = 64 << 20  # ... and at most this much of their JSON


class Store:
    """Finished responses by id, oldest dropped first past ``MAX_HELD`` or ``MAX_HELD_BYTES``.

    Each holds the response object (for GET) and its conversation: the input items of its
    chain and its output items, without instructions (they do not carry over)."""

    def __init__(self, max_held: int = MAX_HELD, max_bytes: int = MAX_HELD_BYTES):
        self.max_held, self.max_bytes, self.bytes = max_held, max_bytes, 0
        self.held: OrderedDict[str, tuple[dict, list, int]] = OrderedDict()
        self.lock = threading.Lock()

    def put(self, response: dict, items: list) -> None:
        """Hold a response; one larger than ``max_bytes`` alone is not held.

        Args:
            response: the response object (its ``id`` is the key). items: its conversation.
        """
        size = len(json.dumps(response)) + len(json.dumps(items))
        if size > self.max_bytes:  # larger than the whole store: not held
            return
        with self.lock:
            old = self.held.pop(response["id"], None)
            self.bytes -= old[2] if old else 0
            self.held[response["id"]] = (response, items, size)
            self.bytes += size
            while self.held and (len(self.held) > self.max_held or self.bytes > self.max_bytes):
                self.bytes -= self.held.popitem(last=False)[1][2]

    def get(self, rid: str) -> tuple[dict, list] | None:
        """(response, conversation items) of a held id, or None.

        Args:
            rid: the response id.
        """
        with self.lock:
            got = self.held.get(rid)
        return None if got is None else got[:2]


_STORE_LOCK = threading.Lock()


def store_of(server) -> Store:
    """The server's store, made on first use.

    Args:
        server: the ``app.DFlashHTTPServer`` (the store lives on it).
    """
    with _STORE_LOCK:
        if getattr(server, "responses_store", None) is None:
            server.responses_store = Store()
        return server.responses_store
