"""A prompt with images, ready for the prefill: its token ids (each image expanded by
mlx-vlm's processor to one id per merged patch), the ids the prompt cache matches on, the
mRoPE positions of every row, and each image's features from the vision tower, computed
only for the rows a prefill actually runs (a cached image is not run again).

The prompt cache compares token lists; at an image's rows it is given ids derived from the
image bytes' SHA-256 (negative, so never a real token): the same image at the same place
matches, another image does not.
"""

from __future__ import annotations

import mlx.core as mx

from ..errors import DFlashError


def image_keys(sha256: str, n: int) -> list[int]:
    """The prompt cache's ids for an image's ``n`` rows: negative int32s from its hash."""
    base = int(sha256[:15], 16)
    return [-1 - (base + j) % (2**31 - 1) for j in range(n)]


class VisionPrompt:
    """One request's images as the prefill needs them.

    Args:
        ids: the prompt's token ids. image_token: the id that stands for an image row.
        pixels: the processor's ``pixel_values`` [rows, C*T*P*P]. grids: ``image_grid_thw``
            [images, 3]. hashes: each image's SHA-256. positions: [3, 1, len(ids)] mRoPE
            positions. delta: what decode rows add to their cache offset.
        merge: the vision tower's spatial merge (patches per row = merge**2).
    """

    def __init__(self, ids, image_token, pixels, grids, hashes, positions, delta, merge):
        self.ids = list(ids)
        self.length = len(self.ids)
        self.positions = positions
        self.delta = int(delta)
        grid = [tuple(int(x) for x in g) for g in grids.tolist()]
        patches = [t * h * w for t, h, w in grid]
        cuts = [sum(patches[:i]) for i in range(1, len(patches))]
        self.pixels = mx.split(pixels, cuts) if cuts else [pixels]
        self.grids = grid
        self.spans = _runs(self.ids, image_token)
        sizes = [p // merge**2 for p in patches]
        if [e - s for s, e in self.spans] != sizes:
            raise ValueError(f"image rows {self.spans} do not match the images' sizes {sizes}")
        self.keys = list(self.ids)
        for (s, e), h in zip(self.spans, hashes):
            self.keys[s:e] = image_keys(h, e - s)
        self.features: dict[int, mx.array] = {}
        self.source: tuple[str, list[bytes]] | None = None  # (text, images' bytes): ``rebuild``
        # evaluated now: a server prepares in its HTTP thread and decodes in another, and a
        # lazy graph holds the stream of the thread that built it (MLX streams are per thread)
        mx.eval(self.pixels, self.positions)

    def check(self, prompt) -> list[int]:
        """``prompt`` when it is these ids (a request passing this prompt's images along).

        Raises:
            DFlashError: other ids.
        """
        if not isinstance(prompt, list) or prompt != self.ids:
            raise DFlashError("images= is the VisionPrompt of another prompt; pass its own ids")
        return prompt

    def rows(self, vlm, start: int, end: int) -> tuple[mx.array, mx.array]:
        """(input embeddings [1, n, H], positions [3, 1, n]) of prompt rows start..end:
        the token embeddings with each image's rows replaced by its features."""
        emb = vlm.language_model.model.embed_tokens(mx.array(self.ids[start:end]))
        hit = [i for i, (s, e) in enumerate(self.spans) if s < end and e > start]
        self._encode(vlm, [i for i in hit if i not in self.features])
        parts, at = [], start
        for i in hit:
            s, e = self.spans[i]
            a, b = max(s, start), min(e, end)
            if at < a:
                parts.append(emb[at - start : a - start])
            parts.append(self.features[i][a - s : b - s].astype(emb.dtype))
            at = b
        if at < end:
            parts.append(emb[at - start :])
        merged = mx.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]
        return merged[None], self.positions[:, :, start:end]

    def _encode(self, vlm, todo: list[int]) -> None:
        """Run the vision tower once over the images in ``todo`` (all of a prompt's images
        in one call when none is cached, as mlx-vlm does)."""
        if not todo:
            return
        tower = vlm.vision_tower
        pixels = mx.concatenate([self.pixels[i] for i in todo], axis=0)
        pixels = pixels.astype(tower.patch_embed.proj.weight.dtype)
        grid = mx.array([self.grids[i] for i in todo])
        out = tower(pixels, grid)
        feats = out[0] if isinstance(out, tuple) else out
        sizes = [self.spans[i][1] - self.spans[i][0] for i in todo]
        cuts = [sum(sizes[:k]) for k in range(1, len(sizes))]
        for i, f in zip(todo, mx.split(feats, cuts) if cuts else [feats]):
            self.features[i] = f


def _runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """The [start, end) runs of ``token`` in ids, in order."""
    out, start = [], None
    for i, t in enumerate(ids + [None]):
        if t == token and start is None:
            start = i
        elif t != token and start is not None:
            out.append((start, i))
            start = None
    return out
