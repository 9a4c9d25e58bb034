"""Public generation API: ``stream_generate`` and ``generate`` (mlx-lm style).

``stream_generate`` is three steps around the decode loop: encode the prompt, scan the
detokenized text for stop strings, and keep the statistics each response carries.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors

from . import inputs
from .decoding.acceptance import SamplingParams
from .decoding.loop import DecodeOptions, decode
from .decoding.prompt import (
    end_of_turn_ids,
    template_errors,  # noqa: F401  (the server and chat read it here)
)
from .decoding.state import DFlashModel, PromptCache
from .decoding.stats import RequestStats
from .decoding.steps import Cycle
from .distributed import policy as across
from .loading import memory
from .prompts import Prompt, encode_prompt, fit_prompt, request_ids  # noqa: F401 (re-exported)
from .settings import AUTO, GenerationConfig
from .vision.notes import fallbacks


@dataclass
class GenerationResponse:
    """One streamed piece of a completion.

    Attributes:
        text: text newly decoded by this response. tokens: ids committed by it.
        accepted: draft tokens accepted in the cycle that produced them.
        finish_reason: None, "stop" or "length".
        prompt_tokens: prompt length; prompt_processed: tokens actually prefilled (the rest
            came from the prompt cache). prompt_tps, generation_tps: tokens per second.
        generation_tokens: tokens generated so far. tau: mean tokens per verify cycle so far.
        cycles: verify cycles so far (plain steps included). peak_memory: GB.
        acceptance: conditional acceptance per block position so far.
        blocks: how many steps used each block size (1 = a plain target step).
        plain_share: the share of steps decoded plainly.
        copied: verify cycles whose drafts were copied from the context (``lookup``).
        siblings: verify cycles that committed a sibling of the first draft (``tree``).
        schedule: with block_size="auto", when and why decoding switched to or from
            plain decoding. timings: seconds per stage (profile=True).
        notes: what the request runs without, and why, one line each (e.g. trees off on a
            vision-language target: ``vision/notes.py``); empty when nothing fell back.
    """

    text: str
    tokens: list[int]
    accepted: int
    finish_reason: str | None
    prompt_tokens: int
    prompt_processed: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    tau: float
    cycles: int
    peak_memory: float
    acceptance: list[float] = field(default_factory=list)
    blocks: dict[int, int] = field(default_factory=dict)
    plain_share: float = 0.0
    copied: int = 0
    siblings: int = 0
    schedule: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def sampling_params(cfg: GenerationConfig, extra: Sequence = ()) -> SamplingParams:
    """The target's sampling law: mlx-lm's filters and logits processors.

    Args:
        cfg: validated decoding settings. extra: processors applied after the config's.
    """
    procs = make_logits_processors(
        cfg.logit_bias,
        cfg.repetition_penalty,
        presence_penalty=cfg.presence_penalty or None,
        frequency_penalty=cfg.frequency_penalty or None,
    )
    return SamplingParams(cfg.temperature, cfg.top_p, cfg.min_p, cfg.top_k, procs + list(extra))


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that could still grow into a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class _TextStream:
    """Detokenized text and the stop-string scan: what can be shown after each cycle.

    Text that could still turn into a stop string is held back until it cannot.
    """

    def __init__(self, detokenizer, stop: str | list[str] | None):
        self.detok = detokenizer
        self.detok.reset()
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        self.stops = [s for s in stops if s]  # "" would end every answer at once: ignored
        self.text, self.emitted = "", 0

    def add(self, tokens: list[int], finish: str | None) -> tuple[str, str | None]:
        """Append tokens; return (the text that may be shown now, finish reason)."""
        for t in tokens:
            self.detok.add_token(t)
        if finish:
            self.detok.finalize()
        self.text += self.detok.last_segment
        if self.stops:
            start = self.emitted
            hits = [self.text.find(s, max(0, start - len(s))) for s in self.stops]
            hits = [h for h in hits if h >= 0]
            if hits:
                self.text, finish = self.text[: min(hits)], "stop"
        end = len(self.text) if finish else len(self.text) - _held_back(self.text, self.stops)
        piece, self.emitted = self.text[self.emitted : end], max(self.emitted, end)
        return piece, finish


def _response(st: RequestStats, text, tokens, accepted, finish) -> GenerationResponse:
    """The GenerationResponse carrying a piece of text and the stats so far."""
    cyc = st.cycles
    return GenerationResponse(
        text=text,
        tokens=tokens,
        accepted=accepted,
        finish_reason=finish,
        prompt_tokens=st.prompt_tokens,
        prompt_processed=st.processed,
        prompt_tps=st.prompt_tps,
        generation_tokens=st.generated,
        generation_tps=st.generation_tps,
        tau=cyc.tau,
        cycles=cyc.cycles,
        peak_memory=mx.get_peak_memory() / 1e9,
        acceptance=cyc.acceptance,
        blocks=cyc.histogram(),
        plain_share=cyc.plain_share,
        copied=cyc.copied,
        siblings=cyc.siblings,
        schedule=list(st.notes),
        timings=dict(st.timings),
        notes=list(st.fallbacks),
    )


def _take(tokens: list[int], eos: set, generated: int, max_tokens: int):
    """(the tokens to emit, finish reason): stop before an EOS, at the token budget."""
    out = []
    for t in tokens:
        if t in eos:
            return out, "stop"
        out.append(t)
        if generated + len(out) >= max_tokens:
            return out, "length"
    return out, None


def eos_ids(tokenizer) -> set[int]:
    """The ids that end a completion: the tokenizer's EOS ids and its end-of-turn tokens."""
    return set(getattr(tokenizer, "eos_token_ids", None) or []) | end_of_turn_ids(tokenizer)


