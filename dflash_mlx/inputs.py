"""What the Python API accepts, checked at the door: the shapes of ``prompt`` / ``prompts``,
``system``, ``config`` / ``configs`` and their keywords, ``max_batch``, ``prompt_cache``.

``generate``, ``stream_generate``, ``batch_generate`` and ``BatchGenerator`` call these before
anything runs, so a wrong type is one ``DFlashError`` in the API's own names, never a traceback
from deep inside, and nothing is taken for what it is not (a str as a list of one-character
prompts, bytes or floats as token ids). The rules on the text itself (valid Unicode, the
context) are ``decoding/prompt.py``'s. MLX is imported only to recognise a prompt cache.
"""

from __future__ import annotations

import difflib
import weakref
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import fields, replace
from numbers import Integral

from .errors import DFlashError
from .settings import GenerationConfig

SHAPES = "a str, a list of token ids or a list of {role, content} messages"


def _got(x) -> str:
    """How to show a bad value in a message: its type, and the value when it is short."""
    if x is None:
        return "None"
    shown = repr(x)
    return f"{type(x).__name__} {shown}" if len(shown) <= 24 else type(x).__name__


def is_id(x) -> bool:
    """Whether x can be a token id: an int (numpy's included), never a bool."""
    return isinstance(x, Integral) and not isinstance(x, bool)


def check_prompt(prompt, what: str = "prompt"):
    """One prompt, as the API takes it: a str, token ids (a list or tuple of ints, or a 1-D
    integer array), or chat messages (a list or tuple of {role, content} dicts).

    Args:
        prompt: the value given. what: its name in messages (``prompt``, ``prompts[2]``).

    Returns:
        the prompt as a str, a list of int ids or a list of message dicts.

    Raises:
        DFlashError: any other type, bytes, or a list mixing kinds.
    """
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (bytes, bytearray)):
        raise DFlashError(f"{what} is bytes; decode it to a str first, e.g. .decode('utf-8')")
    if hasattr(prompt, "ndim") and hasattr(prompt, "tolist"):  # a numpy or MLX array
        if prompt.ndim != 1:
            raise DFlashError(f"{what} is a {prompt.ndim}-D array; token ids are a 1-D list")
        prompt = prompt.tolist()
    if isinstance(prompt, Mapping):
        raise DFlashError(f"{what} is one message; pass a list of messages, e.g. [message]")
    if not isinstance(prompt, (list, tuple)):
        hint = "; pass a list, e.g. list(...)" if hasattr(prompt, "__iter__") else ""
        raise DFlashError(f"{what} must be {SHAPES} (got {_got(prompt)}){hint}")
    if prompt and isinstance(prompt[0], Mapping):
        return check_messages(prompt, what)
    for i, t in enumerate(prompt):
        if not is_id(t):
            kind = "a message" if isinstance(t, Mapping) else _got(t)
            raise DFlashError(f"{what}[{i}] is {kind}; token ids are ints (a prompt is {SHAPES})")
    return [int(t) for t in prompt]


def check_messages(messages, what: str = "prompt") -> list[dict]:
    """Chat messages: dicts whose ``role`` is a str and whose ``content`` is a str (an
    assistant's message carrying ``tool_calls`` may have none).

    Args:
        messages: a list or tuple of dicts. what: their name in messages.

    Returns:
        the messages as a list of dicts.

    Raises:
        DFlashError: the first message at fault, and why.
    """
    out = []
    for i, m in enumerate(messages):
        at = f"{what}[{i}]"
        if not isinstance(m, Mapping):
            raise DFlashError(f"{at} is {_got(m)}; a list of messages holds only dicts")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise DFlashError(f"{at} has role {_got(role)}; a role is a str such as 'user'")
        if content is None and "tool_calls" not in m:
            raise DFlashError(f"{at} has no 'content'; give each message its text as a str")
        if content is not None and not isinstance(content, str):
            _check_parts(content, at)
        out.append(dict(m))
    return out


