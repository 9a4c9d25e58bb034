"""Loading a vision-language checkpoint through mlx-vlm (the ``[vision]`` extra): its model
and processor, an mlx-lm tokenizer over the same files, and the target the adapter wraps.

Nothing here imports mlx-vlm until ``load_vlm`` runs: a text-only pair never imports it.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import LOAD_ERRORS, DFlashError, load_failed

# mlx-vlm model types whose language model the adapter has been checked against (taps,
# rollback, mRoPE positions given per forward): qwen3_5 (hybrid: Gated DeltaNet layers) and
# qwen2_5_vl (dense attention)
SUPPORTED = {"qwen3_5", "qwen2_5_vl"}
INSTALL = "this is a vision-language model; pip install 'dflash-mlx[vision]'"


def is_vlm(params: dict) -> bool:
    """Whether a config.json describes a vision-language checkpoint (it has a vision tower)."""
    return isinstance(params.get("vision_config"), dict)


def require() -> None:
    """Import mlx-vlm, or fail with the one line that says what to install."""
    try:
        import mlx_vlm  # noqa: F401
    except ImportError:
        raise DFlashError(INSTALL) from None


def load_vlm(path: Path, params: dict, tokenizer_config: dict | None = None, grouped=False):
    """(``VisionTarget``, mlx-lm tokenizer) of the checkpoint in ``path``.

    Args:
        path: the checkpoint directory. params: its config.json.
        tokenizer_config: extra settings for the tokenizer. grouped: loading under a
            group of ranks (``mlx.launch``): no weight is read until the language model
            is split (``vision.shard``), so each rank reads only its share.

    Raises:
        DFlashError: mlx-vlm missing, a family not supported yet, a checkpoint mlx-vlm
            cannot load.
    """
    require()
    mtype = params.get("model_type")
    if mtype not in SUPPORTED:
        raise DFlashError(
            f"vision-language family '{mtype}' is not supported by dflash-mlx yet "
            f"(supported: {', '.join(sorted(SUPPORTED))}); run it with mlx_vlm instead"
        )
    from mlx_lm.utils import load_tokenizer
    from mlx_vlm.models.cache import ArraysCache
    from mlx_vlm.utils import load_model, load_processor

    from ..model.recurrent import add_recurrent
    from .target import VisionTarget

    try:
        vlm = load_model(path, lazy=grouped)
        processor = load_processor(path, add_detokenizer=False)
    except LOAD_ERRORS as e:
        raise load_failed(e, f"vision-language model {path}", "mlx-vlm") from None
    add_recurrent(ArraysCache)  # mlx-vlm's recurrent layers' caches
    eos = params.get("eos_token_id")
    tokenizer = load_tokenizer(path, tokenizer_config or {}, eos_token_ids=eos)
    return VisionTarget(vlm, processor, mtype), tokenizer
