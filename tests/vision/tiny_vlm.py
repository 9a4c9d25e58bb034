"""A tiny random qwen3_5 vision-language checkpoint built with mlx-vlm's own classes, saved
as a real one is (config.json with ``vision_config``, safetensors, tokenizer, processor
config), and its DFlash 2 drafter: everything the vision tests and the CLI/server image
tests load offline on the CPU.

``tiny_vlm(root)`` -> (target dir, drafter dir); ``tiny_image(seed)`` -> PNG bytes.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

from tiny_models import CORPUS, SPECIALS, build_drafter, target_config, train_tokenizer

# The Qwen-VL specials after the tiny pairs' own (ids 4..7): the processor finds them by name.
VISION_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE_TOKEN = SPECIALS.__len__() + 2  # <|image_pad|>'s id
# Qwen's chat template, cut down: a content list's {"type": "image"} parts become the
# vision block the processor expands to one <|image_pad|> per merged patch.
VLM_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PATCH, MERGE = 16, 2  # an image's side in pixels / 32 = its merged patches per side


def _tokenizer(path: Path, patch: int = PATCH) -> int:
    """The tiny pairs' BPE with the vision specials; writes tokenizer files, returns V."""
    tok = train_tokenizer([CORPUS], 320, SPECIALS + VISION_SPECIALS)
    tok.save(str(path / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": VLM_TEMPLATE,
        "model_max_length": 4096,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (path / "chat_template.jinja").write_text(VLM_TEMPLATE)
    pre = {
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "processor_class": "Qwen3VLProcessor",
        "patch_size": patch,
        "temporal_patch_size": 2,
        "merge_size": MERGE,
        "min_pixels": 32 * 32,
        "max_pixels": 128 * 128,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    (path / "preprocessor_config.json").write_text(json.dumps(pre))
    return tok.get_vocab_size()


def vlm_config(vocab_size: int, hidden: int = 64, layers: int = 4) -> dict:
    """config.json of the tiny qwen3_5 VLM: the tiny qwen3_5 text model with mRoPE
    sections, a one-block vision tower of width 32 with 16-pixel patches."""
    text = target_config("qwen3_5", vocab_size, hidden, layers)
    # head_dim 16 x partial_rotary_factor 0.5 = 8 rotated dims: 4 frequencies (t, h, w)
    text["rope_parameters"]["mrope_section"] = [2, 1, 1]
    ids = {t: SPECIALS.__len__() + i for i, t in enumerate(VISION_SPECIALS)}
    vision = {
        "model_type": "qwen3_5",
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "out_hidden_size": hidden,
        "num_heads": 2,
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": 2,
        "num_position_embeddings": 64,
        "in_channels": 3,
    }
    return {
        "model_type": "qwen3_5",
        "text_config": text,
        "vision_config": vision,
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vocab_size": vocab_size,
        "eos_token_id": 3,
        "tie_word_embeddings": False,
    }


def dense_config(vocab_size: int, hidden: int = 64, layers: int = 4) -> dict:
    """config.json of a tiny qwen2_5_vl VLM (dense attention, mRoPE): 14-pixel patches."""
    ids = {t: SPECIALS.__len__() + i for i, t in enumerate(VISION_SPECIALS)}
    text = target_config("qwen3", vocab_size, hidden, layers)
    text = {k: v for k, v in text.items() if k not in ("model_type", "head_dim")}
    vision = {
        "model_type": "qwen2_5_vl",
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "out_hidden_size": hidden,
        "num_heads": 2,
        "patch_size": 14,
        "spatial_patch_size": 14,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": 2,
        "window_size": 56,
        "fullatt_block_indexes": [0],
        "in_channels": 3,
    }
    return {
        **text,
        "model_type": "qwen2_5_vl",
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [4, 2, 2]},  # head_dim 16
        "vision_config": vision,
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "eos_token_id": 3,
    }


def build_vlm(path: Path, seed: int = 0, kind: str = "qwen3_5") -> Path:
    """Write a tiny random float32 VLM (mlx-vlm's classes) to path: ``qwen3_5`` (hybrid)
    or ``qwen2_5_vl`` (dense)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models import qwen2_5_vl, qwen3_5

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dense = kind == "qwen2_5_vl"
    V = _tokenizer(path, 14 if dense else PATCH)
    cfg = dense_config(V) if dense else vlm_config(V)
    mx.random.seed(seed)
    family = qwen2_5_vl if dense else qwen3_5
    mcfg = family.ModelConfig.from_dict(dict(cfg))
    for name, cls in (("vision_config", family.VisionConfig), ("text_config", family.TextConfig)):
        if isinstance(getattr(mcfg, name), dict):  # as mlx-vlm's load_model does
            setattr(mcfg, name, cls.from_dict(getattr(mcfg, name)))
    model = family.Model(mcfg)
    weights = dict(tree_flatten(model.parameters()))
    # as a Hub checkpoint stores them: mlx-vlm's sanitize maps these names back
    # (its norms are stored as offsets from 1, the conv1d as [C, 1, K] is kept as is)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def tiny_vlm(root: Path, seed: int = 0, kind: str = "qwen3_5") -> tuple[Path, Path]:
    """(target dir, drafter dir): the tiny VLM of ``kind`` and a tiny DFlash 2 drafter
    (block 8) for its language model, both under root; built once per root."""
    root = Path(root)
    target, drafter = root / kind, root / f"{kind}_drafter"
    if not (drafter / "config.json").exists():
        build_vlm(target, seed, kind)
        cfg = json.loads((target / "config.json").read_text())
        text = cfg.get("text_config", cfg)
        (root / f"{kind}_text").mkdir(parents=True, exist_ok=True)
        (root / f"{kind}_text" / "config.json").write_text(json.dumps(text))
        build_drafter(drafter, root / f"{kind}_text", dflash2=True, block_size=8, seed=seed + 1)
    return target, drafter


def tiny_image(seed: int = 0, size: tuple[int, int] = (64, 64), fmt: str = "PNG") -> bytes:
    """A random RGB image's encoded bytes (64x64: 4 merged patches, 4 image tokens)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()
