"""mlx-vlm's own decoding of the tiny VLM: the reference the engine must equal."""

from __future__ import annotations

import io

_loaded: dict = {}


def vlm(path):
    """mlx-vlm's (model, processor) of the checkpoint at path, loaded once."""
    from mlx_vlm.utils import load

    key = str(path)
    if key not in _loaded:
        _loaded[key] = load(key)
    return _loaded[key]


def inputs(path, messages, images):
    """mlx-vlm's processor output for chat messages and image bytes (its own template)."""
    from PIL import Image

    _, proc = vlm(path)
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    return proc(images=pil or None, text=[text])


def greedy(path, messages, images, max_tokens: int) -> list[int]:
    """Plain greedy decoding through mlx-vlm's ``generate_step`` (EOS included)."""
    from mlx_vlm.generate.ar import generate_step

    model, _ = vlm(path)
    x = inputs(path, messages, images)
    kw = {"image_grid_thw": x["image_grid_thw"]} if images else {}
    steps = generate_step(
        x["input_ids"],
        model,
        x.get("pixel_values"),
        x["attention_mask"],
        max_tokens=max_tokens,
        temperature=0.0,
        **kw,
    )
    return [int(t) for t, _ in steps]


def next_logits(path, messages, images, prefix: list[int]):
    """Logits [1, V] of the token after the prompt and ``prefix``, from one full forward
    of mlx-vlm's model (its embeddings, merge and mRoPE positions)."""
    import mlx.core as mx

    model, _ = vlm(path)
    x = inputs(path, messages, images)
    ids = mx.concatenate([x["input_ids"], mx.array([prefix], x["input_ids"].dtype)], axis=1)
    emb = model.get_input_embeddings(ids, x["pixel_values"], image_grid_thw=x["image_grid_thw"])
    out = model.language_model(ids, inputs_embeds=emb.inputs_embeds, position_ids=emb.position_ids)
    return out.logits[:, -1].astype(mx.float32)