def _check_parts(content, at: str) -> None:
    """A message's content given as a list of parts: ``{"type": "text", "text": str}`` and
    ``{"type": "image"}`` (its image is passed in ``images``)."""
    if not isinstance(content, list):
        raise DFlashError(
            f"{at}['content'] is {_got(content)}; a message's content is a str or a list of parts"
        )
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, Mapping) else None
        if kind == "image" or (kind == "text" and isinstance(p.get("text"), str)):
            continue
        raise DFlashError(
            f"{at}['content'][{j}] is {_got(p)}; a part is {{'type': 'text', 'text': str}} "
            "or {'type': 'image'}"
        )


def check_prompts(prompts) -> list:
    """The prompts of a batch: a list or tuple, each as for ``check_prompt``.

    Args:
        prompts: the value given.

    Returns:
        a list of checked prompts.

    Raises:
        DFlashError: a str or anything else that is not a list or tuple; a bad prompt.
    """
    if isinstance(prompts, (str, bytes, bytearray)):
        raise DFlashError("prompts is one text; pass a list of prompts, e.g. [prompt]")
    if not isinstance(prompts, (list, tuple)):
        hint = "; pass a list, e.g. list(...)" if hasattr(prompts, "__iter__") else ""
        raise DFlashError(f"prompts must be a list of prompts (got {_got(prompts)}){hint}")
    return [check_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]


def check_configs(configs, n: int, config: GenerationConfig | None) -> list:
    """Each prompt's config: ``configs`` one per prompt (None entries: ``config``) or a
    single ``GenerationConfig`` for all; None gives every prompt ``config``.

    Args:
        configs: the value given. n: the number of prompts. config: the default.

    Raises:
        DFlashError: a length that is not n, an entry that is not a config.
    """
    if configs is None or isinstance(configs, GenerationConfig):
        return [configs or config] * n
    if not isinstance(configs, (list, tuple)):
        raise DFlashError(
            f"configs must be a list of GenerationConfig, one per prompt, or one "
            f"GenerationConfig (got {_got(configs)})"
        )
    if len(configs) != n:
        have = f"{len(configs)} entr{'y' if len(configs) == 1 else 'ies'}"
        raise DFlashError(
            f"configs has {have} for {n} prompt{'' if n == 1 else 's'}; give one per prompt "
            "(None: config=), or one GenerationConfig as config= for all"
        )
    for i, c in enumerate(configs):
        if c is not None and not isinstance(c, GenerationConfig):
            raise DFlashError(f"configs[{i}] is {_got(c)}; each is a GenerationConfig or None")
    return [c or config for c in configs]


def settings_config(config, settings: dict) -> GenerationConfig:
    """``config`` with the keyword ``settings`` applied (not yet validated).

    Args:
        config: a GenerationConfig or None (the defaults). settings: its fields by name.

    Raises:
        DFlashError: config of another type; a keyword that is not a field.
    """
    if config is not None and not isinstance(config, GenerationConfig):
        raise DFlashError(
            f"config must be a GenerationConfig or None (got {_got(config)}); "
            "settings may also be given as keywords"
        )
    names = [f.name for f in fields(GenerationConfig)]
    for key in settings:
        if key not in names:
            near = difflib.get_close_matches(key, names, n=1)
            hint = (
                f"; did you mean {near[0]}?" if near else f"; the settings are {', '.join(names)}"
            )
            raise DFlashError(f"unknown setting {key!r}{hint}")
    return replace(config or GenerationConfig(), **settings)


def check_system(system) -> str | None:
    """``system``: a str or None.

    Raises:
        DFlashError: any other type.
    """
    if system is not None and not isinstance(system, str):
        raise DFlashError(f"system must be a str or None (got {_got(system)})")
    return system


