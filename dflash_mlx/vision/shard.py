"""A vision-language target across ranks (docs/distributed.md, "Vision-language targets"):
mlx-vlm's qwen3_5 language model split by tensor parallelism the way mlx-lm's
``qwen3_5.Model.shard`` splits the text model, the vision tower replicated on every rank.

mlx-vlm's language model has no ``shard`` of its own, and mlx-lm's cannot be lent to it:
mlx-lm's Gated DeltaNet and MLP forwards add their own ``all_sum`` after a projection
sliced in place, which mlx-vlm's forwards do not. So every projection that ends a block
becomes MLX's ``ShardedToAllLinear`` here (its ``all_sum`` inside), and the forwards stay
mlx-vlm's. Each rank runs the vision tower on the same image bytes: the bytes cross the
link (once, where they cross it at all), never the features, which are larger.
"""

from __future__ import annotations

from ..errors import DFlashError

FAMILIES = {"qwen3_5"}  # mlx-vlm families split here


def shard(target, group) -> None:
    """Split ``target``'s language model over ``group`` in place (tensor parallelism).

    Args:
        target: a ``vision.target.VisionTarget``. group: the ``mx.distributed.Group``.

    Raises:
        DFlashError: another family, or heads that do not split over the ranks.
    """
    if target.model_type not in FAMILIES:
        raise DFlashError(
            f"a {target.model_type} vision-language target does not run under mlx.launch "
            f"yet (across ranks: {', '.join(sorted(FAMILIES))}); run it in one process"
        )
    n = group.size()
    for layer in target.language_model.model.layers:
        mixer = layer.linear_attn if layer.is_linear else layer.self_attn
        _check(mixer, n)
    for layer in target.language_model.model.layers:
        if layer.is_linear:
            _delta_net(layer.linear_attn, group)
        else:
            _attention(layer.self_attn, group)
        _mlp(layer.mlp, group)


HEADS = {  # a mixer's head counts, as the refusal names them
    "num_attention_heads": "query",
    "num_key_value_heads": "key/value",
    "num_k_heads": "DeltaNet key",
    "num_v_heads": "DeltaNet value",
}


def _check(mixer, n: int) -> None:
    heads = {name: getattr(mixer, a) for a, name in HEADS.items() if hasattr(mixer, a)}
    if any(h % n for h in heads.values()):
        said = ", ".join(f"{h} {name}" for name, h in heads.items())
        raise DFlashError(
            f"this vision-language target's heads ({said}) do not split over {n} "
            "processes; launch a number of processes that divides them"
        )


def _attention(attn, group) -> None:
    """Query, key and value projections split by heads; the output projection sums."""
    from mlx.nn.layers.distributed import shard_linear

    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attn, name, shard_linear(getattr(attn, name), "all-to-sharded", group=group))
    attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
    attn.num_attention_heads //= group.size()
    attn.num_key_value_heads //= group.size()


def _delta_net(net, group) -> None:
    """A Gated DeltaNet split by heads: its q / k / v input projection and convolution in
    three segments each, the gates and decay by heads, the output projection sums."""
    import mlx.core as mx
    from mlx.nn.layers.distributed import shard_inplace, shard_linear

    n, r, kd = group.size(), group.rank(), net.key_dim
    # conv1d weight [channels, kernel, 1]: channels are q (kd), k (kd), v, each split alike
    shard_inplace(net.conv1d, lambda path, w: (0, [kd, 2 * kd]), group=group)
    net.conv1d.groups //= n
    shard_inplace(net.in_proj_qkv, "all-to-sharded", segments=[kd, 2 * kd], group=group)
    for name in ("in_proj_z", "in_proj_b", "in_proj_a"):
        shard_inplace(getattr(net, name), "all-to-sharded", group=group)
    net.dt_bias = mx.contiguous(mx.split(net.dt_bias, n)[r])
    net.A_log = mx.contiguous(mx.split(net.A_log, n)[r])
    net.out_proj = shard_linear(net.out_proj, "sharded-to-all", group=group)
    for name in ("num_k_heads", "num_v_heads", "key_dim", "value_dim", "conv_dim"):
        setattr(net, name, getattr(net, name) // n)


def _mlp(mlp, group) -> None:
    from mlx.nn.layers.distributed import shard_linear

    if not all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj")):
        raise DFlashError(
            "a mixture-of-experts vision-language target does not run under mlx.launch yet; "
            "run it in one process"
        )
    mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=group)
    mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=group)
    mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)
