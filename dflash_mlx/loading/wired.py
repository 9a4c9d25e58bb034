"""Decoding under MLX's wired limit: mlx-lm's ``wired_limit`` entered once for all the
decodes that overlap (requests on threads), and MLX's buffer cache released after a prefill.
"""

from __future__ import annotations

import contextlib
import io
import threading

_WIRED = {"depth": 0, "context": None}  # one wired limit while any decode runs
_WIRED_LOCK = threading.Lock()


def _wire(model, on: bool) -> None:
    """Enter mlx-lm's ``wired_limit`` for the first decode running, leave it after the last
    (requests on threads overlap; nesting would restore the limits out of order)."""
    with _WIRED_LOCK:
        _WIRED["depth"] += 1 if on else -1
        if on and _WIRED["depth"] == 1:
            from mlx_lm.generate import wired_limit

            context = wired_limit(model)
            with contextlib.redirect_stdout(io.StringIO()):  # its warning: ours is on stderr
                context.__enter__()
            _WIRED["context"] = context
        elif not on and _WIRED["depth"] == 0 and _WIRED["context"] is not None:
            context, _WIRED["context"] = _WIRED["context"], None
            context.__exit__(None, None, None)


def decoding(model, steps):
    """A decode generator run under MLX's wired limit (mlx-lm's ``wired_limit``: the
    recommended working set kept resident on Metal; nothing elsewhere), with MLX's buffer
    cache released once the prefill is done. The items are the generator's, unchanged.

    Args:
        model: the loaded pair (``DFlashModel``). steps: ``loop.decode``'s generator.
    """
    import mlx.core as mx

    _wire(model.target, True)
    try:
        first = next(steps, None)
        if first is None:
            return
        mx.clear_cache()  # the prefill's temporaries: given back before the cycles
        yield first
        yield from steps
    finally:
        steps.close()
        _wire(model.target, False)
