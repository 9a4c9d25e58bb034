"""The tiny VLM is a checkpoint mlx-vlm itself loads and runs offline."""

from __future__ import annotations

import io


def test_mlx_vlm_loads_the_tiny_vlm_and_expands_an_image(tiny_vlm_dir, images):
    from mlx_vlm.utils import load
    from PIL import Image
    from tiny_vlm import IMAGE_TOKEN

    _model, processor = load(str(tiny_vlm_dir[0]))
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    text = processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    out = processor(images=[Image.open(io.BytesIO(images[0]))], text=[text])
    assert out["input_ids"].tolist()[0].count(IMAGE_TOKEN) == 4  # 64x64 px: 2x2 merged
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]]
