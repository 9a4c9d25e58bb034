"""The OpenAI-compatible HTTP server behind ``dflash serve``: ``app`` (binding, the serving
loop), ``http`` (routes and streaming), ``worker`` (the one-at-a-time generation queue) and
``schema`` (request parsing and response shapes, no MLX)."""

from .app import bind_warning, context_length, listen, make_server, run_server

__all__ = ["bind_warning", "context_length", "listen", "make_server", "run_server"]
