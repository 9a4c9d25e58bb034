"""Never slower than MLX: which of MLX's ``quantized_matmul`` and the few-row kernel
(``qmm.py``) a verify's quantized matmul takes, per (rows, K, N, bits, group, dtype).

On a Metal GPU the first call of each such shape times both on random rows of that shape
and the layer's own weights, and keeps the faster. The table is stored per chip and MLX
version by the loader (``restore`` / ``saver``); a stored table is trusted after one
spot check: the first shape looked up is timed again, and if its verdict changed the whole
table is measured anew. Both paths compute the same product, so a choice never changes
what is decoded beyond the kernels' rounding (docs/algorithm.md §4.2.1).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import mlx.core as mx

REPS = 5  # timed calls per side (after one warm call); the median stands


def measure(kind: str, fn: Callable[[], mx.array]) -> float:
    """Median seconds of ``fn`` evaluated (after one warm call). ``kind`` is "kernel" or
    "mlx" (a test's stand-in timer tells them apart)."""
    mx.eval(fn())
    times = []
    for _ in range(REPS):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def shape_key(x: mx.array, w: mx.array, group_size: int, bits: int) -> str:
    """'rows,K,N,bits,group,dtype' of one call."""
    rows = x.size // x.shape[-1]
    return f"{rows},{x.shape[-1]},{w.shape[0]},{bits},{group_size},{x.dtype}"


class Chooser:
    """The per-shape choices of one process.

    Args:
        timer: ``timer(kind, fn) -> seconds`` (default :func:`measure`).
    """

    def __init__(self, timer: Callable[[str, Callable], float] = measure):
        self.timer = timer
        self.table: dict[str, bool] = {}  # key -> the kernel is faster
        self.stored: dict[str, bool] = {}  # a restored table, until its spot check
        self.saver: Callable[[dict], object] | None = None
        self.timed = 0  # shapes timed in this process

    def restore(self, table: dict | None, saver: Callable[[dict], object] | None) -> None:
        """Take a stored table (checked at the first lookup) and where to store changes."""
        self.stored = {k: v for k, v in (table or {}).items() if isinstance(v, bool)}
        self.saver = saver

    def use_kernel(self, run_kernel: Callable, run_mlx: Callable, key: str) -> bool:
        """Whether the kernel is at least as fast as MLX for this call's shape.

        Args:
            run_kernel, run_mlx: thunks computing the product on stand-in rows.
            key: :func:`shape_key` of the call.
        """
        if key in self.table:
            return self.table[key]
        if self.stored:
            verdict = self._time(run_kernel, run_mlx)
            if self.stored.get(key, verdict) == verdict:
                self.table.update(self.stored)  # the spot check agrees: trust it
            self.stored = {}
            self.table[key] = verdict
        else:
            self.table[key] = self._time(run_kernel, run_mlx)
        if self.saver is not None:
            self.saver(dict(self.table))
        return self.table[key]

    def _time(self, run_kernel: Callable, run_mlx: Callable) -> bool:
        self.timed += 1
        return self.timer("kernel", run_kernel) <= self.timer("mlx", run_mlx)

    def report(self) -> str:
        """How many shapes take the kernel, for ``dflash doctor``."""
        won = sum(self.table.values())
        return f"faster than MLX for {won} of {len(self.table)} shapes timed"


CHOOSER = Chooser()
