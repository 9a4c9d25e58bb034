"""A scheduler that follows a fixed script of block sizes, to force switches between plain
and speculative steps in the parity and sampling-law tests."""

from itertools import cycle

from dflash_mlx.decoding.policy import Choice
from dflash_mlx.decoding.tree import siblings_for


class Scripted:
    """Chooses blocks from ``script`` in turn (1 = a run of ``plain`` plain steps).

    Args:
        script: block sizes. plain: steps per plain run. copy: verify the context-lookup
            draft of every block that has one (else the drafter's), and end a plain run at
            a match.
    """

    def __init__(self, script, plain=3, copy=False):
        self.script, self.plain, self.copy, self.used = cycle(script), plain, copy, []
        self.tree = False  # set by the decode loop: greedy blocks then verify siblings

    def choose(self, budget=None, match=0):
        b = next(self.script)
        b = b if budget is None else max(1, min(b, budget))
        copy = self.copy and match > 0 and b > 1
        sibs = siblings_for(b) if self.tree and not copy else 0
        return Choice(b, 1.0, lookup=copy, siblings=sibs)

    def plain_run(self):
        return self.plain

    def copy_pays(self, match):
        return self.copy and match > 0  # with copy, a match ends a plain run

    def record(self, b, step, seconds):
        self.used.append(b)

    def observe(self, b, seconds):
        pass  # costs steer nothing here
