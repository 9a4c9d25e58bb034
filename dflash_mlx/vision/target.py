"""A vision-language checkpoint (mlx-vlm's model: vision tower + language model) as the
target adapter sees an mlx-lm model: ``VisionTarget(ids, cache)`` runs mlx-vlm's language
model and returns logits, with mRoPE positions from the request's prompt (``prompt.py``).

mlx-vlm's language model keeps the positions of its last prompt on itself; a pair serves
many requests in turn, so positions are never left to it: every forward is given them.
Prompt rows take the positions mlx-vlm's ``get_rope_index`` gave the whole prompt (image
rows share theirs along time, height and width) and, where images are, their features in
place of the token embeddings; every row after the prompt (a verify block, a plain step)
is at ``cache offset + rope delta``, as mlx-vlm's own decoding computes it. A rollback
trims the caches, so the offset and with it the positions follow.
"""

from __future__ import annotations

import mlx.core as mx
from mlx import nn


class VisionCaches(list):
    """The target's layer caches of one conversation, knowing the request whose prompt
    they are being filled with (``vision``: a ``prompt.VisionPrompt``, or None for a prompt
    without images: positions are then the plain ones, delta 0)."""

    vision = None


class VisionTarget(nn.Module):
    """mlx-vlm's model wrapped for ``TargetAdapter``: ``language_model`` holds the layers,
    embeddings and head the adapter taps and borrows; calling it runs the language model.

    Args:
        vlm: the mlx-vlm model. processor: its processor (images and chat template).
        model_type: config.json's.
    """

    vision_language = True  # what batching and the engine's entry ask a target

    def __init__(self, vlm: nn.Module, processor, model_type: str):
        super().__init__()
        self.vlm = vlm
        self.processor = processor
        self.model_type = model_type
        self.args = vlm.language_model.args
        # a full-attention layer, whose cache offset counts the rows run (qwen3_5's first
        # layers are recurrent; a dense family's are all attention)
        self._fa = getattr(vlm.language_model.model, "fa_idx", 0)

    @property
    def language_model(self) -> nn.Module:
        """mlx-vlm's language model (layers, embeddings, head)."""
        return self.vlm.language_model

    def make_cache(self) -> VisionCaches:
        """mlx-vlm's caches for the language model, as one conversation's list."""
        from mlx_vlm.models.cache import make_prompt_cache

        return VisionCaches(make_prompt_cache(self.language_model))

    def prepare(self, cache: VisionCaches, vision) -> None:
        """Bind the request whose prompt the next forwards run (None: no images)."""
        cache.vision = vision

    def __call__(self, ids: mx.array, cache=None) -> mx.array:
        """Logits [1, n, V] of ids [1, n] after what ``cache`` holds."""
        n = ids.shape[1]
        offset = cache[self._fa].offset if cache is not None else 0
        vision = getattr(cache, "vision", None)
        embeds = None
        if vision is not None and offset < vision.length:  # prompt rows
            embeds, pos = vision.rows(self.vlm, offset, offset + n)
        else:
            delta = 0 if vision is None else vision.delta
            pos = mx.arange(offset + delta, offset + delta + n, dtype=mx.int32)
            pos = mx.broadcast_to(pos[None, None], (3, 1, n))
        out = self.language_model(ids, inputs_embeds=embeds, cache=cache, position_ids=pos)
        return out.logits
