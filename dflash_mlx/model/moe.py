"""Mixture-of-experts targets: each MoE layer's routed experts (mlx-lm's ``SwitchGLU`` /
``SwitchMLP`` instance) wrapped, to count the distinct experts a forward reads and to verify
several rows reading each chosen expert once (docs/algorithm.md §4.6).

mlx-lm multiplies every (row, slot) pair by its expert alone, and sorts the pairs by expert
only from 64 pairs on: a verify of B rows x top-k reads an expert once per pair that chose
it. The grouped path runs one product per expert over all the rows that chose it, through
the same projection modules (``gather_mm`` / ``gather_qmm``). On MLX's CPU backend every
row's sums keep the order of a one-row product (the few-row kernel, ``cpu/small_gemm.py``;
``gather_qmm`` reduces row by row), so the output is mlx-lm's, bit for bit. It needs the
routing on the host (one sync per MoE layer), so it is timed against mlx-lm's path at its
first use per shape and kept only where faster. On Metal mlx-lm's path always runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from .qmm_choice import Chooser
from .wrapper import Wrapper

ENV = "DFLASH_MOE_GROUPED"  # "1": always grouped, "0": never, unset: timed per shape
ROWS = (2, 16)  # verify widths the grouped path may take (a plain step reads k experts)
CHOOSER = Chooser()  # per (rows, experts, top-k, shape, bits): grouped at least as fast


def grouped(experts: nn.Module, x: mx.array, indices: mx.array) -> mx.array:
    """``experts(x, indices)`` with the (row, slot) pairs grouped by expert: one product per
    expert and rows-per-expert count, of all the rows that chose it.

    Args:
        experts: an mlx-lm ``SwitchGLU`` or ``SwitchMLP`` (dense or quantized projections).
        x: rows [..., D]. indices: each row's experts [..., k].

    Returns:
        [..., k, D'] as the module returns it.
    """
    k = indices.shape[-1]
    flat = np.array(indices).reshape(-1)  # the routing on the host: the one sync
    order = np.argsort(flat, kind="stable")  # pair ids, expert by expert
    ids, start, counts = np.unique(flat[order], return_index=True, return_counts=True)
    rows = x.reshape(-1, x.shape[-1])  # [B*L, D]
    outs, where = [], []
    for c in np.unique(counts):  # the experts chosen by c pairs: one [n, c, D] product
        sel = np.flatnonzero(counts == c)
        pairs = order[(start[sel][:, None] + np.arange(c)).reshape(-1)]  # [n * c]
        xg = rows[mx.array(pairs // k)].reshape(sel.size, int(c), -1)
        y = _project(experts, xg, mx.array(ids[sel].astype(np.uint32)))  # [n, c, D']
        outs.append(y.reshape(-1, y.shape[-1]))
        where.append(pairs)
    back = np.empty(flat.size, np.int64)
    back[np.concatenate(where)] = np.arange(flat.size)
    y = outs[0] if len(outs) == 1 else mx.concatenate(outs)
    return y[mx.array(back)].reshape(*indices.shape, -1)


def _project(m: nn.Module, xg: mx.array, e: mx.array) -> mx.array:
    """The experts ``e`` [n] applied to their rows xg [n, c, D], with the module's own
    projections and activation (each adds its bias row to each of its rows)."""
    if isinstance(m, SwitchGLU):
        return m.down_proj(m.activation(m.up_proj(xg, e), m.gate_proj(xg, e)), e)
    return m.fc2(m.activation(m.fc1(xg, e)), e)


def _mode() -> str | None:
    """ "1" / "0" from ``DFLASH_MOE_GROUPED``, or None (timed)."""
    v = os.environ.get(ENV, "").strip().lower()
    return None if not v else ("0" if v in ("0", "off", "false", "no") else "1")


def _shape_key(m: nn.Module, rows: int, k: int) -> str:
    first = m.up_proj if isinstance(m, SwitchGLU) else m.fc1
    w = first.weight  # [E, H, D] (packed words when quantized)
    bits = getattr(first, "bits", 0)
    return f"{rows},{k},{w.shape[0]},{w.shape[1]},{first.input_dims},{bits},{w.dtype}"


def _stand_in(m: nn.Module, rows: int, k: int, dtype) -> tuple[mx.array, Callable]:
    """Random rows [1, rows, D] and a random router: the routing is computed in each timed
    call (uniform over the experts), so the grouped path pays for taking it to the host."""
    first = m.up_proj if isinstance(m, SwitchGLU) else m.fc1
    n = first.weight.shape[0]
    x = mx.random.normal((1, rows, first.input_dims), key=mx.random.key(5)).astype(dtype)
    gate = mx.random.normal((n, first.input_dims), key=mx.random.key(6)).astype(dtype)
    mx.eval(x, gate)

    def route(x: mx.array) -> mx.array:
        return mx.argpartition(x @ gate.T, kth=-k, axis=-1)[..., -k:].astype(mx.uint32)

    return x, route


class ExpertCount:
    """The distinct experts each MoE layer reads per forward, summed by kind of forward
    ("verify", "plain" step, "prefill"), for ``dflash bench`` and ``dflash run --json``.
    Off until :meth:`reset` (counting keeps each forward's routing until it is read).

    Args:
        experts: experts per layer. top_k: experts per token. layers: MoE layers.
    """

    def __init__(self, experts: int, top_k: int, layers: int):
        self.experts, self.top_k, self.layers = experts, top_k, layers
        self.on = False
        self.phase: str | None = None  # set by the adapter around its forwards
        self._pending: list[tuple[str, int, mx.array]] = []  # (kind, rows, indices)
        self._sums: dict[str, list[float]] = {}  # kind -> [distinct, layer calls, rows]

    def reset(self, on: bool = True) -> None:
        """Forget the counts; count from now on (``on``) or stop."""
        self.on, self._pending, self._sums = on, [], {}

    def record(self, indices: mx.array) -> None:
        """Keep one layer's routing [..., k] of the current forward (read later)."""
        rows = indices.size // indices.shape[-1]
        kind = self.phase or ("plain" if rows == 1 else "prefill")
        self._pending.append((kind, rows, indices))
        # read on the host at the end (out of a timed decode); in a long one, forwards well
        # back (evaluated by now) are read as it goes, so the routing kept stays bounded
        if len(self._pending) > 256 * self.layers:
            self._drain(len(self._pending) - 2 * self.layers)

    def _drain(self, n: int) -> None:
        for kind, rows, idx in self._pending[:n]:
            s = self._sums.setdefault(kind, [0.0, 0, 0])
            s[0] += np.unique(np.array(idx)).size
            s[1] += 1
            s[2] += rows
        del self._pending[:n]

    def take(self) -> dict:
        """The sums counted since the last take, then forgotten: {kind: [distinct experts,
        layer calls, rows]} (``merge`` adds two; ``summary`` reads them)."""
        self._drain(len(self._pending))
        out, self._sums = self._sums, {}
        return out

    @staticmethod
    def merge(a: dict, b: dict) -> dict:
        """Two ``take`` results added."""
        return {k: [x + y for x, y in zip(a.get(k, [0, 0, 0]), b.get(k, [0, 0, 0]))] for k in {*a, *b}}  # fmt: skip

    def summary(self, sums: dict | None = None) -> dict:
        """Mean distinct experts per layer per verify and per plain step, the verify's mean
        rows, and the model's experts and top-k (JSON-ready; None where none ran).

        Args:
            sums: a (merged) ``take`` result; by default what was counted since the last.
        """
        if sums is None:
            self._drain(len(self._pending))
            sums = self._sums

        def mean(kind: str, i: int) -> float | None:
            s = sums.get(kind)
            return round(s[i] / s[1], 3) if s and s[1] else None

        return {
            "per_verify": mean("verify", 0),
            "per_plain_step": mean("plain", 0),
            "verify_rows": mean("verify", 2),
            "num_experts": self.experts,
            "top_k": self.top_k,
            "moe_layers": self.layers,
        }


class Experts(Wrapper):
    """One MoE layer's routed experts: counted (while ``count.on``) and, for a verify's
    2..16 rows on the CPU, grouped by expert where that is faster (:func:`grouped`)."""

    def __init__(self, inner: nn.Module, count: ExpertCount):
        super().__init__(inner)
        object.__setattr__(self, "_count", count)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        if self._count.on:
            self._count.record(indices)
        k = indices.shape[-1]
        rows = indices.size // k
        if ROWS[0] <= rows <= ROWS[1] and self._use_grouped(rows, k, x.dtype):
            return grouped(self.inner, x, indices)
        return self.inner(x, indices)

    def _use_grouped(self, rows: int, k: int, dtype) -> bool:
        mode = _mode()
        if mode is not None:
            return mode == "1"
        if mx.default_device().type != mx.cpu:
            return False
        key = _shape_key(self.inner, rows, k)
        if key in CHOOSER.table:  # the stand-ins are built for a first timing only
            return CHOOSER.table[key]
        x, route = _stand_in(self.inner, rows, k, dtype)
        return CHOOSER.use_kernel(
            lambda: grouped(self.inner, x, route(x)),
            lambda: self.inner(x, route(x)),
            key,
        )


def wrap(layers: list) -> ExpertCount | None:
    """Wrap the routed experts of every MoE layer among ``layers`` (decoder layers, already
    unwrapped); return their shared counter, or None on a dense target.

    Args:
        layers: the target's decoder layers (the modules holding ``mlp``).
    """
    found = []
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        for name, child in mlp.children().items() if isinstance(mlp, nn.Module) else []:
            if isinstance(child, Experts):
                found.append((mlp, name, child.inner))
            elif isinstance(child, (SwitchGLU, SwitchMLP)):
                found.append((mlp, name, child))
    if not found:
        return None
    first = found[0][2]
    proj = first.up_proj if isinstance(first, SwitchGLU) else first.fc1
    top_k = next(
        (
            getattr(m, a)
            for m, _, _ in found
            for a in ("top_k", "num_experts_per_tok")
            if hasattr(m, a)
        ),
        0,
    )
    count = ExpertCount(proj.weight.shape[0], int(top_k), len(found))
    for mlp, name, inner in found:
        setattr(mlp, name, Experts(inner, count))
    return count
