"""One rank of the vision-language test (run by ``mlx.launch``): the tiny qwen3_5 VLM with
its language model split over the launched group (``vision.shard``), the vision tower on
every rank, greedy DFlash (block 4) on a prompt with an image; written as JSON with the
query heads this rank keeps."""

import json
import sys
from pathlib import Path

import dflash_mlx  # noqa: F401 - before MLX: it preloads the system OpenBLAS (Linux)

# isort: split
import mlx.core as mx

sys.path[:0] = [str(Path(__file__).parents[1]), str(Path(__file__).parents[1] / "vision")]
from tiny_vlm import tiny_image

from dflash_mlx import load, stream_generate

MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]


def decode(model, tok, block) -> list[int]:
    """Greedy DFlash tokens of the prompt with one image."""
    got = []
    kw = {"max_tokens": 16, "block_size": block, "temperature": 0.0}
    for r in stream_generate(model, tok, MESSAGES, images=[tiny_image(0)], **kw):
        got += r.tokens
    return got


if __name__ == "__main__":
    out, target, drafter = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    group = mx.distributed.init()
    model, tok = load(target, drafter=drafter)
    layers = model.target.language_model.model.layers
    heads = next(x.self_attn.num_attention_heads for x in layers if not x.is_linear)
    got = {"heads": heads, "tokens": decode(model, tok, 4)}
    (out / f"vlm{group.rank()}.json").write_text(json.dumps(got))
