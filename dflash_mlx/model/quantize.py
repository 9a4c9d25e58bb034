"""The drafter's layers quantized with MLX's own affine quantization (docs/format.md §2.5).

At load (``load(draft_quant=...)``), from a pre-quantized checkpoint (mlx-lm's layout: a
``quantization`` config key and ``.scales`` / ``.biases`` tensors), and for writing one
(``dflash convert``, ``save_drafter(quantize=...)``). The drafter only proposes, so a
quantized drafter changes acceptance, never the output (docs/algorithm.md §4).
"""

from __future__ import annotations

import re

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_map_with_path

from ..errors import DFlashError

GROUP_SIZE = 64  # mlx-lm's default for affine quantization
CHECKPOINT_BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
# The layers that hold a drafter's bytes: attention and MLP projections. fc stays dense (its
# dtype is the drafter's compute dtype, and it reads only new context rows); so do the small
# conv and selector projections, whose outputs steer every row.
_QUANTIZED = re.compile(r"^layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)$")


def default_bits(target_quantized: bool, on_gpu: bool) -> int:
    """What ``auto`` means: 4 bits on a GPU beside a quantized target, else none (the CPU
    backend's quantized matmuls are many times slower than its float ones, format.md §2.5)."""
    return 4 if on_gpu and target_quantized else 0


def is_quantized(module: nn.Module) -> bool:
    """Whether any of ``module``'s layers is quantized."""
    return any(isinstance(m, nn.QuantizedLinear) for _, m in module.named_modules())


def bits_of(drafter: nn.Module) -> int:
    """The bits of the drafter's quantized layers, 0 when none is (or it is not a module)."""
    if not isinstance(drafter, nn.Module):
        return 0
    for _, m in drafter.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            return int(m.bits)
    return 0


def quantize(drafter: nn.Module, bits: int, group_size: int = GROUP_SIZE) -> dict | None:
    """Quantize the drafter's attention and MLP projections in place.

    Args:
        drafter: a dense ``DFlashDrafter``. bits: 4 or 8. group_size: columns per scale.

    Returns:
        the ``quantization`` config entry (``{"group_size", "bits"}``), or None when no
        layer's input width is a multiple of ``group_size`` (nothing was quantized).
    """
    hit = []

    def wanted(path: str, m: nn.Module) -> bool:
        ok = isinstance(m, nn.Linear) and bool(_QUANTIZED.match(path))
        ok = ok and m.weight.shape[-1] % group_size == 0
        hit.append(ok)
        return ok

    nn.quantize(drafter, group_size=group_size, bits=bits, class_predicate=wanted)
    mx.eval(drafter.parameters())
    return {"group_size": group_size, "bits": bits} if any(hit) else None


def dequantize(module: nn.Module) -> None:
    """Replace every quantized layer of ``module`` by a dense one holding exactly the values
    the quantized one multiplies by, in its scales' dtype."""

    leaves = module.leaf_modules()
    leaves = tree_map_with_path(lambda _p, m: dense(m), leaves, is_leaf=nn.Module.is_module)
    module.update_modules(leaves)


def dense(m: nn.Module) -> nn.Module:
    """A quantized layer as a dense ``nn.Linear`` with exactly its values; others as they are."""
    if not isinstance(m, nn.QuantizedLinear):
        return m
    w = mx.dequantize(m["weight"], m["scales"], m.get("biases"), m.group_size, m.bits)
    out = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
    out.weight = w.astype(m["scales"].dtype)  # [out, in]
    if "bias" in m:
        out.bias = m["bias"]
    return out


def from_checkpoint(drafter: nn.Module, config: dict, weights: dict, where: str) -> None:
    """Make the layers a pre-quantized checkpoint stores quantized (those with ``.scales``)
    quantized modules, with its ``quantization`` config, before its tensors are loaded.

    Args:
        drafter: the fresh drafter. config: its config.json. weights: its tensors.
        where: the checkpoint, for messages.

    Raises:
        DFlashError: ``.scales`` without a ``quantization`` key, or a bad one.
    """
    quant = config.get("quantization")
    has_scales = any(k.endswith(".scales") for k in weights)
    if quant is None:
        if has_scales:
            raise DFlashError(
                f"drafter {where} has .scales tensors but its config.json has no "
                '"quantization" key; add {"group_size": G, "bits": B} as written, or re-convert it'
            )
        return
    gs, bits = _check_quant(quant, where)
    nn.quantize(
        drafter,
        group_size=gs,
        bits=bits,
        class_predicate=lambda p, m: isinstance(m, nn.Linear) and f"{p}.scales" in weights,
    )


def _check_quant(quant, where: str) -> tuple[int, int]:
    """(group_size, bits) of a config's ``quantization`` entry, checked."""
    ok = isinstance(quant, dict) and quant.get("mode", "affine") == "affine"
    gs, bits = (quant.get("group_size"), quant.get("bits")) if ok else (None, None)
    if gs not in GROUP_SIZES or bits not in CHECKPOINT_BITS:
        raise DFlashError(
            f"drafter {where} config.json quantization {quant!r} is not MLX affine "
            f"quantization (group_size in {GROUP_SIZES}, bits in {CHECKPOINT_BITS}); "
            "re-convert it with dflash convert"
        )
    return gs, bits


def settle(drafter: nn.Module, bits: int | None, target_quantized: bool, on_gpu: bool) -> int:
    """Bring a loaded drafter to the quantization asked for (``fc`` stays dense: its dtype
    is the drafter's compute dtype).

    Args:
        drafter: the loaded drafter (dense or pre-quantized). bits: None (auto), 0, 4 or 8.
        target_quantized: whether the target's layers are quantized. on_gpu: MLX's device.

    Returns:
        the bits the drafter's layers now hold (0: dense).
    """
    have = bits_of(drafter)
    want = (have or default_bits(target_quantized, on_gpu)) if bits is None else bits
    if bits is None and have and not on_gpu:  # a pre-quantized checkpoint on the CPU
        want = 0  # the same values, dense: faster there
    if want == have:
        return have
    if have:
        dequantize(drafter)
    if want:
        quantize(drafter, want)
    return bits_of(drafter)


def settle_beside(drafter: nn.Module, bits: int | None, target: nn.Module) -> int:
    """``settle`` for a drafter loaded beside ``target`` on MLX's default device.

    Args:
        drafter: the loaded drafter. bits: None (auto), 0, 4 or 8. target: the mlx-lm model.

    Returns:
        the bits the drafter's layers now hold (0: dense).
    """
    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    quantized = any(
        isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        for _, m in target.named_modules()
    )
    return settle(drafter, bits, quantized, on_gpu)
