"""The draft vocabulary a loaded pair drafts over (``load(draft_vocab=...)``,
docs/algorithm.md §2.4)."""

from __future__ import annotations

from ..errors import DFlashError
from . import backend


def set_draft_vocab(pair, tokenizer, n: int | None) -> None:
    """Give the pair the draft vocabulary ``load(draft_vocab=n)`` asks for.

    Args:
        pair: the loaded DFlashModel. tokenizer: its tokenizer (for the merge ranks).
        n: None (the checkpoint's own), 0 (the full vocabulary) or a size.
    """
    from ..model.draft_vocab import DraftHead, ranked_vocab

    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise DFlashError(f"draft_vocab must be None, 0 or a positive integer (got {n!r})")
    ids = pair.drafter.draft_vocab if n is None else None
    vocab = pair.adapter.vocab_size
    if n and n < min(16, vocab):
        raise DFlashError(
            f"draft_vocab={n} is too small; use 16 or more, or 0 for the full vocabulary"
        )
    if n and n < vocab:
        ids = ranked_vocab(tokenizer, n, vocab)
        if len(ids) > n:  # a draft vocabulary keeps every special token
            raise DFlashError(
                f"draft_vocab={n} is fewer than the tokenizer's {len(ids)} special tokens, "
                f"which a draft vocabulary always keeps; use more than {len(ids)}"
            )
    pair.draft_head = None if ids is None else DraftHead(pair.adapter, ids)
    backend.install(pair)  # on the CPU the few-row kernel reads the drafter's 16-bit words
