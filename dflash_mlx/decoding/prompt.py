"""What a prompt must satisfy before it reaches the model: text that is valid Unicode, a chat
format (the tokenizer's template, or a default one), and a length within the context.

Each rule lives here once; ``generation.encode_prompt`` applies them, so ``dflash run``,
``dflash chat``, the server and the Python API agree. No MLX here.
"""

from __future__ import annotations

import json
import logging
import sys
import weakref
from collections.abc import Sequence
from pathlib import Path

from ..errors import ContextLengthError, DFlashError

# We check prompts against the context ourselves, in one line; transformers' own warning
# about long sequences would be a second, misleading one ("will result in indexing errors").
logging.getLogger("transformers.tokenization_utils_base").setLevel(logging.ERROR)

CHATML = ("<|im_start|>", "<|im_end|>")
PLAIN_ROLES = {"system": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}
PLAIN_STOPS = ["\nUser:"]

_vocab_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_noticed: weakref.WeakSet = weakref.WeakSet()


# ----------------------------------------------------------------------------- valid text


def check_text(text: str, what: str = "the prompt", fix: str = "") -> None:
    """Refuse text that cannot be encoded as UTF-8 (it holds lone surrogates: bytes that were
    not UTF-8, read with Python's surrogateescape, or an escaped half of a pair in JSON).

    Args:
        text: the text. what: how to name it in the message. fix: what to do instead.

    Raises:
        DFlashError: one line with the first bad position.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        bad = f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"lone surrogate U+{c:04X}"
        fix = fix or "convert it to UTF-8 first (e.g. iconv -f latin1 -t utf-8)"
        raise DFlashError(
            f"{what} is not valid UTF-8 ({bad} at character {e.start}); {fix}"
        ) from None


# ----------------------------------------------------------------------------- the context


def context_length(model) -> int | None:
    """The target's context in tokens: ``max_position_embeddings`` of its config (a GGUF's
    ``context_length`` lands there when it is loaded), or None when the config has none.

    Args:
        model: a ``DFlashModel`` (or an mlx-lm model).
    """
    target = getattr(model, "target", model)
    for obj in (target, getattr(target, "language_model", None)):
        args = getattr(obj, "args", None)
        for src in (args, getattr(args, "text_config", None)):
            v = (
                src.get("max_position_embeddings")
                if isinstance(src, dict)
                else getattr(src, "max_position_embeddings", None)
            )
            if isinstance(v, int) and v > 0:
                return v
    cfg = Path(getattr(model, "target_path", "") or ".") / "config.json"
    try:
        data = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return None
    v = data.get("max_position_embeddings") or (data.get("text_config") or {}).get(
        "max_position_embeddings"
    )
    return v if isinstance(v, int) and v > 0 else None


def _vocab(tokenizer) -> dict[str, int]:
    return _vocab_and_longest(tokenizer)[0]


def _vocab_and_longest(tokenizer):
    """(token -> id, the longest token's length in characters), computed once per tokenizer."""
    try:
        return _vocab_cache[tokenizer]
    except (KeyError, TypeError):
        pass
    try:
        vocab = dict(tokenizer.get_vocab())
    except Exception:  # noqa: BLE001  any tokenizer wrapper's failure: only the check is lost
        vocab = {}
    found = (vocab, max(map(len, vocab), default=0))
    try:
        _vocab_cache[tokenizer] = found
    except TypeError:
        pass
    return found


def check_chars(tokenizer, chars: int, context: int | None) -> None:
    """Refuse text far too long for the context without tokenizing it (which takes a while
    for megabytes): no token spans more characters than the vocabulary's longest entry.

    Args:
        tokenizer: the model's tokenizer. chars: characters of the prompt's text.
        context: the context length (None: no limit).

    Raises:
        ContextLengthError: the text cannot fit whatever it tokenizes to.
    """
    longest = _vocab_and_longest(tokenizer)[1]
    if context is None or not longest:
        return
    per_token = 2 * longest  # x2: a normalizer may merge characters (NFKC): a loose bound
    if chars // per_token >= context:
        raise ContextLengthError(
            f"the prompt is {chars} characters, at least {chars // per_token} tokens; this "
            f"model's context is {context} tokens; shorten the prompt"
        )


def check_prompt(tokenizer, prompt, system: str | None, context: int | None) -> None:
    """Check a prompt before tokenizing it: valid UTF-8 everywhere, not far too long.

    Args:
        tokenizer: the model's tokenizer. prompt: str, messages or token ids.
        system: the system message of a str prompt. context: the context length or None.

    Raises:
        DFlashError: text that is not valid UTF-8. ContextLengthError: text far too long.
    """
    texts = [("the system prompt", system)] if isinstance(system, str) else []
    if isinstance(prompt, str):
        texts.append(("the prompt", prompt))
    elif len(prompt) and isinstance(prompt[0], dict):
        texts += [(f"messages[{i}].content", m.get("content")) for i, m in enumerate(prompt)]
    texts = [(what, t) for what, t in texts if isinstance(t, str)]
    for what, t in texts:
        check_text(t, what)
    check_chars(tokenizer, sum(len(t) for _, t in texts), context)


def check_system_prompt(tokenizer, text: str, context: int | None, what: str, fix: str = ""):
    """Refuse a system prompt that is not valid UTF-8, or that alone (with an empty first
    message) leaves no room in the context: every message after it would fail.

    Args:
        tokenizer: the model's tokenizer. text: the system prompt. context: the context
            length or None. what: its name in messages. fix: how to correct bad text.

    Raises:
        DFlashError: one line naming the problem and the fix.
    """
    check_text(text, what, fix)
    if context is None:
        return
    try:
        check_chars(tokenizer, len(text), context)
    except ContextLengthError:
        raise DFlashError(
            f"{what} is {len(text)} characters, far more than this model's {context}-token "
            "context; shorten it"
        ) from None
    msgs = [{"role": "system", "content": text}, {"role": "user", "content": ""}]
    n = conversation_tokens(tokenizer, msgs)
    if n is not None and n >= context:
        raise DFlashError(
            f"{what} alone makes a prompt of {n} tokens; this model's context is {context} "
            "tokens; shorten it"
        )


def check_fits(n_tokens: int, context: int | None) -> None:
    """Refuse a prompt that leaves no room in the context for a single generated token.

    Args:
        n_tokens: prompt length in tokens. context: the context length (None: no limit).

    Raises:
        ContextLengthError: one line with both numbers.
    """
    if context is not None and n_tokens >= context:
        raise ContextLengthError(
            f"the prompt is {n_tokens} tokens; this model's context is {context} tokens; "
            "shorten the prompt"
        )


def room(n_tokens: int, max_tokens: int, context: int | None) -> int:
    """max_tokens, clamped to what the context leaves after a prompt of n_tokens.

    Args:
        n_tokens: prompt length (it fits: see ``check_fits``). max_tokens: the budget asked.
        context: the context length (None: no limit).
    """
    return max_tokens if context is None else max(1, min(max_tokens, context - n_tokens))


# ----------------------------------------------------------------------------- chat format


def has_chat_template(tokenizer) -> bool:
    """Whether the tokenizer brings its own chat template."""
    return getattr(tokenizer, "chat_template", None) is not None


def default_format(tokenizer) -> str | None:
    """The default chat format for a tokenizer without a template: "chatml" when it has the
    ``<|im_start|>`` / ``<|im_end|>`` tokens, else "plain"; None when it has a template."""
    if has_chat_template(tokenizer):
        return None
    vocab = _vocab(tokenizer)
    return "chatml" if all(t in vocab for t in CHATML) else "plain"


def default_stops(tokenizer) -> list[str]:
    """Stop strings that end an answer in the default format (the next "User:" line of the
    plain format; ChatML ends with its ``<|im_end|>`` token, see ``end_of_turn_ids``)."""
    return list(PLAIN_STOPS) if default_format(tokenizer) == "plain" else []


def end_of_turn_ids(tokenizer) -> set:
    """Token ids that end a turn of the default ChatML format (empty otherwise)."""
    if default_format(tokenizer) != "chatml":
        return set()
    return {_vocab(tokenizer)[CHATML[1]]}


def notice_default_format(tokenizer, file=None) -> None:
    """Say once per tokenizer (on stderr) that chats use the default format."""
    fmt = default_format(tokenizer)
    if fmt is None or _seen(tokenizer):
        return
    shape = (
        "<|im_start|>role ... <|im_end|> (ChatML)"
        if fmt == "chatml"
        else '"User: ..." / "Assistant: ..." lines'
    )
    print(
        f"note: this model has no chat template; chat messages use a default format: {shape}",
        file=file or sys.stderr,
        flush=True,
    )


def _seen(tokenizer) -> bool:
    try:
        if tokenizer in _noticed:
            return True
        _noticed.add(tokenizer)
    except TypeError:  # not weakly referenceable: say it every time rather than never
        pass
    return False


def chat_ids(
    tokenizer, messages: Sequence[dict[str, str]], tools=None, template_kwargs=None
) -> list[int]:
    """Ids of a conversation ready for the assistant's answer: the tokenizer's chat
    template, or the default format (with a one-time notice) when it has none.

    Args:
        tokenizer: mlx-lm TokenizerWrapper. messages: {role, content} dicts.
        tools: the template's ``tools`` variable (OpenAI tool objects), if any.
        template_kwargs: more template variables (e.g. ``enable_thinking``); the default
            format has none and ignores them.
    """
    if has_chat_template(tokenizer):
        ids = _render(tokenizer, messages, tools, template_kwargs)
        return ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids
    notice_default_format(tokenizer)
    enc = lambda s: list(tokenizer.encode(s, add_special_tokens=False))
    if default_format(tokenizer) == "chatml":
        # Special ids placed directly: right even where the tokenizer would split their text.
        start, end = (_vocab(tokenizer)[t] for t in CHATML)
        ids: list[int] = []
        for m in messages:
            ids += [start] + enc(f"{m['role']}\n{m['content']}") + [end] + enc("\n")
        return ids + [start] + enc("assistant\n")
    text = "".join(
        f"{PLAIN_ROLES.get(m['role'], m['role'].title())}: {m['content']}\n\n" for m in messages
    )
    return list(tokenizer.encode(text + "Assistant:"))


def chat_text(tokenizer, messages: Sequence[dict], tools=None, template_kwargs=None) -> str:
    """The chat template's text of a conversation ready for the answer, with the same
    ``tools`` and template variables ``chat_ids`` gives it (a prompt with images is
    rendered to text, then the processor expands its images: ``vision/request.py``).

    Args:
        tokenizer: a tokenizer with a chat template. messages: chat messages.
        tools, template_kwargs: as for ``chat_ids``.
    """
    return _render(tokenizer, messages, tools, template_kwargs, tokenize=False)


def _render(tokenizer, messages, tools, template_kwargs, **kw):
    """``apply_chat_template`` with ``tools`` and the template variables; a variable the
    template cannot use is the input's fault (one line)."""
    tvars = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
    try:
        return tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, **tvars, **kw
        )
    except (TypeError, AttributeError, KeyError) as e:
        if not template_kwargs:
            raise
        # a variable of the wrong type for what the template does with it: the input's fault
        raise DFlashError(
            f"the chat template cannot use the template variables {sorted(template_kwargs)} "
            f"({type(e).__name__}: {e}); check their values"
        ) from None


def template_errors() -> tuple:
    """What applying a chat template raises on messages it refuses (a template's own
    ``raise_exception``, a tokenizer without a template)."""
    try:
        from jinja2 import TemplateError
    except ImportError:  # no jinja2: transformers cannot render templates at all
        return (ValueError,)
    return (ValueError, TemplateError)


def conversation_tokens(tokenizer, messages: Sequence[dict[str, str]]) -> int | None:
    """The prompt length of a conversation ready for the answer (None: the template
    refuses these messages).

    Args:
        tokenizer: the model's tokenizer. messages: {role, content} dicts.
    """
    try:
        return len(chat_ids(tokenizer, messages))
    except template_errors():
        return None


def with_default_stops(stop, tokenizer) -> list[str] | None:
    """A ``stop`` setting plus the default format's own stop strings (for chat prompts).

    Args:
        stop: None, a str or a list of str. tokenizer: the model's tokenizer.
    """
    extra = default_stops(tokenizer)
    if not extra:
        return stop
    have = [stop] if isinstance(stop, str) else list(stop or [])
    return have + [s for s in extra if s not in have]
