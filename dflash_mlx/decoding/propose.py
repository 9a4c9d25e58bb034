"""What a cycle verifies and how it accepts: the drafter's proposal (the selector's path or
each row's top token), copied drafts' point-mass law, and acceptance of a verified block
(docs/algorithm.md §3-§4)."""

from __future__ import annotations

import mlx.core as mx

from .. import ops
from .acceptance import (
    accept_greedy,
    accept_sampled,
    process_rows,
    proposal_full,
    sample_rows,
    target_probs,
)


def propose(model, logits, hidden, anchor, params, use_selector, key):
    """Draft tokens [L] (target ids) and their proposal rows [L, V] over the target's
    vocabulary (None when greedy); ``logits`` [1, L, V'] cover the draft vocabulary."""
    drafter, head = model.drafter, model.draft_head
    vocab = logits.shape[-1] if head is None else head.vocab
    if use_selector and drafter.has_selector:
        T, ids = params.temperature, None if head is None else head.ids
        u = None if params.greedy else mx.random.uniform(shape=hidden.shape[:2], key=key)
        toks, cand, q, _ = drafter.candidate_selector(
            logits, hidden, anchor.reshape(1), drafter.args.selector_top_k, T, u, ids
        )
        q_full = None if q is None else proposal_full(q[0], cand[0], vocab)
        return toks[0].astype(mx.uint32), q_full
    if params.greedy:
        return model.to_target(mx.argmax(logits[0], axis=-1)), None
    q = ops.softmax(logits[0].astype(mx.float32) / params.temperature)
    if head is None:
        return sample_rows(q, key), q
    ids = mx.broadcast_to(head.ids, q.shape)  # [L, V']
    return head.to_target(sample_rows(q, key)), proposal_full(q, ids, vocab)


def copied_drafts(tokens: list[int], vocab: int, params) -> tuple[mx.array, mx.array | None]:
    """Copied drafts [L] and their point-mass proposal rows [L, V] (None when greedy)."""
    drafts = mx.array(tokens, dtype=mx.uint32)
    if params.greedy:
        return drafts, None
    return drafts, (mx.arange(vocab)[None] == drafts[:, None]).astype(mx.float32)


def accept(v_logits, history, drafts, q_full, params, key):
    """(accepted count [], the token committed after them []) from the verify logits."""
    history = mx.array(history) if params.processors else None
    rows = process_rows(v_logits[0], history, drafts, params.processors)
    if params.greedy:
        n_acc, targets = accept_greedy(rows, drafts)
        return n_acc, targets[n_acc]
    q_full = mx.zeros((0, rows.shape[-1])) if q_full is None else q_full
    return accept_sampled(target_probs(rows, params), drafts, q_full, key)
