"""Held-out evaluation of a drafter under training: teacher-forced tau for top-1 drafting
(DFlash 1), the greedy selector walk (DFlash 2) and the top-K oracle."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from dflash_mlx.model.drafter import embed_block
from dflash_mlx.model.selector import select_path, top_candidates
from dflash_mlx.model.target import TargetAdapter
from dflash_mlx.train.data import ShardSet, build_batch


def to_device(blk: dict, adapter: TargetAdapter, drafter):
    """Batch arrays on the device, with the block embeddings (the decoder's own function)."""
    ids = mx.array(blk["ids"])
    emb = embed_block(adapter.embed, ids, drafter.args, drafter.fc.weight.dtype)
    return (
        mx.array(blk["feats"]),
        emb,
        ids[:, 0],
        mx.array(blk["offsets"]),
        mx.array(blk["mask"]),
        mx.array(blk["labels"]),
    )


def evaluate(
    drafter, adapter, data: ShardSet, picks, anchors, vocab_ids=None, batch: int = 8
) -> dict:
    """Teacher-forced acceptance on held-out answers: tau for top-1 drafting (DFlash 1),
    the greedy selector walk (DFlash 2) and the top-K oracle, and per-position accuracy.

    A row counts as accepted while it and every row before it equal the target's token.

    Args:
        drafter, adapter: the drafter and its target. data, picks, anchors: the held-out
            answers and fixed anchors (``data.eval_anchors``). vocab_ids: the draft
            vocabulary to score over, as decoding would (None: the full vocabulary).
    """
    from dflash_mlx.model.draft_vocab import DraftHead

    head = None if vocab_ids is None else DraftHead(adapter, np.asarray(vocab_ids, np.int32))
    a = drafter.args
    nb = anchors.shape[1]
    hits = {"argmax": [], "selector": [], "oracle": []}
    for i in range(0, len(picks), batch):
        blk = build_batch(
            data,
            picks[i : i + batch],
            nb,
            a.block_size,
            a.mask_token_id,
            None,
            a.sliding_window,
            anchors[i : i + batch],
        )
        top1, chosen, cand, labels = _predict(drafter, adapter, head, blk, nb)
        valid = np.array(blk["valid"]) > 0
        for name, ok in (
            ("argmax", top1.astype(mx.int32) == labels),
            ("selector", chosen.astype(mx.int32) == labels),
            ("oracle", (cand == labels[..., None].astype(cand.dtype)).any(-1)),
        ):
            hits[name].append(np.array(ok) & valid)
    out = {}
    for name, parts in hits.items():
        ok = np.concatenate(parts)  # [N, B-1]
        out[f"tau_{name}"] = round(float(1 + np.cumprod(ok, axis=1).sum(1).mean()), 4)
        out[f"pos_{name}"] = [round(float(v), 3) for v in ok.mean(0)]
    return out


def _predict(drafter, adapter, head, blk: dict, nb: int):
    """The drafter's rows on one teacher-forced batch, as target ids.

    Args:
        head: the draft vocabulary's ``DraftHead``, or None (the full vocabulary).
        blk: a ``build_batch`` batch of N = S * nb blocks. nb: blocks per answer.

    Returns:
        (top-1 [N, B-1], the selector walk's choice [N, B-1], the top-K candidates
        [N, B-1, K], labels [N, B-1] int32).
    """
    a = drafter.args
    feats, emb, anchor, offs, mask, labels = to_device(blk, adapter, drafter)
    kv = drafter.context_kv(drafter.project_context(feats), 0)
    kv = [(mx.repeat(k, nb, 0), mx.repeat(v, nb, 0)) for k, v in kv]  # each answer's, per block
    h = drafter(emb, kv, offs, a.block_size, mask)[:, 1:]  # [N, B-1, H]: rows past the anchor
    logits = drafter.logits(h, head or adapter.lm_head).astype(mx.float32)
    U, cand = top_candidates(logits, a.selector_top_k)  # [N, B-1, K]
    top1 = mx.argmax(logits, -1)
    if head is not None:  # indices into the draft vocabulary -> target ids
        cand, top1 = head.to_target(cand), head.to_target(top1)
    sel = drafter.candidate_selector
    path, _ = select_path(
        U,
        cand,
        anchor,
        sel.hidden_projection(h),
        sel.predecessor_codebook,
        sel.successor_codebook,
    )
    chosen = mx.take_along_axis(cand, path[..., None].astype(mx.uint32), -1)[..., 0]
    return top1, chosen, cand, labels
