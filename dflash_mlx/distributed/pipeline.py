"""Pipeline parallelism (docs/distributed.md): each rank runs one stage of the target's
layers with mlx-lm's own ``model.model.pipeline``, and the stages' taps reach every rank.

mlx-lm gives each rank a contiguous run of the layers (rank 0 the last ones); its forward
passes the hidden states stage to stage (``send`` / ``recv_like``) and ends in an
``all_gather`` that hands every rank the last stage's rows, so every rank computes the same
logits. What mlx-lm does not do, and the drafter needs, is the outputs of the tapped
layers, which live on their stages: ``TapShare`` adds each rank's own taps (zeros for the
others') with one ``all_sum`` per forward, so every rank drafts from the same features.

Also here: the choice between tensor and pipeline parallelism for a family (``mode``).
"""

from __future__ import annotations

from ..errors import DFlashError

MODES = ("tensor", "pipeline")


def check_mode(wanted) -> None:
    """Refuse anything but None, "tensor" or "pipeline", in one line.

    Args:
        wanted: the ``shard`` asked for (None: the family's default).
    """
    if wanted is not None and wanted not in MODES:
        raise DFlashError(f"--shard must be tensor or pipeline (got {wanted!r})")


def stack(target):
    """The module holding the decoder layers (unwraps multimodal wrappers such as qwen3_5's)."""
    return getattr(getattr(target, "language_model", target), "model", None)


def mode(target, wanted, n: int) -> str:
    """The parallelism for this target: ``wanted``, else tensor where mlx-lm has
    ``Model.shard`` for its family, else pipeline where it has ``model.model.pipeline``.

    Args:
        target: the mlx-lm model. wanted: "tensor", "pipeline" or None. n: the processes.

    Raises:
        DFlashError: mlx-lm has neither for the family, or not the one asked for.
    """
    check_mode(wanted)
    kind = getattr(getattr(target, "args", None), "model_type", type(target).__module__)
    has = {"tensor": hasattr(target, "shard"), "pipeline": hasattr(stack(target), "pipeline")}
    if not any(has.values()):
        raise DFlashError(
            f"mlx-lm has no tensor parallelism for '{kind}' targets and no pipeline "
            f"parallelism either, so it cannot be sharded over {n} processes; run it in one "
            "process, or use a llama / qwen2 / qwen3 (tensor) or qwen2 / qwen3_5 / qwen3_moe "
            "(pipeline) target"
        )
    if wanted is not None and not has[wanted]:
        other = "pipeline" if wanted == "tensor" else "tensor"
        raise DFlashError(
            f"mlx-lm has no {wanted} parallelism for '{kind}' targets; use --shard {other} "
            f"(shard='{other}'), or run it in one process"
        )
    return wanted or ("tensor" if has["tensor"] else "pipeline")


def split(target, group) -> range:
    """Give this rank its stage of the target's layers, in place (mlx-lm's ``pipeline``),
    before any wrapper of ours; returns the layers it runs.

    The layer list keeps every number: None where another stage runs the layer (mlx-lm
    leaves None before this stage; the list is padded after it too, so the adapter sees
    the target's true depth and which layers are its own).

    Args:
        target: the mlx-lm model, loaded lazily (nothing read yet). group: the ranks.

    Raises:
        DFlashError: fewer layers than ranks.
    """
    inner = stack(target)
    total, n = len(inner.layers), group.size()
    if total < n:
        raise DFlashError(
            f"this target has {total} layers, too few to pipeline over {n} processes; "
            f"launch at most {total}, or use --shard tensor"
        )
    inner.pipeline(group)
    inner.layers.extend([None] * (total - len(inner.layers)))
    return range(inner.start_idx, inner.end_idx)


class TapShare:
    """The adapter's ``share`` hook under pipeline parallelism: each rank puts the outputs
    of its own tapped layers in their slots, zeros in the others', and one ``all_sum``
    leaves every rank all of them. Each slot has exactly one nonzero term, so the sum is
    the stage's rows bit for bit, on every rank.

    Args:
        group: the pipeline's ranks. hidden: the residual width. dtype: the hidden dtype.
    """

    def __init__(self, group, hidden: int, dtype):
        self.group, self.hidden, self.dtype = group, hidden, dtype

    def __call__(self, store: dict, layer_ids: list[int], rows: tuple[int, int], logits):
        """Features [batch, tokens, len(layer_ids) * hidden] for this forward.

        Args:
            store: the taps this rank recorded, by layer. layer_ids: the tapped layers.
            rows: the forward's (batch, tokens). logits: this forward's logits: the sum is made to wait for them, so that on
                every rank it comes after the stages' own send / recv / all_gather (the
                collectives must be issued in the same order on each rank).
        """
        import mlx.core as mx

        parts = [
            store[i] if i in store else mx.zeros((*rows, self.hidden), self.dtype)
            for i in layer_ids
        ]
        own = mx.depends(mx.concatenate(parts, axis=-1), logits)
        return mx.distributed.all_sum(own, group=self.group)


def connect(adapter, group) -> None:
    """Make the adapter of one stage act as one target: the taps of the other stages reach
    it (``TapShare``), and what the decode loop decides from the layers (hybrid rollback,
    tree verifies) is agreed by all ranks, not judged by each from its own layers.

    Args:
        adapter: this rank's ``TargetAdapter``. group: the pipeline's ranks.
    """
    import mlx.core as mx

    from .link import agreed_sum

    emb = adapter.embed(mx.array([[0]]))
    adapter.share = TapShare(group, emb.shape[-1], emb.dtype)
    votes = mx.array([adapter.is_hybrid, not adapter.tree_ok], mx.int32)
    hybrid, no_tree = agreed_sum(votes, group).tolist()
    # A rank whose stage holds no recurrent layer still snapshots like the others: the
    # decode loop then takes the same path on every rank.
    adapter.is_hybrid, adapter.tree_ok = hybrid > 0, adapter.tree_ok and no_tree == 0
