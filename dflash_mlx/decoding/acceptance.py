"""Target distributions and the acceptance rule of speculative decoding
(docs/algorithm.md §4.1-§4.2)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from .. import ops

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
MIN_TEMPERATURE = 1e-5  # a lower temperature samples as temperature 0 (greedy)


@dataclass
class SamplingParams:
    """How the target samples; mirrors mlx-lm's make_sampler / make_logits_processors.

    Args:
        temperature: 0 (or below ``MIN_TEMPERATURE``) means greedy. top_p, min_p, top_k:
            mlx-lm filters (0 = off; a top_k of the vocabulary or more is off too).
        processors: mlx-lm logits processors (penalties, logit bias).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0
    processors: list[LogitsProcessor] = field(default_factory=list)

    def __post_init__(self):
        # Below this, 1 / temperature overflows float32 near 1e-39 and the law turns NaN;
        # long before, all that is left of it is the argmax: decode greedily (as vLLM does).
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0

    @property
    def greedy(self) -> bool:
        """True at temperature 0."""
        return self.temperature == 0


def process_rows(
    logits: mx.array, history: mx.array, drafts: mx.array, processors: list[LogitsProcessor]
) -> mx.array:
    """Apply logits processors per block row, each seeing the drafts before it.

    Args:
        logits: verify logits [n, V]; row i follows history + drafts[:i].
        history: committed ids so far (prompt + generated, anchor included) [T].
        drafts: drafted ids [n - 1].

    Returns:
        processed logits [n, V].
    """
    if not processors:
        return logits
    rows = []
    for i in range(logits.shape[0]):
        toks = mx.concatenate([history, drafts[:i]]) if i else history
        row = logits[i : i + 1]
        for proc in processors:
            row = proc(toks, row)
        rows.append(row)
    return mx.concatenate(rows, axis=0)


def target_probs(logits: mx.array, params: SamplingParams) -> mx.array:
    """The law mlx-lm's sampler draws from: filter the T=1 log-probs, then temperature.

    Args:
        logits: processed logits [n, V].

    Returns:
        probabilities [n, V] float32.
    """
    logits = logits.astype(mx.float32)
    filtered = 0 < params.top_p < 1.0 or params.min_p != 0.0
    if not (filtered or 0 < params.top_k < logits.shape[-1]):
        # softmax is shift-invariant: normalising the log-probs first changes nothing
        return ops.softmax(logits * (1.0 / params.temperature))
    logprobs = logits - ops.logsumexp(logits)
    if 0 < params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p != 0.0:
        logprobs = apply_min_p(logprobs, params.min_p)
    if 0 < params.top_k < logprobs.shape[-1]:  # top_k >= the vocabulary keeps every token
        logprobs = apply_top_k(logprobs, params.top_k)
    return ops.softmax(logprobs * (1.0 / params.temperature))


def accept_greedy(logits: mx.array, drafts: mx.array) -> tuple[mx.array, mx.array]:
    """Greedy verification.

    Args:
        logits: processed verify logits [n, V]; drafts: [n - 1].

    Returns:
        (accepted count [] int32, the target tokens [n]; token n_acc is the bonus).
    """
    targets = mx.argmax(logits, axis=-1).astype(mx.uint32)
    n_acc = _leading_true(drafts == targets[:-1])
    return n_acc, targets


def accept_sampled(
    p: mx.array, drafts: mx.array, q: mx.array, key: mx.array
) -> tuple[mx.array, mx.array]:
    """Lossless rejection sampling over one block (vectorised, no host sync).

    Accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw from
    normalize(max(p_i - q_i, 0)) (p_i if that is empty); after a full acceptance draw from
    the next row.

    Args:
        p: target probabilities [n, V]; drafts: [n - 1]; q: proposal rows [n - 1, V] the
            drafts were drawn from; key: PRNG key.

    Returns:
        (accepted count [] int32, bonus token [] uint32).
    """
    n = p.shape[0]
    k_acc, k_bonus = mx.random.split(key)
    u = mx.random.uniform(shape=(n - 1,), key=k_acc)
    idx = drafts[:, None].astype(mx.int32)
    pd = mx.take_along_axis(p[:-1], idx, axis=-1)[:, 0]
    qd = mx.take_along_axis(q, idx, axis=-1)[:, 0]
    n_acc = _leading_true(u * qd < pd)
    # Row n-1 has no draft: its residual is p itself.
    Q = mx.concatenate([q, mx.zeros((1, p.shape[1]), dtype=q.dtype)], axis=0)
    p_row, q_row = p[n_acc], Q[n_acc]
    resid = mx.maximum(p_row - q_row, 0.0)
    resid = mx.where(resid.sum() > 0, resid, p_row)
    bonus = sample_rows(resid, k_bonus)
    return n_acc, bonus


def _leading_true(ok: mx.array) -> mx.array:
    """Length of the run of True at the start of a 1-D bool array."""
    if ok.size == 0:
        return mx.array(0, dtype=mx.int32)
    return mx.cumprod(ok.astype(mx.int32)).sum().astype(mx.int32)


def proposal_full(q: mx.array, cand: mx.array, vocab: int) -> mx.array:
    """Scatter selector proposals over K candidates [L, K] into vocab-wide rows [L, V]."""
    rows = mx.zeros((q.shape[0], vocab), dtype=mx.float32)
    return mx.put_along_axis(rows, cand.astype(mx.int32), q.astype(mx.float32), axis=-1)


def sample_rows(p: mx.array, key: mx.array | None = None) -> mx.array:
    """Draw one token per row of (possibly unnormalised) probabilities [.., V] by inverse
    CDF: no log over the vocabulary (scalar on MLX's CPU backend), and a zero-probability
    token is never drawn."""
    p = p.astype(mx.float32)
    cdf = mx.cumsum(p, axis=-1)  # [.., V]
    x = mx.random.uniform(shape=p.shape[:-1] + (1,), key=key) * cdf[..., -1:]
    # x rounds up to the total at most once in 2^24 draws: never past the last positive p
    last = mx.max(mx.where(p > 0, mx.arange(p.shape[-1]), 0), axis=-1)
    return mx.minimum((cdf <= x).sum(axis=-1), last).astype(mx.uint32)
