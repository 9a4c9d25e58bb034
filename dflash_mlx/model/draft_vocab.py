"""Draft vocabulary (docs/format.md §2.4, docs/algorithm.md §2.4): the drafter scores,
ranks and proposes only a subset of the target's vocabulary, through the rows of the
target's LM head for those ids. The target's side (verify, acceptance) is unchanged: the
proposal is 0 outside the subset, which rejection sampling already handles exactly.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx import nn

from ..errors import DFlashError
from . import qmm
from .target import TargetAdapter, _text_model

TENSOR = "draft_vocab"  # optional checkpoint tensor: sorted int32 target ids


def check_ids(ids: np.ndarray, vocab: int, where: str) -> np.ndarray:
    """Validate draft-vocabulary ids: 1-D, sorted, unique, inside the target vocabulary.

    Args:
        ids: candidate ids. vocab: the target's vocabulary size. where: named in errors.

    Returns:
        the ids as int32.

    Raises:
        DFlashError: one line naming the problem.
    """
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise DFlashError(f"{where}: {TENSOR} must be a non-empty 1-D integer tensor")
    if ids.min() < 0 or ids.max() >= vocab:
        raise DFlashError(f"{where}: {TENSOR} holds ids outside the vocabulary [0, {vocab})")
    if np.any(np.diff(ids) <= 0):
        raise DFlashError(f"{where}: {TENSOR} must be sorted and free of duplicates")
    return ids.astype(np.int32)


def ranked_vocab(tokenizer, n: int, vocab: int) -> np.ndarray:
    """The ``n`` most frequent ids by the tokenizer's merge ranks, plus its special tokens.

    Byte-level BPE vocabularies are numbered in merge order, and a merge is learnt when its
    pair is the most frequent left, so a lower id is (roughly) a more frequent token.
    Special tokens (end of turn, end of text) are always kept: the drafter must be able to
    propose the end of an answer.

    Args:
        tokenizer: the target's tokenizer (mlx-lm wrapper or HF tokenizer). n: size wanted.
        vocab: the target's vocabulary size (the embedding's rows).

    Returns:
        sorted int32 ids, at most ``max(n, specials)`` of them.
    """
    if n < 16:
        raise DFlashError(f"--draft-vocab {n} is too small; use 16 or more, or 0 for off")
    special = _specials(tokenizer, vocab)
    n_plain = max(0, min(n, vocab) - len(special))
    ids = set(range(n_plain)) | special
    k = n_plain
    while len(ids) < min(n, vocab):  # specials fell inside the first n_plain ids
        ids.add(k)
        k += 1
    return np.array(sorted(ids), np.int32)


def calibrated_vocab(counts: np.ndarray, n: int, tokenizer, vocab: int) -> np.ndarray:
    """The ``n`` ids a calibration pass ranks first: the special tokens, then every token
    the target answered with (most frequent first), then the merge ranks' order.

    Measured on the demo's held-out answers, the target's own answer tokens cover them far
    better than merge ranks do (docs/algorithm.md §2.6); the merge ranks only fill the rest.

    Args:
        counts: how often each id was the target's answer token [V] (a calibration pass,
            e.g. self-distilled answers). n: size wanted. tokenizer, vocab: as for
            ``ranked_vocab``.

    Returns:
        sorted int32 ids.
    """
    counts = np.asarray(counts)[:vocab]
    seen = np.flatnonzero(counts)
    by_count = seen[np.argsort(-counts[seen], kind="stable")]
    specials = sorted(_specials(tokenizer, vocab))
    order = list(dict.fromkeys(specials + by_count.tolist() + list(range(vocab))))
    return np.array(sorted(order[: min(n, vocab)]), np.int32)


def _specials(tokenizer, vocab: int) -> set:
    """The tokenizer's special and end-of-sequence ids inside the vocabulary."""
    special = set(getattr(tokenizer, "all_special_ids", None) or [])
    special |= set(getattr(tokenizer, "eos_token_ids", None) or [])
    return {int(i) for i in special if 0 <= int(i) < vocab}


class DraftHead:
    """The target's LM head restricted to the draft vocabulary ``ids``.

    Dense heads (a Linear or a tied float embedding) keep their gathered rows; quantized
    ones gather their packed rows, scales and biases and use ``quantized_matmul``; any
    other head falls back to the full head followed by a column gather (exact, no saving).

    Args:
        adapter: the target's adapter. ids: sorted int32 target ids [V'].
    """

    def __init__(self, adapter: TargetAdapter, ids: np.ndarray):
        self.ids = mx.array(ids.astype(np.int32))  # [V']
        self.size = int(ids.size)
        self.adapter = adapter
        # Width of the target's own logits: proposals are scattered back to it.
        self.vocab = int(adapter.lm_head(mx.zeros((1, adapter.hidden_size))).shape[-1])
        head = getattr(_text_model(adapter.model), "lm_head", None)
        head = qmm.unwrap(adapter.inner.embed_tokens if head is None else head)
        self._quant: dict | None = None
        self._weight: mx.array | None = None
        if isinstance(head, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and "bias" not in head:
            biases = head.get("biases")
            self._quant = {
                "w": head["weight"][self.ids],
                "scales": head["scales"][self.ids],
                "biases": None if biases is None else biases[self.ids],
                "group_size": head.group_size,
                "bits": head.bits,
                "mode": getattr(head, "mode", "affine"),
            }
            mx.eval([v for v in self._quant.values() if isinstance(v, mx.array)])
        elif isinstance(head, (nn.Linear, nn.Embedding)) and "bias" not in head:
            self._weight = head.weight[self.ids]  # [V', H]
            mx.eval(self._weight)

    def __call__(self, h: mx.array) -> mx.array:
        """Logits over the draft vocabulary; [.., H] -> [.., V']."""
        if self._weight is not None:
            return h @ self._weight.T
        q = self._quant
        if q is not None:
            return mx.quantized_matmul(
                h,
                q["w"],
                scales=q["scales"],
                biases=q["biases"],
                transpose=True,
                group_size=q["group_size"],
                bits=q["bits"],
                mode=q["mode"],
            )
        return mx.take(self.adapter.lm_head(h), self.ids, axis=-1)

    def to_target(self, idx: mx.array) -> mx.array:
        """Map indices into the draft vocabulary to target ids (same shape, uint32)."""
        return self.ids[idx.astype(mx.int32)].astype(mx.uint32)
