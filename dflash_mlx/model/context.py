"""The drafter's context cache: per layer, the K/V of the committed tokens' target features
(docs/algorithm.md §2.3), the features not projected yet, and how a block attends to them."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache


class ContextCache:
    """Per-layer K/V of the context rows (target features of committed tokens).

    Only context K/V persist between cycles; sliding layers keep the last ``window`` rows.

    Args:
        window: rows to keep, or None to keep all.
    """

    def __init__(self, window: int | None = None):
        self.window = window
        # Unwindowed rows live in an mlx-lm KVCache (grown in steps, written in place), so
        # a cycle neither copies the whole context to append nor to attend to it.
        self._rows = KVCache() if window is None else None
        self._keys: mx.array | None = None  # windowed: [1, n_kv, n, head_dim]
        self._values: mx.array | None = None
        self.offset = 0  # rows projected so far == absolute position of the next row
        # Target features [1, n, nT*H] not projected yet (``DFlashDrafter.append_context``)
        self.pending: list[mx.array] = []

    def held(self) -> tuple:
        """The held (keys, values) [1, n_kv, size, head_dim], or (None, None) when empty."""
        if self._rows is None:
            return self._keys, self._values
        return self._rows.keys_and_values() if self._rows.offset else (None, None)

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
        if self._rows is not None:
            return self._rows.offset
        return 0 if self._keys is None else self._keys.shape[2]

    def append(self, keys: mx.array, values: mx.array) -> None:
        """Add new context rows [1, n_kv, n, head_dim], dropping rows past the window."""
        self.offset += keys.shape[2]
        if self._rows is not None:
            self._rows.update_and_fetch(keys, values)
            return
        if self._keys is not None:
            keys = mx.concatenate([self._keys, keys], axis=2)
            values = mx.concatenate([self._values, values], axis=2)
        if keys.shape[2] > self.window:
            keys, values = keys[:, :, -self.window :], values[:, :, -self.window :]
        self._keys, self._values = keys, values

    def with_block(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """The held rows followed by a block's rows [1, n_kv, L, head_dim], for one
        attention call; the block rows are not kept (they are written past the held rows
        of the buffer and forgotten, so nothing is copied)."""
        if self._rows is None:
            if self._keys is None:
                return keys, values
            return (
                mx.concatenate([self._keys, keys], 2),
                mx.concatenate([self._values, values], 2),
            )
        out = self._rows.update_and_fetch(keys, values)
        self._rows.trim(keys.shape[2])
        return out

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
        if self._rows is not None:
            self._rows.trim(n)
        elif n >= self.size:
            self._keys = self._values = None
        elif n:
            self._keys, self._values = self._keys[:, :, :-n], self._values[:, :, :-n]

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
        held = [self._rows.keys, self._rows.values] if self._rows is not None else []
        held += [self._keys, self._values]
        return [a for a in held if a is not None] + self.pending
