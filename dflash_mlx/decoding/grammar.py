"""Constrained decoding: a logits processor that masks what a grammar forbids (llguidance).

Why llguidance: its per-token mask on the demo's 49k vocabulary costs tens of microseconds on
this CPU (``benchmarks/grammar_mask.py``; xgrammar is as fast but imports torch, outlines-core
is several times slower and compiles a whole-vocabulary index per schema), it has no Python
dependencies, and its matcher can roll back, which speculation needs.

Exact under speculation: the engine calls a processor once per verify row with the prefix that
row follows (``acceptance.process_rows``: history + drafts[:i]). The processor keeps one
matcher and moves it to each prefix (roll back to the common part, consume the rest), so every
row is masked exactly as the target alone would mask it. A draft the grammar forbids gets
probability 0 in its row and is rejected; the rows after it are never used and pass unmasked.
"""

from __future__ import annotations

import json
import weakref
from typing import Any

import mlx.core as mx
import numpy as np

from ..errors import DFlashError

# JSON as json.dumps writes it: one space after ':' and ','; no free whitespace, which a small
# model would otherwise fill with newlines.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class GrammarError(DFlashError):
    """A grammar or JSON schema that cannot be compiled (the message says why)."""


def ll_tokenizer(tokenizer, vocab_size: int, eos: list[int] | None = None):
    """The llguidance view of a tokenizer, built once per tokenizer (about a second).

    Args:
        tokenizer: mlx-lm TokenizerWrapper (or a fast Hugging Face tokenizer).
        vocab_size: the model's logits width (may exceed the tokenizer's vocabulary, or
            fall short of it where transformers added tokens past the embedding).
        eos: ids that end the answer (default: the tokenizer's EOS ids); the mask allows
            them once the grammar is complete.
    """
    import llguidance.hf

    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    eos = sorted(eos or getattr(tokenizer, "eos_token_ids", None) or [hf.eos_token_id])
    key = (vocab_size, tuple(eos))
    try:
        cached = _tokenizers.setdefault(tokenizer, {})
    except TypeError:  # not weakly referenceable: build it each time
        cached = {}
    if key not in cached:
        # The tokenizer may hold ids past the embedding (tokens transformers adds): llguidance
        # needs them all; the mask is cut to the logits' width (``unpack_mask``).
        n = max(vocab_size, len(hf))
        cached[key] = llguidance.hf.from_tokenizer(hf, n_vocab=n, eos_token=list(eos))
    return cached[key]


MAPPINGS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed(schema: Any) -> Any:
    """A copy of a JSON schema whose objects that list ``properties`` take no other keys unless
    they say so (``additionalProperties`` false), as OpenAI's strict mode and xgrammar's
    default read schemas: a small model otherwise invents keys until its budget runs out."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in MAPPINGS and isinstance(v, dict):  # name -> schema: only the values are schemas
            out[k] = {name: closed(s) for name, s in v.items()}
        elif k in ("enum", "const", "default", "examples"):
            out[k] = v
        else:
            out[k] = closed(v)
    if isinstance(out.get("properties"), dict):
        out.setdefault("additionalProperties", False)
    return out


def json_schema_grammar(schema: Any, strict: bool = True) -> str:
    """An llguidance grammar for JSON matching ``schema`` (a dict, or True for any object).

    Args:
        strict: read the schema as ``closed`` does (objects take only the keys they list).

    Raises:
        GrammarError: the schema holds NaN or Infinity, or nests too deeply for llguidance.
    """
    import llguidance

    if schema is True or schema is None:
        schema = {"type": "object"}
    try:
        text = json.dumps(closed(schema) if strict else schema, allow_nan=False)
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_STYLE)
    except (ValueError, RecursionError) as e:  # NaN, nested past its reader's 128 levels
        raise GrammarError(f"the schema cannot be read: {e}") from None


def lark_grammar(text: str) -> str:
    """An llguidance grammar from Lark text (``%json {...}`` embeds a JSON schema)."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(text)


def check_grammar(grammar: str, lltok=None) -> None:
    """Compile a grammar once to report what is wrong with it.

    Raises:
        GrammarError: the compiler's first line, e.g. "Invalid type: foo".
    """
    import llguidance

    try:
        err = llguidance.LLMatcher.validate_grammar(grammar, lltok)
    except (ValueError, RuntimeError, TypeError) as e:
        err = str(e) or type(e).__name__
    if err:  # the compiler's message, on one line (a regex error spans several)
        raise GrammarError(" ".join(str(err).split())[:300])


