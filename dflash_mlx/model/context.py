"""The drafter's context cache: per layer, the K/V of the committed tokens' target features
(docs/algorithm.md §2.3), the features not projected yet, and how a block attends to them."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

SLACK = 256  # rows a sliding buffer has past its window at least (and its smallest size)


class GrowingRows:
    """Every context row, in mlx-lm's ``KVCache`` (grown in steps of 256 rows, written in
    place): a cycle copies the context neither to append nor to attend to it."""

    def __init__(self):
        self._kv = KVCache()

    @property
    def size(self) -> int:
        """Rows held."""
        return self._kv.offset

    def held(self) -> tuple:
        """(keys, values) [1, n_kv, size, head_dim], or (None, None) when empty."""
        return self._kv.keys_and_values() if self._kv.offset else (None, None)

    def append(self, keys: mx.array, values: mx.array) -> None:
        """Keep rows [1, n_kv, n, head_dim] after the held ones."""
        self._kv.update_and_fetch(keys, values)

    def with_block(self, keys: mx.array, values: mx.array, keep: int = 0) -> tuple:
        """The held rows then a block's [1, n_kv, L, head_dim]; its first ``keep`` rows
        are kept (context rows projected with the block), the rest not."""
        out = self._kv.update_and_fetch(keys, values)
        self._kv.trim(keys.shape[2] - keep)
        return out

    def trim(self, n: int) -> None:
        """Drop the last n held rows."""
        self._kv.trim(n)

    @property
    def arrays(self) -> list:
        """Its buffers."""
        return [a for a in (self._kv.keys, self._kv.values) if a is not None]


class WindowRows:
    """The last ``window`` context rows, in order, in a buffer of at most ``window + slack``
    rows written in place (a sliding layer's context, docs/algorithm.md §2.3).

    Rows and blocks are written past the held ones; the window's start moves forward. Only
    when the buffer is full are the held rows copied to its front: one window-sized copy
    every ``slack`` rows (a quarter window, at least ``SLACK``), where a concatenation would
    copy the window on every append and every draft. A short context gets a buffer twice
    its size, doubled as it grows. The rows keep their order, so attention sees the bits
    the concatenation gave.

    Args:
        window: rows to keep.
    """

    def __init__(self, window: int):
        self.window = window
        self.slack = max(window // 4, SLACK)
        self._k: mx.array | None = None  # [1, n_kv, capacity, head_dim]
        self._v: mx.array | None = None
        self._start = self._end = 0  # the held rows are _start .. _end - 1

    @property
    def size(self) -> int:
        """Rows held."""
        return self._end - self._start

    def held(self) -> tuple:
        """(keys, values) [1, n_kv, size, head_dim] (views), or (None, None) when empty."""
        if not self.size:
            return None, None
        return self._k[:, :, self._start : self._end], self._v[:, :, self._start : self._end]

    def _room(self, n: int, keys: mx.array, values: mx.array) -> None:
        """Room for n rows past the held ones: a new buffer with the held rows at its front
        when the current one lacks it (keys, values give the shapes and dtypes)."""
        if self._k is not None and self._end + n <= self._k.shape[2]:
            return
        size = self.size
        cap = min(self.window + max(self.slack, n), max(2 * (size + n), SLACK))
        k = mx.zeros(keys.shape[:2] + (cap, keys.shape[3]), keys.dtype)
        v = mx.zeros(values.shape[:2] + (cap, values.shape[3]), values.dtype)
        if size:
            k[:, :, :size], v[:, :, :size] = self.held()
        self._k, self._v, self._start, self._end = k, v, 0, size

    def _write(self, keys: mx.array, values: mx.array) -> int:
        """Write rows [1, n_kv, n, head_dim] just past the held ones; returns n."""
        n = keys.shape[2]
        self._room(n, keys, values)
        self._k[:, :, self._end : self._end + n] = keys
        self._v[:, :, self._end : self._end + n] = values
        return n

    def append(self, keys: mx.array, values: mx.array) -> None:
        """Keep rows [1, n_kv, n, head_dim] after the held ones, the last ``window`` in all."""
        if keys.shape[2] >= self.window:  # nothing held survives: keep the last window rows
            keys, values = keys[:, :, -self.window :], values[:, :, -self.window :]
            self._start = self._end
        n = self._write(keys, values)  # may move the held rows to the buffer's front
        self._end += n
        self._start = max(self._start, self._end - self.window)

    def with_block(self, keys: mx.array, values: mx.array, keep: int = 0) -> tuple:
        """The held rows then a block's [1, n_kv, L, head_dim] (views of the buffer); the
        block is written past the held rows, its first ``keep`` rows kept (the window's
        start moves past rows it drops, as ``append`` does), the rest not."""
        n = self._write(keys, values)  # may move the held rows to the buffer's front
        stop = self._end + n
        self._end += keep
        self._start = max(self._start, self._end - self.window)
        return self._k[:, :, self._start : stop], self._v[:, :, self._start : stop]

    def trim(self, n: int) -> None:
        """Drop the last n held rows (rows the window dropped are not brought back)."""
        self._end -= min(n, self.size)

    @property
    def arrays(self) -> list:
        """Its buffers."""
        return [a for a in (self._k, self._v) if a is not None]


class ContextCache:
    """Per-layer K/V of the context rows (target features of committed tokens).

    Only context K/V persist between cycles; sliding layers keep the last ``window`` rows.
    Both kinds are written in place (``GrowingRows``, ``WindowRows``).

    Args:
        window: rows to keep, or None to keep all.
    """

    def __init__(self, window: int | None = None):
        self.window = window
        self._rows = GrowingRows() if window is None else WindowRows(window)
        self.offset = 0  # rows projected so far == absolute position of the next row
        # Target features [1, n, nT*H] not projected yet (``DFlashDrafter.append_context``)
        self.pending: list[mx.array] = []

    def held(self) -> tuple:
        """The held (keys, values) [1, n_kv, size, head_dim], or (None, None) when empty."""
        return self._rows.held()

    keys = property(lambda self: self.held()[0])
    values = property(lambda self: self.held()[1])

    @property
    def pending_rows(self) -> int:
        """Feature rows waiting to be projected."""
        return sum(f.shape[1] for f in self.pending)

    @property
    def position(self) -> int:
        """Absolute position of the next row, pending rows included."""
        return self.offset + self.pending_rows

    @property
    def size(self) -> int:
        """Rows currently held."""
        return self._rows.size

    def append(self, keys: mx.array, values: mx.array) -> None:
        """Add new context rows [1, n_kv, n, head_dim], dropping rows past the window."""
        self.offset += keys.shape[2]
        self._rows.append(keys, values)

    def with_block(self, keys: mx.array, values: mx.array, keep: int = 0) -> tuple:
        """The held rows followed by a block's rows [1, n_kv, L, head_dim], for one
        attention call; the block rows are not kept (they are written past the held rows
        of the buffer and forgotten, so nothing is copied), except its first ``keep``:
        new context rows projected in the block's pass (``cpu/draft_step.py``), which then
        count as appended."""
        self.offset += keep
        return self._rows.with_block(keys, values, keep)

    def trim(self, n: int) -> None:
        """Drop the last n rows (pending ones first, then positions offset-n ..). Rows the
        window already dropped are not brought back: the drafter then sees less context,
        which costs acceptance, never correctness."""
        while n and self.pending:
            k = self.pending[-1].shape[1]
            if k <= n:
                self.pending.pop()
                n -= k
            else:
                self.pending[-1] = self.pending[-1][:, : k - n]
                n = 0
        n = min(n, self.offset)
        self.offset -= n
        self._rows.trim(n)

    def save_state(self) -> tuple[dict[str, mx.array], dict[str, str]]:
        """Arrays and metadata that fully describe this cache (e.g. for safetensors);
        ``load_state`` rebuilds an equal cache. Pending features are saved per layer, so
        flush them first (``DFlashDrafter.flush_context``) to save them once, projected.

        Returns:
            (arrays, meta): ``keys`` / ``values`` [1, n_kv, size, head_dim] when rows are
            held, ``pending`` [1, n, nT*H] when features wait; meta gives ``window``
            (``none`` or an int) and ``offset``, as strings.
        """
        arrays = {}
        keys, values = self.held()
        if keys is not None:
            arrays["keys"], arrays["values"] = keys, values
        if self.pending:
            arrays["pending"] = mx.concatenate(self.pending, axis=1)
        meta = {
            "format": "dflash_mlx.ContextCache/1",
            "window": "none" if self.window is None else str(self.window),
            "offset": str(self.offset),
        }
        return arrays, meta

    @classmethod
    def load_state(cls, arrays: dict[str, mx.array], meta: dict[str, str]) -> ContextCache:
        """The cache ``save_state`` described.

        Args:
            arrays: its arrays (``keys``, ``values``, ``pending``, each optional).
            meta: its metadata.

        Returns:
            a new ContextCache holding the same rows at the same positions.

        Raises:
            ValueError: the two do not describe a context cache.
        """
        if meta.get("format") != "dflash_mlx.ContextCache/1":
            raise ValueError(f"not a saved context cache (format {meta.get('format')!r})")
        window = None if meta["window"] == "none" else int(meta["window"])
        cache = cls(window)
        keys, values = arrays.get("keys"), arrays.get("values")
        if (keys is None) != (values is None) or int(meta["offset"]) < (
            0 if keys is None else keys.shape[2]
        ):
            raise ValueError("a saved context cache needs keys and values and offset >= rows")
        if keys is not None:
            cache.append(keys, values)
        cache.offset = int(meta["offset"])
        if "pending" in arrays:
            cache.pending = [arrays["pending"]]
        return cache

    @property
    def state(self):
        """Arrays to evaluate."""
        return self._rows.arrays + self.pending
