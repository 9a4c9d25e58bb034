"""Context lookup: drafts copied from the committed tokens (docs/algorithm.md §3.5).

The target repeats itself and its prompt (identifiers, code, lists, loops of a small
model): after the latest earlier occurrence of the longest suffix n-gram of the committed
tokens, the next tokens are often the same again. Such a draft costs no drafter pass, and it
depends on the committed tokens only, so verifying it is lossless like any other draft (its
proposal law is a point mass, ``acceptance.accept_sampled`` handles it unchanged).
"""

from __future__ import annotations

MAX_N = 4  # longest suffix n-gram matched (the one length measured; longer not tried)


class Lookup:
    """An index of the n-grams (n = 1..``max_n``) of a growing token sequence.

    Args:
        tokens: the committed tokens so far (prompt included).
        max_n: longest suffix matched.
    """

    def __init__(self, tokens=(), max_n: int = MAX_N):
        self.max_n = max_n
        self.tokens: list[int] = []
        # n-gram -> position just after its latest occurrence that has a next token
        self._after: dict[tuple, int] = {}
        self.extend(tokens)

    def extend(self, tokens) -> None:
        """Append committed tokens and index the n-grams they complete."""
        seq, after = self.tokens, self._after
        for t in tokens:
            seq.append(int(t))
            end = len(seq) - 1  # n-grams ending just before the new token now have a next one
            for n in range(1, min(self.max_n, end) + 1):
                after[tuple(seq[end - n : end])] = end

    def match(self) -> tuple[int, int]:
        """(length n of the longest suffix n-gram seen before, the position after that
        earlier occurrence); (0, 0) when even the last token is new."""
        seq = self.tokens
        for n in range(min(self.max_n, len(seq)), 0, -1):
            pos = self._after.get(tuple(seq[len(seq) - n :]))
            if pos is not None:
                return n, pos
        return 0, 0

    def propose(self, limit: int) -> tuple[list[int], int]:
        """Up to ``limit`` draft tokens and the match length they rest on.

        The tokens after the earlier occurrence are copied; where the copy reaches the end
        of the sequence it goes on copying itself (a loop of period ``len - pos``).

        Returns:
            (drafts, n): no drafts when n is 0 or limit < 1.
        """
        n, pos = self.match()
        if n == 0 or limit < 1:
            return [], n
        seq, out = self.tokens, []
        for k in range(limit):
            j = pos + k
            out.append(seq[j] if j < len(seq) else out[j - len(seq)])
        return out, n


# Conditional acceptance per draft position of a lookup draft, by the class of its match
# (``match_class``): measured on the built-in bench prompts, greedy, demo pair
# (benchmarks/lookup_acceptance.py). The scheduler starts from these and learns online.
PRIORS = {
    1: [0.16, 0.55, 0.55, 0.55, 0.55, 0.55, 0.55],
    2: [0.5, 0.6, 0.6, 0.6, 0.7, 0.7, 0.7],
    MAX_N: [0.83, 0.85, 0.75, 0.9, 0.9, 0.9, 0.9],
}
FIXED_MIN_MATCH = 2  # with a fixed block, copy when the match is at least this long


def match_class(n: int, max_n: int = MAX_N) -> int:
    """The acceptance class of a match of length n: 1, 2 (2..max_n - 1) or max_n; 0: none."""
    if n <= 0:
        return 0
    return 1 if n == 1 else (max_n if n >= max_n else 2)


def priors(positions: int) -> dict[int, list[float]]:
    """``PRIORS`` cut or padded (with their last rate) to ``positions`` draft positions."""
    return {c: (p + [p[-1]] * positions)[:positions] for c, p in PRIORS.items()}
