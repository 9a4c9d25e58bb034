"""Read and write drafter checkpoints in exactly the released format (docs/format.md §2).

The writer is used by tests (tiny random drafters) and by training; the reader is the one
public path every drafter goes through.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten

from ..errors import DFlashError
from . import quantize as qz
from .config import DFLASH1, DFLASH2, DrafterArgs
from .draft_vocab import TENSOR as DRAFT_VOCAB
from .draft_vocab import check_ids
from .drafter import DFlashDrafter


def drafter_config(
    *,
    hidden_size: int,
    vocab_size: int,
    num_target_layers: int,
    target_layer_ids,
    mask_token_id: int,
    block_size: int = 8,
    num_hidden_layers: int = 1,
    intermediate_size: int | None = None,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int | None = None,
    dflash2: bool = True,
    sliding_window: int | None = 2048,
    rope_theta: float = 10000.0,
    rms_norm_eps: float = 1e-6,
    conv_kernel_size: int = 2,
    conv_group_size: int = 16,
    selector_rank: int = 256,
    selector_top_k: int = 16,
    **extra_dflash: Any,
) -> dict[str, Any]:
    """A config.json dict laid out like the released checkpoints.

    Args:
        hidden_size, vocab_size, num_target_layers, target_layer_ids, mask_token_id: must
            fit the target. dflash2: DFlash 2 (conv + selector) or DFlash 1.
        extra_dflash: optional dflash_config keys (output_multiplier, ...).
    """
    dcfg = _dflash_config(
        block_size,
        mask_token_id,
        target_layer_ids,
        (conv_kernel_size, conv_group_size, selector_rank, selector_top_k) if dflash2 else None,
        extra_dflash,
    )
    return {
        "architectures": [DFLASH2 if dflash2 else DFLASH1],
        "model_type": "qwen3",
        "is_causal": False,
        "dtype": "bfloat16",
        "tie_word_embeddings": False,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size or 3 * hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim or hidden_size // num_attention_heads,
        "rms_norm_eps": rms_norm_eps,
        "vocab_size": vocab_size,
        "num_target_layers": num_target_layers,
        "max_position_embeddings": 262144,
        **_attention_window(sliding_window, num_hidden_layers),
        "rope_parameters": {"rope_theta": rope_theta, "rope_type": "default"},
        "dflash_config": dcfg,
    }


def _dflash_config(
    block_size: int,
    mask_token_id: int,
    target_layer_ids,
    dflash2: tuple[int, int, int, int] | None,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """The ``dflash_config`` block; ``dflash2`` is (conv_kernel_size, conv_group_size,
    selector_rank, selector_top_k), None for DFlash 1 (which has no conv and no selector)."""
    dcfg = {
        "block_size": block_size,
        "mask_token_id": mask_token_id,
        "target_layer_ids": list(target_layer_ids),
    }
    if dflash2 is not None:
        keys = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
        dcfg.update(zip(keys, dflash2, strict=True))
    return {**dcfg, **extra}


def _attention_window(sliding_window: int | None, num_layers: int) -> dict[str, Any]:
    """Every layer attends within the sliding window, or (``None``) to the whole context."""
    sliding = sliding_window is not None
    return {
        "layer_types": ["sliding_attention" if sliding else "full_attention"] * num_layers,
        "sliding_window": sliding_window,
        "use_sliding_window": sliding,
    }


def random_drafter(config: dict[str, Any], seed: int = 0, scale: float = 1.0) -> DFlashDrafter:
    """A drafter with random weights, including non-trivial conv and selector tensors.

    Args:
        config: a config.json dict (see ``drafter_config``).
        seed: RNG seed. scale: multiplies the conv / selector perturbations.
    """
    mx.random.seed(seed)
    model = DFlashDrafter(DrafterArgs.from_dict(config))
    params = []
    for name, w in tree_flatten(model.parameters()):
        if name.endswith("base_kernel"):
            w = w + 0.1 * scale * mx.random.normal(w.shape)
        elif "kernel_projection" in name:
            w = 0.05 * scale * mx.random.normal(w.shape)
        elif name.endswith("_codebook"):
            w = 0.5 * scale * mx.random.normal(w.shape)
        elif "norm" in name:
            w = 1.0 + 0.1 * mx.random.normal(w.shape)
        params.append((name, w))
    model.load_weights(params)
    return model


def save_drafter(
    path, model: DFlashDrafter, config: dict[str, Any], draft_vocab=None, quantize: int = 0
) -> Path:
    """Write config.json and model.safetensors (bf16, released tensor names) to path.

    Args:
        path: output directory (created). model: the drafter. config: its config.json dict.
        draft_vocab: sorted target ids the drafter scores (docs/format.md §2.4), written as
            the int32 tensor ``draft_vocab`` with its size in ``dflash_config``; default:
            the drafter's own (``model.draft_vocab``), if any.
        quantize: 4 or 8 writes the attention and MLP projections quantized (format.md
            §2.5: ``.scales`` / ``.biases`` and a ``quantization`` key); 0 keeps a quantized
            model's layers as they are and a dense one dense.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = json.loads(json.dumps(config))
    config.pop("quantization", None)
    if quantize:
        model = _copy(model)
        qz.dequantize(model)
        qz.quantize(model, quantize)
    if qz.is_quantized(model):
        config["quantization"] = _quantization_of(model)
    weights = {
        k: v if v.dtype == mx.uint32 else v.astype(mx.bfloat16)  # packed words stay packed
        for k, v in tree_flatten(model.parameters())
    }
    ids = getattr(model, "draft_vocab", None) if draft_vocab is None else draft_vocab
    config.setdefault("dflash_config", {}).pop("draft_vocab_size", None)
    if ids is not None:
        ids = check_ids(np.asarray(ids), config["vocab_size"], f"drafter {path}")
        weights[DRAFT_VOCAB] = mx.array(ids)
        config["dflash_config"]["draft_vocab_size"] = int(ids.size)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def _copy(model: DFlashDrafter) -> DFlashDrafter:
    """A dense or quantized drafter's twin with the same tensors (quantizing it leaves the
    original alone)."""
    twin = DFlashDrafter(model.args)
    if qz.bits_of(model):
        names = {k for k, _ in tree_flatten(model.parameters())}
        quant = {"quantization": _quantization_of(model)}
        qz.from_checkpoint(twin, quant, names, "in memory")
    twin.load_weights(list(tree_flatten(model.parameters())))
    twin.draft_vocab = getattr(model, "draft_vocab", None)
    return twin


