"""The engine's one entry for images: a request's prompt and images become the token ids
and the ``VisionPrompt`` the decode loop runs (``prepare``), and chat messages whose
content is a list of parts are checked and, without images, flattened to text.

A prompt with images is a list of chat messages whose ``content`` may be a list of parts
``{"type": "text", "text": ...}`` and ``{"type": "image"}``; the i-th image part in reading
order is ``images[i]``. A str prompt with images is one user turn: the images, then the text.
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import DFlashError
from .budget import DECODING
from .images import ImageError, ImageLimits, from_bytes, read_all

EXAMPLE = "a Qwen3.5 checkpoint whose config.json has a vision_config"


def image_parts(messages) -> int:
    """How many ``{"type": "image"}`` parts the messages hold."""
    n = 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            n += sum(1 for p in content if isinstance(p, dict) and p.get("type") == "image")
    return n


def flatten(messages: list[dict]) -> list[dict]:
    """Messages without images: a content list's text parts joined into one str (a text-only
    chat template takes only str content).

    Raises:
        ImageError: an image part without an image to go with it.
    """
    if image_parts(messages):
        raise ImageError(
            f"the prompt has {image_parts(messages)} image parts but no images were given; "
            "pass images=[...] (one per {'type': 'image'} part)"
        )
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            m = {**m, "content": "".join(p.get("text", "") for p in content)}
        out.append(m)
    return out


def _messages(prompt, n: int, system: str | None) -> list[dict]:
    """The chat messages of a prompt given with ``n`` images."""
    if isinstance(prompt, str):
        parts = [{"type": "image"}] * n + [{"type": "text", "text": prompt}]
        msgs = [{"role": "user", "content": parts}]
        return ([{"role": "system", "content": system}] if system else []) + msgs
    if not (prompt and isinstance(prompt[0], dict)):
        raise DFlashError(
            "a prompt of token ids takes no images; pass a str or chat messages with "
            "{'type': 'image'} parts"
        )
    have = image_parts(prompt)
    if have != n:
        raise ImageError(
            f"the prompt has {have} image parts but {n} images were given; give one image per "
            "{'type': 'image'} part, in reading order"
        )
    return list(prompt)


def prepared(images) -> bool:
    """Whether ``images`` is a ``VisionPrompt`` (``prepare``'s) rather than images."""
    from .prompt import VisionPrompt

    return isinstance(images, VisionPrompt)


def no_vision(model) -> ImageError:
    """The refusal of an image sent to a text-only model."""
    return ImageError(
        f"this model takes no images ({model.name or 'a text-only model'}); load a "
        f"vision-language model, e.g. {EXAMPLE}",
        "no_vision",
    )


def prepare(model, tokenizer, prompt, images, cfg, raw=False, system=None, limits=None, **kw):
    """(ids, cfg, VisionPrompt) of a request with images, checked as ``fit_prompt`` checks
    a text one (context, vocabulary, stop strings, ``max_tokens`` clamped to the room).

    Args:
        model, tokenizer: the loaded pair. prompt: a str or chat messages. images: what
            ``images.read_all`` takes. cfg: validated settings. raw: refused with images.
        system: the system message of a str prompt. limits: ``ImageLimits`` (default ones).
        kw: ``budget`` (a ``vision.budget.PixelBudget``; default the process's), ``tools``
            and ``template_kwargs`` (e.g. ``{"enable_thinking": False}``) for the
            chat template, as the text path's ``encode_prompt`` takes them.

    Raises:
        ImageError: a text-only model (``no_vision``, before an image is looked at), a bad
            image, image parts that do not match the images, text that spells the model's
            image placeholder, images over the decode budget. DFlashError: a raw prompt or
            token ids with images, a prompt longer than the context.
    """
    from ..decoding.prompt import chat_text, check_fits, context_length, room, with_default_stops
    from .target import VisionTarget

    target = model.target
    if not isinstance(target, VisionTarget):
        raise no_vision(model)
    if raw:
        raise DFlashError("a raw prompt takes no images; drop raw=True to use the chat template")
    pictures = read_all(images, limits or ImageLimits())
    msgs = _messages(prompt, len(pictures), system)
    _no_placeholders(target.processor, msgs)
    text = chat_text(tokenizer, msgs, kw.get("tools"), kw.get("template_kwargs"))
    with (kw.get("budget") or DECODING).hold(sum(p.pixels for p in pictures)):
        vision = _vision(target, text, pictures)  # the decoded pixels are dropped after
    ctx = context_length(model)
    check_fits(vision.length, ctx)
    cfg = replace(cfg, stop=with_default_stops(cfg.stop, tokenizer))
    return vision.ids, replace(cfg, max_tokens=room(vision.length, cfg.max_tokens, ctx)), vision


def _no_placeholders(processor, msgs: list[dict]) -> None:
    """Refuse text that spells the model's image or video placeholder (``<|image_pad|>``):
    the processor would expand it as an image's rows, so the rows would not be the images
    given."""
    marks = [getattr(processor, a, None) for a in ("image_token", "video_token")]
    marks = [m for m in marks if isinstance(m, str) and m]
    for i, m in enumerate(msgs):
        content = m.get("content")
        parts = content if isinstance(content, list) else [{"text": content}]
        for p in parts:
            text = p.get("text") if isinstance(p, dict) else None
            hit = next((k for k in marks if isinstance(text, str) and k in text), None)
            if hit:
                raise ImageError(
                    f"message {i}'s text spells the image placeholder {hit}; remove it (each "
                    "image is one {'type': 'image'} part with its image in images=[...])"
                )


def _vision(target, text: str, pictures):
    """The ``VisionPrompt`` of rendered text and its images (mlx-vlm's processor, then its
    language model's ``get_rope_index`` for the mRoPE positions)."""
    from .prompt import VisionPrompt

    cfg = target.vlm.config
    pils = [p.pil(f"image {i}") for i, p in enumerate(pictures)]
    try:
        out = target.processor(images=pils, text=[text])
        ids, grid = out["input_ids"], out["image_grid_thw"]
        pos, delta = target.language_model.get_rope_index(ids, grid, None, out["attention_mask"])
        vision = VisionPrompt(
            ids[0].tolist(),
            getattr(cfg, "image_token_index", None) or cfg.image_token_id,
            out["pixel_values"],
            grid,
            [p.sha256 for p in pictures],
            pos,
            delta.reshape(-1)[0].item(),
            cfg.vision_config.spatial_merge_size,
        )
    except ValueError as e:  # e.g. the text itself spells an image token
        raise ImageError(f"the images do not fit the prompt's image places ({e})") from None
    if all(p.data for p in pictures):  # what another process needs to make it again
        vision.source = (text, [p.data for p in pictures])
    return vision


def rebuild(model, text: str, images: list[bytes]):
    """The ``VisionPrompt`` another process made of rendered ``text`` and these images'
    bytes (its ``source``): the same processor on the same inputs gives the same prompt (a
    rank replaying rank 0's server). The images passed rank 0's limits already.

    Args:
        model: the loaded pair (a vision-language target).
    """
    limits = ImageLimits(max_pixels=1 << 40, max_bytes=max(map(len, images)) + 1)
    pictures = [from_bytes(b, limits, f"image {i}") for i, b in enumerate(images)]
    with DECODING.hold(sum(p.pixels for p in pictures)):
        return _vision(model.target, text, pictures)
