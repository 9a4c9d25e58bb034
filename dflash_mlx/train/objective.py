"""The drafter's training objective: the position-weighted block cross-entropy, the logit
distillation term (cross-entropy against the target's renormalised top-k), the selector's
cross-entropy over its lattice candidates, and one compiled AdamW step over them."""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.optimizers as optim
from mlx import nn

from dflash_mlx.train.common import selector_scores


def losses(
    drafter,
    feats,
    embeds,
    anchor_ids,
    offsets,
    mask,
    labels,
    weights,
    soft_idx,
    soft_p,
    head,
    vocab_ids,
    n_blocks,
    sel_weight,
    kd_weight=0.0,
):
    """Weighted block cross-entropy, logit distillation and the selector cross-entropy.

    Args:
        drafter: the drafter being trained. feats: context features [S, T, D].
        embeds: block embeddings [N, B, H]. anchor_ids: [N]. offsets: anchor positions [N].
        mask: [N, 1, B, T + B]. labels: [N, B-1]. weights: [N, B-1] (position weight,
        0 past the answer). soft_idx: the target's top-k tokens per row as shortlist
        indices [N, B-1, k]; soft_p: their probabilities renormalised over the ones in the
        shortlist (0 elsewhere and past the answer). head: the target's LM head over the
        shortlist, whose token ids are ``vocab_ids`` (labels index the shortlist).
        n_blocks: blocks per sequence. sel_weight, kd_weight: factors of the selector and
        distillation losses.

    Returns:
        (total, block CE, selector CE, distillation CE).
    """
    B = embeds.shape[1]
    kv = drafter.context_kv(drafter.project_context(feats), 0)
    kv = [(mx.repeat(k, n_blocks, axis=0), mx.repeat(v, n_blocks, axis=0)) for k, v in kv]
    h = drafter(embeds, kv, offsets, B, mask)[:, 1:]  # [N, B-1, H]
    logits = drafter.logits(h, head).astype(mx.float32)  # [N, B-1, V']
    wsum = mx.maximum(weights.sum(), 1.0)
    ce = (nn.losses.cross_entropy(logits, labels) * weights).sum() / wsum
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    kd_rows = -(soft_p * mx.take_along_axis(logp, soft_idx, axis=-1)).sum(-1)  # [N, B-1]
    kd = (kd_rows * weights).sum() / wsum
    scores, gold = selector_scores(
        drafter, mx.stop_gradient(logits), h, anchor_ids, labels, vocab_ids
    )
    sel = (nn.losses.cross_entropy(scores, gold) * weights).sum() / wsum
    return ce + kd_weight * kd + sel_weight * sel, ce, sel, kd


def make_step(drafter, optimizer, head, vocab_ids, n_blocks, sel_weight, kd_weight=0.0):
    """A compiled optimizer step over one batch; returns (loss, ce, selector ce, kd ce)."""
    state = [drafter.state, optimizer.state]
    loss_and_grad = nn.value_and_grad(drafter, losses)

    @partial(mx.compile, inputs=state, outputs=state)
    def step(*batch):  # feats, embeds, anchor_ids, offsets, mask, labels, weights, soft x2
        out, grads = loss_and_grad(
            drafter, *batch, head, vocab_ids, n_blocks, sel_weight, kd_weight
        )
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(drafter, grads)
        return out

    return step, state
