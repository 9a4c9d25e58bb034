"""What a cycle costs to ``block_size="auto"`` (docs/algorithm.md §7): seconds per block
width, and one such table per context band, since a plain step and a verify grow
differently as the context grows (the warm-up times them at 48 and at 2,048 tokens)."""

from __future__ import annotations

EMA = 0.25  # weight of a new cost observation
BAND_START = 1024  # contexts below it share the warm-up's band; then one band per doubling
SHORT_CONTEXT = 48  # tokens of context behind the warm-up's first tables
LONG_CONTEXT = 2048  # ... and behind its long-context tables (how costs grow with context)


def band(context: int) -> int:
    """The cost band of a context of ``context`` tokens: 0 below ``BAND_START``, then 1, 2,
    3, ... for each doubling (1k-2k, 2k-4k, 4k-8k, ...)."""
    return 0 if context < BAND_START else (context // BAND_START).bit_length()


def band_context(b: int) -> int:
    """The context a band's costs are predicted at: the warm-up's for band 0 (whose table
    it measured), else the middle of the band (3,072 tokens for 2k-4k)."""
    return SHORT_CONTEXT if b == 0 else 3 * BAND_START * 2 ** (b - 1) // 2


class CostTable:
    """Seconds per cycle for each block size 1..max_block, measured and interpolated.

    Args:
        max_block: the checkpoint's block size.
    """

    def __init__(self, max_block: int):
        self.max_block = max_block
        self.seconds: dict[int, float] = {}
        # what is not measured yet at this table's context (a band's table starts as the
        # band below's, grown by a prediction): its first timing replaces that value
        self.fresh: set[str] = set()

    def observe(self, b: int, seconds: float) -> float:
        """Fold in one measured cycle of block b (b = 1: a plain step).

        A plain step, observed far more often than any block, also rescales every block's
        cost (``follow``): the machine's speed drifts (1.1-1.5x within minutes here) and
        moves all widths alike, so a block's cost is kept as a ratio to the plain step's. A
        block timed an hour ago (or stored from an earlier run) then still compares right.
        In a fresh band (``Bands``) the first timing of each kind replaces the predicted one.

        Returns:
            the factor the plain step's cost moved by (1.0 for a block).
        """
        old = self.seconds.get(b)
        first = ("plain" if b == 1 else "block") in self.fresh
        weight = 1.0 if old is None or first else EMA
        self.seconds[b] = (1 - weight) * (old or 0.0) + weight * seconds
        if b != 1:
            self.fresh.discard("block")
            if first and old:  # a band's first block timing moves its predicted widths alike
                self.rescale(self.seconds[b] / old, keep=b)
            return 1.0
        scale = self.seconds[1] / old if old else 1.0
        self.follow(scale)
        return scale

    def follow(self, scale: float) -> None:
        """A plain step's cost moved by ``scale``: move the blocks' alike, unless this is
        the band's first plain timing and its blocks were timed at its context already
        (the move is then the context's, which they have)."""
        first = "plain" in self.fresh
        self.fresh.discard("plain")
        if not first or "block" in self.fresh:
            self.rescale(scale)

    def rescale(self, scale: float, keep: int = 1) -> None:
        """Multiply every block's cost (not the plain step's, nor ``keep``'s) by ``scale``."""
        for k in self.seconds:
            if k not in (1, keep):
                self.seconds[k] *= scale

    def copy(self, fresh: bool = False) -> CostTable:
        """The same costs; ``fresh``: none of them measured at the copy's context yet."""
        table = CostTable(self.max_block)
        table.seconds = dict(self.seconds)
        table.fresh = {"plain", "block"} if fresh else set(self.fresh)
        return table

    def __call__(self, b: int) -> float:
        """Cost of block b: measured, else linear between the nearest measured sizes."""
        if b in self.seconds:
            return self.seconds[b]
        known = sorted(self.seconds)
        if not known:
            return float(b)  # nothing measured: assume a cost proportional to the tokens
        lo = [k for k in known if k < b]
        hi = [k for k in known if k > b]
        if lo and hi:
            k0, k1 = lo[-1], hi[0]
        elif len(known) >= 2:  # extrapolate from the two nearest points
            k0, k1 = (known[-2], known[-1]) if lo else (known[0], known[1])
        else:
            return self.seconds[known[0]] * b / known[0]
        c0, c1 = self.seconds[k0], self.seconds[k1]
        return max(c0 + (c1 - c0) * (b - k0) / (k1 - k0), 1e-9)


def growth(short: CostTable, long: CostTable) -> CostTable:
    """Seconds each width's cost grows by from ``SHORT_CONTEXT`` to ``LONG_CONTEXT``: taken
    at the widths the long pass timed (never negative) and interpolated between them, so a
    short-context bump at an untimed width (verify cost by width is not monotone on a CPU
    BLAS) is carried as it is, not inverted into the slope."""
    table = CostTable(short.max_block)
    table.seconds = {b: max(s - short(b), 0.0) for b, s in long.seconds.items()}
    return table


def grown(short: CostTable, grows: CostTable, b: int, context: int) -> float:
    """The cost of block b at ``context`` tokens: linear in the context (attention reads
    every cached row; the matmuls do not grow) from its short-context cost, by ``grows``
    (:func:`growth`) per ``LONG_CONTEXT - SHORT_CONTEXT`` tokens."""
    x = max(context - SHORT_CONTEXT, 0) / (LONG_CONTEXT - SHORT_CONTEXT)
    return short(b) + grows(b) * x


class Bands:
    """One decoding mode's cost tables by context band. A band's first table is a copy of
    the nearest band below, each width grown by the factor the warm-up's long-context
    timings predict between the two bands (``grown``), and marked fresh: its first plain
    run and first timed block then replace the predicted costs instead of nudging them, so
    what a band weighs is measured at its own context, and its first choice is not made on
    a shorter context's costs.

    Args:
        measured: the warm-up's table (band 0's, copied).
        long: the warm-up's table at ``LONG_CONTEXT`` (None: a band starts as a plain copy).
    """

    def __init__(self, measured: CostTable, long: CostTable | None = None):
        self.tables = {0: measured.copy()}
        self.short = measured.copy()
        self.grows = None if long is None else growth(measured, long)

    def at(self, b: int) -> CostTable:
        """The table of band ``b`` (made on first use)."""
        if b not in self.tables:
            below = max([k for k in self.tables if k < b], default=0)
            table = self.tables[below].copy(fresh=True)
            if self.grows is not None:
                lo, hi = band_context(below), band_context(b)
                for w in table.seconds:
                    up = grown(self.short, self.grows, w, hi) / grown(self.short, self.grows, w, lo)
                    table.seconds[w] *= up
            self.tables[b] = table
        return self.tables[b]
