"""A scheduler that follows a fixed script of block sizes, to force switches between plain
and speculative steps in the parity and sampling-law tests."""

from itertools import cycle

from dflash_mlx.schedule import Choice


class Scripted:
    """Chooses blocks from ``script`` in turn (1 = a run of ``plain`` plain steps).

    Args:
        script: block sizes. plain: steps per plain run.
    """

    def __init__(self, script, plain=3):
        self.script, self.plain, self.used = cycle(script), plain, []

    def choose(self, budget=None):
        b = next(self.script)
        return Choice(b if budget is None else max(1, min(b, budget)), 1.0)

    def plain_run(self):
        return self.plain

    def record(self, b, accepted, seconds):
        self.used.append(b)