def check_count(value, name: str) -> int:
    """A count that must be an int of 1 or more (``max_batch``, ``prefill_step_size``).

    Raises:
        DFlashError: naming the parameter and the value.
    """
    if not is_id(value) or value < 1:
        raise DFlashError(f"{name} must be an int of 1 or more (got {_got(value)})")
    return int(value)


def check_request(prompt, system, cache, prefill_step_size: int = 1, model=None) -> tuple:
    """(prompt, system, prefill_step_size) of one request, checked as ``check_prompt``,
    ``check_system`` and ``check_count`` do; ``cache`` as ``check_cache``.

    Raises:
        DFlashError: the first input at fault.
    """
    check_cache(cache, model)
    step = check_count(prefill_step_size, "prefill_step_size")
    return check_prompt(prompt), check_system(system), step


def check_cache(cache, model=None) -> None:
    """A ``prompt_cache``: None or what ``model.make_cache()`` returns, for this model.

    Raises:
        DFlashError: anything else (e.g. an mlx-lm cache list, another pair's cache).
    """
    from .decoding.state import PromptCache

    if cache is not None and not isinstance(cache, PromptCache):
        raise DFlashError(
            f"prompt_cache must come from model.make_cache() (got {type(cache).__name__})"
        )
    owner = getattr(cache, "owner", "")
    if model is not None and owner and owner != model.identity:
        raise DFlashError(
            f"prompt_cache was made by {owner}, not by this model {model.identity}; "
            "make one with this model's make_cache()"
        )


def own_cache(model, cache):
    """cache, checked to be model's (``check_cache``), or a fresh one of model's when None."""
    check_cache(cache, model)
    return cache if cache is not None else model.make_cache()


def check_tokenizer(model, tokenizer) -> None:
    """Refuse another model's tokenizer: one whose ids mean other tokens than those of the
    tokenizer ``load`` returned with the model (its text would decode to garbage). The
    tokenizer ``load`` returned always passes, whatever tokens transformers adds to it;
    ids past the embedding are refused where a prompt uses them (``prompts.fit_prompt``).

    Raises:
        DFlashError: naming the tokenizer, the model and a token the two disagree on.
    """
    own = getattr(model, "tokenizer", None)
    if own is None or _inner(tokenizer) is _inner(own) or _AGREED.get(_inner(tokenizer)) is own:
        return
    clash = _clash(_vocab(own), _vocab(tokenizer))
    if clash is None:
        with suppress(TypeError):  # not weakly referable: compared again next time
            _AGREED[_inner(tokenizer)] = own
        return
    token, theirs, ours = clash
    inner = _inner(tokenizer)
    named = getattr(inner, "name_or_path", "") or type(inner).__name__
    raise DFlashError(
        f"the tokenizer ({named}) is not this model's ({model.identity}): it gives "
        f"{token!r} id {theirs}, the model's tokenizer {ours}; pass the tokenizer load() "
        "returned with this model"
    )


# A tokenizer found to agree with a model's -> that model's tokenizer (compared once).
_AGREED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _inner(tokenizer):
    """The tokenizer under mlx-lm's ``TokenizerWrapper`` (itself when there is none)."""
    return getattr(tokenizer, "_tokenizer", tokenizer)


def _vocab(tokenizer) -> Mapping | None:
    """Token -> id of a tokenizer (None: it does not say)."""
    get = getattr(_inner(tokenizer), "get_vocab", None)
    try:
        vocab = get() if callable(get) else None
    except (AttributeError, NotImplementedError, TypeError, ValueError):  # cannot list it
        return None
    return vocab if isinstance(vocab, Mapping) else None


def _clash(ours: Mapping | None, theirs: Mapping | None):
    """(token, their id, our id) of the first token both know under different ids, else None.
    Tokens only one side has (added by one version of transformers) are no clash."""
    if not ours or not theirs:
        return None
    for token, i in theirs.items():
        j = ours.get(token, i)
        if j != i:
            return token, i, j
    return None