def respond(stats: RequestStats, text: _TextStream, cyc: Cycle, eos: set, max_tokens: int):
    """Count a cycle and turn what it committed into the next GenerationResponse: its
    tokens up to an EOS or the budget, and the text that may be shown now.

    Args:
        stats, text: the request's statistics and text stream. cyc: the cycle.
        eos: ids that end the completion. max_tokens: the request's budget.
    """
    stats.add(cyc)
    tokens, finish = _take(cyc.tokens, eos, stats.generated, max_tokens)
    stats.generated += len(tokens)
    piece, finish = text.add(tokens, finish)
    return _response(stats, piece, tokens, cyc.accepted, finish)


def _scheduler(model, cfg: GenerationConfig, params, context: int):
    """The ``block_size="auto"`` scheduler of one request of ``context`` prompt tokens; the
    first one sets the pair's step costs (``warmup.ensure``: stored and spot-checked, or
    measured)."""
    tuning = across.ensure(model, model.group)  # warmup.ensure, alike on every rank
    selector = cfg.use_selector and model.drafter.has_selector
    seeded = cfg.seed is not None
    return tuning.scheduler(
        params.greedy, selector, seeded=seeded, lookup=cfg.lookup, context=context
    )


def stream_generate(
    model: DFlashModel,
    tokenizer,
    prompt: Prompt,
    *,
    config: GenerationConfig | None = None,
    raw: bool = False,
    system: str | None = None,
    prompt_cache: PromptCache | None = None,
    images: Sequence | None = None,
    profile: bool = False,
    prefill_step_size: int = 2048,
    logits_processors: Sequence | None = None,
    **settings,
) -> Iterator[GenerationResponse]:
    """Stream a completion with DFlash speculative decoding; lossless w.r.t. the target.

    Args:
        model, tokenizer: from ``load``. prompt: str (chat template applied when the
            tokenizer has one, unless raw), list of token ids, or list of chat messages.
        config: decoding settings (default ``GenerationConfig()``).
        raw: skip the chat template for a str. system: system message for a str prompt.
        prompt_cache: reuse across calls (``model.make_cache()``).
        images: images for a vision-language model (``vision.images.Picture``, bytes, a
            path or a ``data:`` URL each): the i-th ``{"type": "image"}`` part of the
            messages, in reading order, is images[i]; a str prompt puts them first.
        profile: time each stage of the cycle into ``timings``.
        prefill_step_size: prompt tokens per target forward. logits_processors: more
            ``(tokens, logits) -> logits`` processors, e.g. a ``grammar.GrammarProcessor``.
        settings: ``GenerationConfig`` fields that override config: max_tokens,
            temperature, top_p, top_k, min_p, presence_penalty, frequency_penalty,
            repetition_penalty, logit_bias, block_size, use_selector, lookup, tree, seed, stop.

    Yields:
        GenerationResponse per committed piece; the last has finish_reason set.

    Raises:
        DFlashError: a bad setting or input type (``inputs.py``), an empty prompt, text
            that is not valid UTF-8, ids outside the vocabulary, a prompt longer than the
            context (``ContextLengthError``; ``max_tokens`` is clamped to the room left).
        ImageError: images sent to a text-only model (kind ``no_vision``), a bad image.
    """
    prompt, system, step = inputs.check_request(prompt, system, prompt_cache, prefill_step_size)
    cfg = inputs.settings_config(config, settings).validate(model.block_size)
    with model.lock:  # the tokenizer and the pair's tuning are shared with other threads
        ids, cfg, vision = request_ids(
            model, tokenizer, prompt, cfg, raw=raw, system=system, images=images
        )
        params = sampling_params(cfg, logits_processors or ())
        sched = _scheduler(model, cfg, params, len(ids)) if cfg.block_size == AUTO else None
    block_size = model.block_size if cfg.block_size in (None, AUTO) else cfg.block_size
    text = _TextStream(tokenizer.detokenizer, cfg.stop)
    stats = RequestStats(len(ids), block_size)
    stats.fallbacks = fallbacks(model, cfg)
    eos = eos_ids(tokenizer)
    cache = inputs.own_cache(model, prompt_cache)
    opts = {"profile": profile, "prefill_step_size": step, "policy": sched, "vision": vision}
    cycles = _decode(model, ids, cache, params, cfg, block_size, **opts)
    yield from _responses(model, cycles, sched, stats, (text, eos, cfg.max_tokens))


