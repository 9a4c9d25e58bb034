"""The OpenAI-compatible HTTP server behind ``dflash serve``: ``http`` (routes, streaming,
the serving loop), ``worker`` (the one-at-a-time generation queue) and ``schema`` (request
parsing and response shapes, no MLX)."""

from .http import bind_warning, context_length, make_server, run_server

__all__ = ["bind_warning", "context_length", "make_server", "run_server"]
