"""Prompts to token ids: ``encode_prompt`` (the chat template, token ids as they are),
``fit_prompt`` (checked against the model's context and vocabulary) and ``request_ids``, the
one place a request's images go (to ``vision/request.py``); without images a prompt takes
exactly the text path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from . import inputs
from .decoding.prompt import (
    chat_ids,
    check_fits,
    check_prompt,
    context_length,
    has_chat_template,
    room,
    with_default_stops,
)
from .decoding.state import DFlashModel
from .errors import DFlashError
from .settings import GenerationConfig
from .vision.notes import vision_language

Prompt = str | Sequence[int] | Sequence[dict]


def encode_prompt(
    tokenizer,
    prompt: Prompt,
    raw: bool = False,
    system: str | None = None,
    context: int | None = None,
    tools: list | None = None,
    template_kwargs: dict | None = None,
):
    """Turn a prompt into ids: a str gets the chat template unless raw, messages always
    do, token ids are used as-is. A tokenizer without a template gets the default chat
    format (``prompt.chat_ids``) for messages and for a str with a system message; a bare
    str is then encoded as-is (a completion).

    Args:
        tokenizer: mlx-lm TokenizerWrapper. prompt: str, list of ids or list of messages.
        raw: skip the chat template for a str. system: optional system message.
        context: the model's context length; a prompt that does not fit is refused (text
            far too long before it is tokenized). tools: the chat template's ``tools``.
        template_kwargs: more chat template variables (e.g. ``{"enable_thinking": False}``).

    Raises:
        DFlashError: an empty prompt, text that is not valid UTF-8.
        ContextLengthError: a prompt longer than the context.
    """
    check_prompt(tokenizer, prompt, system, context)
    if isinstance(prompt, str):
        if raw or not (has_chat_template(tokenizer) or system):
            bos = getattr(tokenizer, "bos_token", None)
            special = bos is None or not prompt.startswith(bos)
            ids = tokenizer.encode(prompt, add_special_tokens=special)
        else:
            msgs = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}
            ]
            ids = chat_ids(tokenizer, msgs, template_kwargs=template_kwargs)
    elif len(prompt) and isinstance(prompt[0], dict):
        ids = chat_ids(tokenizer, list(prompt), tools, template_kwargs)
    else:
        try:
            ids = [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise DFlashError(
                "a prompt is a str, a list of token ids or a list of {role, content} messages"
            ) from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    if not ids:
        raise DFlashError("the prompt is empty; give at least one token of text")
    check_fits(len(ids), context)
    return list(ids)


def fit_prompt(model: DFlashModel, tokenizer, prompt: Prompt, cfg: GenerationConfig, **kw):
    """(ids, cfg): the prompt encoded and checked against the model's context and
    vocabulary, with ``max_tokens`` clamped to the room the context leaves.

    Args:
        model, tokenizer: from ``load``. prompt: as for ``stream_generate``. cfg: validated
            settings. kw: ``raw`` and ``system`` for ``encode_prompt``.

    Raises:
        DFlashError: as ``encode_prompt``; token ids outside the vocabulary.
    """
    inputs.check_tokenizer(model, tokenizer)
    ctx = context_length(model)
    ids = encode_prompt(tokenizer, prompt, context=ctx, **kw)
    vocab = model.adapter.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab] + [
        t for t in cfg.logit_bias or {} if not 0 <= t < vocab
    ]
    if bad:
        raise DFlashError(f"token id {bad[0]} is outside this model's vocabulary [0, {vocab})")
    chat = not isinstance(prompt, str) and len(prompt) and isinstance(prompt[0], dict)
    if chat or (isinstance(prompt, str) and kw.get("system") and not kw.get("raw")):
        cfg = replace(cfg, stop=with_default_stops(cfg.stop, tokenizer))
    return ids, replace(cfg, max_tokens=room(len(ids), cfg.max_tokens, ctx))


def request_ids(model: DFlashModel, tokenizer, prompt: Prompt, cfg: GenerationConfig, **kw):
    """(ids, cfg, vision) of one request: ``fit_prompt``'s, and the prompt's images ready for
    the prefill (``vision.prompt.VisionPrompt``; None without images).

    Args:
        model, tokenizer, prompt, cfg: as for ``fit_prompt``. kw: ``raw``, ``system``,
            ``tools`` and ``template_kwargs`` (``encode_prompt``'s; with images too) and
            ``images`` (a list of ``vision.images.Picture`` or what ``images.read`` takes,
            or the ``VisionPrompt`` that ``vision.request.prepare`` made of this prompt)
            and ``budget`` (``prepare``'s decode budget).

    Raises:
        DFlashError: as ``fit_prompt``. ImageError: an image sent to a text-only model
            (kind ``no_vision``), a bad image, image parts that do not match the images.
    """
    images, budget = kw.pop("images", None), kw.pop("budget", None)
    if cfg.kv_bits is not None and vision_language(model):
        # mlx-vlm's caches are not mlx-lm's: mlx-lm's conversion would not quantize them
        raise DFlashError(
            "kv_bits is not supported on a vision-language model yet; leave kv_bits unset"
        )
    if isinstance(images, (list, tuple)) and not images:
        images = None  # no images: exactly the text path
    if images is not None:
        from .vision.request import prepare, prepared

        if prepared(images):  # encoded already (a server tokenizes first): its own ids
            ids, cfg = fit_prompt(model, tokenizer, images.check(prompt), cfg, **kw)
            return ids, cfg, images
        return prepare(model, tokenizer, prompt, images, cfg, budget=budget, **kw)
    if _has_parts(prompt):
        from .vision.request import flatten

        prompt = flatten(prompt)
    return (*fit_prompt(model, tokenizer, prompt, cfg, **kw), None)


def _has_parts(prompt) -> bool:
    """Whether chat messages carry a content list (parts) anywhere."""
    msgs = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict) else []
    return any(isinstance(m.get("content"), list) for m in msgs)
