"""The memory plan of one rank of a group (docs/distributed.md, "Plans"): that rank's shard
of the target, its share of the KV cache and the whole drafter, which every rank keeps.

- ``tensor``: each rank keeps 1/N of every attention and MLP projection and all of the
  embeddings, the head and the norms; the KV heads split over the ranks, so does the cache.
- ``pipeline``: each rank keeps its own layers (an even split, the first ranks taking one
  more when it is uneven) and their caches; the embeddings and the head are counted on every
  rank, as mlx-lm keeps them there.

Estimates from the config, like the plan itself; the split of the target's bytes between
its layers and its embeddings is in parameters (the layers' counted as a dense model's, so
a mixture of experts' shard is over- rather than under-estimated).
"""

from __future__ import annotations

from dataclasses import replace

from .footprint import config_int, target_size, text_config

MODES = ("tensor", "pipeline")


def embedding_share(cfg: dict) -> float:
    """The share of the target's parameters in its embeddings and head (0..1)."""
    cfg = text_config(cfg)
    H, V = config_int(cfg, "hidden_size"), config_int(cfg, "vocab_size")
    heads = config_int(cfg, "num_attention_heads", 1)
    kv, hd = config_int(cfg, "num_key_value_heads", heads), config_int(cfg, "head_dim", H // heads)
    inter, n = config_int(cfg, "intermediate_size", 4 * H), config_int(cfg, "num_hidden_layers")
    layers = n * (H * (2 * heads * hd + 2 * kv * hd) + 3 * H * inter)
    whole = V * H * (1 if cfg.get("tie_word_embeddings") else 2)
    return whole / max(whole + layers, 1)


def layers_of(n_layers: int, size: int, rank: int) -> int:
    """How many of ``n_layers`` rank ``rank`` of ``size`` holds under pipeline parallelism."""
    return n_layers // size + (1 if rank < n_layers % size else 0)


def per_rank(plan, cfg: dict, shard=None):
    """``plan`` as one rank holds it.

    Args:
        plan: ``memory.Plan`` of the whole pair. cfg: the target's config.
        shard: (size, rank, mode) with mode in ``MODES``; None or size 1: ``plan`` as is.

    Returns:
        a ``memory.Plan`` with that rank's target bytes and KV share, the drafter whole.
    """
    if shard is None or shard[0] <= 1:
        return plan
    size, rank, mode = shard
    whole = int(plan.target * embedding_share(cfg))
    layers = plan.target - whole
    if mode == "tensor":
        mine, kv = whole + layers // size, plan.kv // size
    else:
        n = max(config_int(text_config(cfg), "num_hidden_layers"), 1)
        part = layers_of(n, size, rank) / n
        mine, kv = whole + int(layers * part), int(plan.kv * part)
    note = f"{plan.context_note}; rank {rank} of {size}, {mode} shard"
    extra = plan.load_extra * mine // max(plan.target, 1)
    return replace(plan, target=mine, kv=kv, load_extra=extra, context_note=note)


def for_rank(plan, target, shard=None):
    """``plan`` of the pair whose target is at ``target`` (a path or ``footprint.Remote``)
    as one rank holds it (:func:`per_rank`); ``plan`` itself for one process."""
    if shard is None or shard[0] <= 1:
        return plan
    return per_rank(plan, target_size(target, cpu=False)[1], shard)
