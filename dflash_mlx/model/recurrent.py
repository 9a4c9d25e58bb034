"""Recurrent layers (Gated DeltaNet): which caches are theirs, and the wrapper on their
mixers that records what a rollback needs.

Their caches are mlx-lm's ``ArraysCache`` (and another library's once its model is loaded:
mlx-vlm's, ``vision/loader.py``). A snapshot copies them; a rollback rewinds or replays
them; they are never trimmed. In a batch each row keeps its own number of the verified
tokens: rows are rewound in groups of equal keeps, each group as one request alone would
be (the recurrence and the conv are row-wise: the same bits as decoding it alone).
"""

from __future__ import annotations

import copy
from dataclasses import fields, replace

import mlx.core as mx
from mlx import nn
from mlx_lm.models.cache import ArraysCache

from . import tape
from .wrapper import Wrapper

_RECURRENT: list[type] = [ArraysCache]


def add_recurrent(cls: type) -> None:
    """Treat caches of ``cls`` as recurrent layers' (another library's ``ArraysCache``)."""
    if cls not in _RECURRENT:
        _RECURRENT.append(cls)


def recurrent(c) -> bool:
    """Whether ``c`` is a recurrent layer's cache (a list of states, not trimmable)."""
    return isinstance(c, tuple(_RECURRENT))


class Recorder(Wrapper):
    """Wraps a recurrent mixer (Gated DeltaNet). While armed (the forward after a
    ``snapshot``) it keeps what a rollback needs: a known mixer's tape (``tape.py``),
    else its input, to replay."""

    def __init__(self, mixer: nn.Module, armed: dict):
        super().__init__(mixer)
        object.__setattr__(self, "_armed", armed)
        object.__setattr__(self, "_taped", tape.known(mixer))
        object.__setattr__(self, "_own", tape.own_steps(mixer))
        object.__setattr__(self, "_last", None)

    def __call__(self, x, mask=None, cache=None):
        if not self._armed.get("on"):
            object.__setattr__(self, "_last", None)
            return self.inner(x, mask, cache)
        plain = mask is None and cache is not None and cache.lengths is None
        if self._taped and plain:
            out, t = tape.forward(self.inner, x, mask, cache)
            object.__setattr__(self, "_last", t)
            return out
        object.__setattr__(self, "_last", (x, mask))
        return self.inner(x, mask, cache)

    def rewind(self, cache, snap: list, keep: int | list[int]) -> None:
        """Put ``cache`` back to ``snap`` and feed it the first ``keep`` recorded steps.

        Args:
            keep: steps to keep, one count for all rows or one per row (a batch).
        """
        last = self._last
        object.__setattr__(self, "_last", None)
        if isinstance(keep, int) or len(set(keep)) == 1:
            self._rewind(last, cache, snap, keep if isinstance(keep, int) else keep[0])
            return
        groups: dict[int, list[int]] = {}
        for i, k in enumerate(keep):
            groups.setdefault(k, []).append(i)
        fed = (last.q if isinstance(last, tape.Tape) else last[0]).shape[1]
        parts, order = [], []
        for k, rows in groups.items():
            idx = mx.array(rows)
            if k == fed:  # these rows kept every step: the forward left their states
                parts.append([_take(s, idx) for s in cache.cache])
            else:
                sub = copy.copy(cache)  # the same class, holding only these rows' states
                self._rewind(_rows(last, idx), sub, [_take(s, idx) for s in snap], k)
                parts.append(sub.cache)
            order += rows
        back = mx.array(sorted(range(len(order)), key=order.__getitem__))  # batch order
        cache.cache = [_join([p[e] for p in parts], back) for e in range(len(snap))]

    def _rewind(self, last, cache, snap: list, keep: int) -> None:
        if isinstance(last, tape.Tape):
            tape.rewind(self.inner, last, cache, snap, keep, self._own)
            return
        cache.cache = list(snap)
        x, mask = last
        self.inner(x[:, :keep], None if mask is None else mask[:, :keep], cache)


def _take(x, idx: mx.array):
    return None if x is None else x[idx]


def _join(parts: list, back: mx.array):
    """The groups' states of one cache entry, concatenated and put back in batch order."""
    if any(p is None for p in parts):  # a state never written (no row fed it yet)
        return None
    return mx.concatenate(parts)[back]


def _rows(last, idx: mx.array):
    """A recorder's last call (a Tape, or (input, mask) to replay) for rows ``idx``."""
    if isinstance(last, tape.Tape):
        kw = {f.name: _take(getattr(last, f.name), idx) for f in fields(last) if f.name != "states"}
        kw["states"] = None if last.states is None else [s[idx] for s in last.states]
        return replace(last, **kw)
    x, mask = last
    return x[idx], _take(mask, idx)