def _quantization_of(model) -> dict[str, int]:
    """The ``quantization`` config entry of a quantized drafter (its first quantized layer)."""
    for _, m in model.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            return {"group_size": int(m.group_size), "bits": int(m.bits)}
    raise ValueError("the drafter has no quantized layer")


def load_drafter(path, dtype: mx.Dtype | None = None, quant: tuple | None = None) -> DFlashDrafter:
    """Load a drafter directory (config.json + *.safetensors), checking every tensor.

    Args:
        path: local directory of the checkpoint.
        dtype: compute dtype to cast the weights to (default: as stored).
        quant: (bits, target): bring the layers to ``load(draft_quant=bits)`` beside the
            mlx-lm ``target`` (``quantize.settle_beside``); None keeps them as stored.

    Raises:
        DFlashError: missing files, unreadable config or tensors, wrong names or shapes.
    """
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise DFlashError(
            f"drafter directory {path} has no config.json; point to a DFlash checkpoint"
        )
    try:
        config = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DFlashError(f"drafter config {cfg_file} is not valid JSON ({e}); re-download it")
    try:
        args = DrafterArgs.from_dict(config)
    except TypeError as e:
        raise DFlashError(f"drafter config {cfg_file} has a bad value ({e}); fix or re-download it")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DFlashError(f"drafter directory {path} has no *.safetensors; re-download the drafter")
    weights = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except (RuntimeError, ValueError) as e:  # what mx.load raises on a corrupt header
            raise DFlashError(f"cannot read {f.name} ({str(e).splitlines()[0]}); re-download it")
    model = DFlashDrafter(args)
    model.draft_vocab = _draft_vocab(weights.pop(DRAFT_VOCAB, None), args, path)
    qz.from_checkpoint(model, config, weights, str(path))
    _check_tensors(model, weights, path)
    dtype = dtype or weights["norm.weight"].dtype  # never quantized
    # Packed quantized words stay uint32; everything else takes the compute dtype.
    model.load_weights(
        [(k, w if w.dtype == mx.uint32 else w.astype(dtype)) for k, w in weights.items()]
    )
    model.fc = qz.dense(model.fc)  # a quantized fc dense again: its dtype is the compute dtype
    if quant is not None:
        qz.settle_beside(model, *quant)
    mx.eval(model.parameters())
    model.eval()
    return model


def _check_tensors(model: DFlashDrafter, weights: dict, path: Path) -> None:
    """Refuse tensors whose names, shapes or (packed) dtypes are not those the config implies."""
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise DFlashError(
            f"drafter {path} tensors do not match its config ({what}); "
            "check architectures/num_hidden_layers (and quantization) in config.json"
        )
    for k, v in expected.items():
        got = weights[k]
        if got.shape != v.shape or (v.dtype == mx.uint32) != (got.dtype == mx.uint32):
            if k.endswith((".scales", ".biases")) or v.dtype == mx.uint32:
                raise DFlashError(
                    f"drafter tensor {k} has shape {tuple(got.shape)} ({got.dtype}), its "
                    f"config's quantization implies {tuple(v.shape)}: the scales do not match "
                    "the weights; fix config.json's quantization or re-convert the drafter"
                )
            raise DFlashError(
                f"drafter tensor {k} has shape {tuple(got.shape)}, config implies "
                f"{tuple(v.shape)}; the checkpoint and config.json disagree"
            )


def _draft_vocab(tensor, args: DrafterArgs, path: Path):
    """The checkpoint's draft vocabulary as numpy int32 ids, checked against its config."""
    size = args.draft_vocab_size
    if tensor is None:
        if size is not None:
            raise DFlashError(
                f"drafter {path} config has dflash_config.draft_vocab_size {size} but no "
                f"{DRAFT_VOCAB} tensor; re-download it or drop that key"
            )
        return None
    ids = check_ids(np.array(tensor), args.vocab_size, f"drafter {path}")
    if size is not None and size != ids.size:
        raise DFlashError(
            f"drafter {path}: {DRAFT_VOCAB} has {ids.size} ids but dflash_config."
            f"draft_vocab_size is {size}; the checkpoint and config.json disagree"
        )
    return ids
