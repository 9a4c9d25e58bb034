"""What a request on a vision-language target runs without, said in its stats (never
silently): trees (§4.5), a batch (its requests decode one at a time), and on ``qwen3_5`` the
DeltaNet tape (a rollback replays the mixer). One line each, in ``GenerationResponse.notes``,
the server's ``dflash.notes`` and ``dflash run``'s stats (docs/algorithm.md §9).

Asking for ``tree`` on a vision-language target is noted, not refused: ``tree`` is on by
default, and verifying the path alone changes no token, only the speed.
"""

from __future__ import annotations


def vision_language(model) -> bool:
    """Whether the pair's target is a vision-language model (``target.VisionTarget``)."""
    return bool(getattr(model.target, "vision_language", False))


def fallbacks(model, cfg) -> list[str]:
    """The notes of one request: empty on a text-only target.

    Args:
        model: the loaded pair. cfg: the request's validated settings.
    """
    if not vision_language(model):
        return []
    family, out = model.target.model_type, []
    if cfg.tree and not model.adapter.tree_ok:
        out.append(
            f"tree off: a vision-language target ({family}) verifies the drafter's path "
            "alone (the same tokens; trees need a plain rotary attention-only target)"
        )
    if getattr(model.adapter, "replays", False):
        out.append(
            f"rollback replays: {family}'s Gated DeltaNet layers (mlx-vlm's) are re-run on "
            "the kept rows after a partial acceptance; the tape does not know them"
        )
    return out


def batch_note(model, asked: int) -> str | None:
    """The note of a batch that decodes one request at a time: ``asked`` rows > 1 on a
    vision-language target (its caches carry one request's images), else None."""
    if asked <= 1 or not vision_language(model):
        return None
    return (
        f"batch off: a vision-language target decodes its requests one at a time "
        f"(max_batch {asked} asked)"
    )
