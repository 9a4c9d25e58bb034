"""What rank 0's commands carry (``follow.py``): a request's settings as JSON fields, its
logits processors as recipes every rank rebuilds, its images as their files' bytes."""

from __future__ import annotations

import base64
from dataclasses import asdict, replace

from ..errors import DFlashError


def config_dict(cfg) -> dict:
    """A ``GenerationConfig`` as JSON-able fields (``logit_bias`` keys become text)."""
    return asdict(cfg)


def config_of(fields: dict):
    """The ``GenerationConfig`` of ``config_dict``'s fields."""
    from ..settings import GenerationConfig

    bias = fields.get("logit_bias")
    if bias is not None:
        fields = {**fields, "logit_bias": {int(k): v for k, v in bias.items()}}
    return GenerationConfig(**fields)


def seeded(cfg, seed: int):
    """``cfg`` with ``seed`` unless it has one: without, each rank would read its own clock
    for the sampling keys, and their decisions would part."""
    return cfg if cfg.seed is not None else replace(cfg, seed=seed % 2**31)


def recipe(proc) -> dict:
    """What another rank rebuilds a logits processor from (``rebuilt``): a grammar's text,
    its vocabulary and end ids; a thinking gate's markers, budget and inner grammar. Every
    rank then masks the same rows alike (each sees the same tokens and logits), so nothing
    is sent per cycle: a request's few KB once, against a vocabulary-wide mask per verify
    row (and a round trip per cycle) if rank 0 sent its masks.

    Raises:
        DFlashError: a processor of another kind (it cannot be sent).
    """
    from ..decoding.grammar import GrammarProcessor
    from ..decoding.thinking import ThinkingGate

    if isinstance(proc, ThinkingGate):
        inner = None if proc.inner is None else recipe(proc.inner)
        gate = [proc.open_id, proc.close_id, bool(proc.started_open), proc.budget]
        return {"gate": gate, "inner": inner}
    if isinstance(proc, GrammarProcessor) and getattr(proc, "made", None) is not None:
        return {"grammar": proc.grammar, **proc.made}
    raise DFlashError(
        f"a logits processor of type {type(proc).__name__} cannot run across several "
        "processes (those of grammar.make_processor and ThinkingGate can); run it in one"
    )


def rebuilt(r: dict, tokenizer):
    """The logits processor of ``recipe``'s ``r``, fresh, for this rank's ``tokenizer``."""
    from ..decoding.grammar import make_processor
    from ..decoding.thinking import ThinkingGate

    if "gate" in r:
        opened, closed, started_open, budget = r["gate"]
        inner = None if r["inner"] is None else rebuilt(r["inner"], tokenizer)
        return ThinkingGate(opened, closed, started_open, inner, budget)
    return make_processor(tokenizer, r["vocab"], r["grammar"], r["eos"])


def images_of(vision) -> list | None:
    """What another rank makes ``vision`` (a ``VisionPrompt``) again from: its rendered text
    and its images' bytes in base64 (``vision_of``); None when it has no ``source``."""
    source = getattr(vision, "source", None)
    if source is None:
        return None
    text, files = source
    return [text, [base64.b64encode(b).decode() for b in files]]


def vision_of(model, ids: list[int], pics: list):
    """The ``VisionPrompt`` rank 0 made of ``pics`` (its rendered text, its images' bytes
    in base64), made again here.

    Raises:
        DFlashError: it gives other ids than rank 0's.
    """
    from ..vision.request import rebuild

    text, files = pics
    vision = rebuild(model, text, [base64.b64decode(f) for f in files])
    if vision.ids != list(ids):
        raise DFlashError("this rank's processor made other prompt ids of rank 0's images")
    return vision