def _responses(model, cycles, sched, stats: RequestStats, out: tuple):
    """The responses of a request's decode loop, up to its last; ``out``: (the text
    stream, the EOS ids, max_tokens). The loop is closed however the stream ends."""
    try:
        while (cyc := model.step(cycles)) is not None:  # other threads' steps may interleave
            if sched is not None:
                stats.notes = sched.notes
            r = respond(stats, out[0], cyc, out[1], out[2])
            yield r
            if r.finish_reason:
                return
    finally:
        _finish(model, cycles, sched)


def _finish(model, cycles, sched) -> None:
    """Close a request's decode loop, which tidies the caches up, then fold its ``auto``
    scheduler into the pair's tuning; under the pair's lock, as each step."""
    with model.lock:
        cycles.close()
        if sched is not None:
            model.tuning.finish(sched)


def _decode(model, ids, cache, params, cfg: GenerationConfig, block_size: int, **opts):
    """The decode loop of one request, seeded from its settings; peak memory counts from
    here. opts: ``DecodeOptions``' profile, prefill_step_size, policy and vision."""
    key = mx.random.key(cfg.seed) if cfg.seed is not None else None
    mx.reset_peak_memory()
    opts["policy"] = across.follow(opts.get("policy"), model.group)  # rank 0 decides
    run = DecodeOptions(
        max_tokens=cfg.max_tokens,
        block_size=block_size,
        use_selector=cfg.use_selector,
        key=key,
        lookup=cfg.lookup,
        tree=cfg.tree,
        kv=None if cfg.kv_bits is None else _kv(cfg),
        **opts,
    )
    return memory.decoding(model, decode(model, ids, cache, params, run))  # wired limit


def _kv(cfg: GenerationConfig) -> tuple[int, int, int]:
    """``DecodeOptions.kv`` of a request's settings."""
    return (cfg.kv_bits, cfg.kv_group_size, cfg.quantized_kv_start)


def generate(model: DFlashModel, tokenizer, prompt: Prompt, verbose: bool = False, **kwargs) -> str:
    """Return the whole completion as a string; kwargs as for ``stream_generate``.

    Args:
        verbose: print the text as it streams and the stats at the end.
    """
    out, last = [], None
    for r in stream_generate(model, tokenizer, prompt, **kwargs):
        out.append(r.text)
        last = r
        if verbose:
            print(r.text, end="", flush=True)
    if verbose and last is not None:
        print(
            f"\nprompt {last.prompt_tokens} tok, {last.prompt_tps:.1f} tok/s | generated "
            f"{last.generation_tokens} tok, {last.generation_tps:.1f} tok/s | tau {last.tau:.2f}"
        )
    return "".join(out)