MAX_FORCED = 1024  # tokens a grammar may force before the model has any choice


def _first_line(matcher) -> str:
    lines = matcher.get_error().strip().splitlines()
    return lines[0] if lines else "unknown error"


def check_start(matcher) -> None:
    """Refuse a grammar that cannot be followed from its start, checked on a copy of its
    matcher: a compile error, no output allowed at all, more than ``MAX_FORCED`` tokens
    forced before any choice (a required self-reference, a pattern repeating thousands of
    times), or a lexer failure in the first mask after the forced tokens.

    Raises:
        GrammarError: what failed, on one line.
    """
    if matcher.is_error():
        raise GrammarError(_first_line(matcher))
    probe = matcher.deep_copy()
    forced = probe.compute_ff_tokens()
    if len(forced) > MAX_FORCED:
        raise GrammarError(
            f"the grammar forces more than {MAX_FORCED} tokens before any choice (a required "
            "self-reference or a pattern repeated thousands of times?)"
        )
    probe.consume_tokens(forced)
    probe.compute_bitmask()
    if probe.is_error():  # e.g. a lexer out of fuel, or no way on ("NoExtensionBias")
        raise GrammarError(f"the grammar cannot be followed from its start: {_first_line(probe)}")
    if probe.is_stopped() and not probe.is_accepting():
        raise GrammarError("the grammar admits no output")


def unpack_mask(bitmask: bytes, vocab: int) -> np.ndarray:
    """A packed bitmask (bit j of little-endian 32-bit word w allows token 32w + j) as bool
    [vocab]; tokens past the mask are forbidden."""
    bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")
    if bits.size < vocab:
        bits = np.concatenate([bits, np.zeros(vocab - bits.size, np.uint8)])
    return bits[:vocab].astype(bool)


class GrammarProcessor:
    """An mlx-lm style logits processor ``(tokens, logits) -> logits`` that forbids the tokens
    a grammar does not allow after ``tokens``. One per generation: its first call (the
    prompt) fixes where the answer starts.

    Args:
        lltok: from ``ll_tokenizer``. grammar: from ``json_schema_grammar`` / ``lark_grammar``.

    Raises:
        GrammarError: the grammar does not compile.
    """

    def __init__(self, lltok, grammar: str):
        import llguidance

        check_grammar(grammar, lltok)
        self.lltok, self.grammar = lltok, grammar
        self.matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        check_start(self.matcher)
        self.base: int | None = None
        self.consumed: list[int] = []  # answer tokens the matcher has consumed

    def _sync(self, answer: list[int]) -> bool:
        """Move the matcher to the state after ``answer``; False if the grammar forbids it
        (the matcher then stays at its longest allowed prefix)."""
        have = self.consumed
        k = 0
        n = min(len(have), len(answer))
        while k < n and have[k] == answer[k]:
            k += 1
        if k < len(have):
            if not self.matcher.rollback(len(have) - k):
                raise GrammarError(f"grammar rollback failed: {self.matcher.get_error()}")
            del have[k:]
        for t in answer[k:]:
            if self.matcher.is_stopped() or self.matcher.validate_tokens([t]) != 1:
                return False
            self.matcher.consume_token(t)
            have.append(t)
        return True

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        """Mask one row: tokens [T] (prompt + answer so far), logits [1, V]."""
        if self.base is None:
            self.base = int(tokens.size)
        answer = tokens[self.base :].tolist() if tokens.size > self.base else []
        if not self._sync([int(t) for t in answer]):
            return logits  # a row after a forbidden draft: never accepted, left as it is
        allowed = unpack_mask(self.matcher.compute_bitmask(), logits.shape[-1])
        return mx.where(mx.array(allowed)[None], logits, mx.array(-mx.inf, logits.dtype))

    @property
    def done(self) -> bool:
        """Whether what was consumed so far is a complete sentence of the grammar."""
        return self.matcher.is_accepting()


def make_processor(tokenizer, vocab_size: int, grammar: str, eos=None) -> GrammarProcessor:
    """A fresh ``GrammarProcessor`` for one generation.

    Args:
        tokenizer: the model's tokenizer. vocab_size: the model's logits width.
        grammar: an llguidance grammar. eos: ids that may end the answer (see ``ll_tokenizer``).

    Its ``made`` (with ``grammar``) is what another rank rebuilds it from
    (``distributed.wire.recipe``).
    """
    proc = GrammarProcessor(ll_tokenizer(tokenizer, vocab_size, eos), grammar)
    proc.made = {"vocab": vocab_size, "eos": None if eos is None else sorted(eos)}
    return proc
