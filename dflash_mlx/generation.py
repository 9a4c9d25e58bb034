"""Public generation API: ``stream_generate`` and ``generate`` (mlx-lm style)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors

from .acceptance import SamplingParams
from .decode import decode
from .errors import DFlashError
from .state import DFlashModel, PromptCache

Prompt = Union[str, Sequence[int], Sequence[Dict[str, str]]]


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
        cycles: verify cycles so far. peak_memory: GB. acceptance: conditional acceptance
            per block position so far. timings: seconds per stage (profile=True).
    """

    text: str
    tokens: List[int]
    accepted: int
    finish_reason: Optional[str]
    prompt_tokens: int
    prompt_processed: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    tau: float
    cycles: int
    peak_memory: float
    acceptance: List[float] = field(default_factory=list)
    timings: Dict[str, float] = field(default_factory=dict)


def encode_prompt(tokenizer, prompt: Prompt, raw: bool = False, system: Optional[str] = None):
    """Turn a prompt into ids: a str gets the chat template unless raw, messages always
    do, token ids are used as-is.

    Args:
        tokenizer: mlx-lm TokenizerWrapper. prompt: str, list of ids or list of messages.
        raw: skip the chat template for a str. system: optional system message.
    """
    if isinstance(prompt, str):
        has_template = getattr(tokenizer, "chat_template", None) is not None
        if raw or not has_template:
            bos = getattr(tokenizer, "bos_token", None)
            special = bos is None or not prompt.startswith(bos)
            ids = tokenizer.encode(prompt, add_special_tokens=special)
        else:
            msgs = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}
            ]
            ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    elif len(prompt) and isinstance(prompt[0], dict):
        ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True)
    else:
        ids = [int(t) for t in prompt]
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    if not ids:
        raise DFlashError("the prompt is empty; give at least one token of text")
    return list(ids)


def _check(model: DFlashModel, max_tokens, temperature, top_p, top_k, min_p, block_size):
    if temperature is None or temperature < 0:
        raise DFlashError(f"temperature must be >= 0 (got {temperature}); use 0 for greedy")
    if not 0 < top_p <= 1:
        raise DFlashError(f"top_p must be in (0, 1] (got {top_p}); use 1.0 to turn it off")
    if top_k < 0:
        raise DFlashError(f"top_k must be >= 0 (got {top_k}); use 0 to turn it off")
    if not 0 <= min_p <= 1:
        raise DFlashError(f"min_p must be in [0, 1] (got {min_p}); use 0 to turn it off")
    if max_tokens < 1:
        raise DFlashError(f"max_tokens must be at least 1 (got {max_tokens})")
    top = model.block_size
    if not 2 <= block_size <= top:
        raise DFlashError(
            f"block size {block_size} is out of range; this drafter supports 2..{top}"
        )


def _held_back(text: str, stops: List[str]) -> int:
    """Length of the longest suffix of text that could still grow into a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def stream_generate(
    model: DFlashModel,
    tokenizer,
    prompt: Prompt,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: Optional[float] = None,
    logit_bias: Optional[Dict[int, float]] = None,
    block_size: Optional[int] = None,
    use_selector: bool = True,
    seed: Optional[int] = None,
    stop: Optional[Union[str, List[str]]] = None,
    raw: bool = False,
    system: Optional[str] = None,
    prompt_cache: Optional[PromptCache] = None,
    profile: bool = False,
    prefill_step_size: int = 2048,
) -> Iterator[GenerationResponse]:
    """Stream a completion with DFlash speculative decoding; lossless w.r.t. the target.

    Args:
        model, tokenizer: from ``load``. prompt: str (chat template applied when the
            tokenizer has one, unless raw), list of token ids, or list of chat messages.
        max_tokens: generation budget. temperature, top_p, top_k, min_p: mlx-lm sampling.
        presence_penalty, frequency_penalty, repetition_penalty, logit_bias: mlx-lm logits
            processors, applied exactly per block position.
        block_size: tokens per verify (2..checkpoint block size; default the checkpoint's).
        use_selector: False gives DFlash 1 behaviour. seed: makes sampling reproducible.
        stop: stop string(s), not included in the text. prompt_cache: reuse across calls.
        profile: time each stage of the cycle into ``timings``.

    Yields:
        GenerationResponse per committed piece; the last has finish_reason set.
    """
    block_size = model.block_size if block_size is None else int(block_size)
    _check(model, max_tokens, temperature, top_p, top_k, min_p, block_size)
    ids = encode_prompt(tokenizer, prompt, raw, system)
    procs = make_logits_processors(
        logit_bias, repetition_penalty, presence_penalty=presence_penalty or None,
        frequency_penalty=frequency_penalty or None,
    )
    params = SamplingParams(temperature, top_p, min_p, top_k, procs)
    stops = [stop] if isinstance(stop, str) else [s for s in (stop or []) if s]
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
    cache = prompt_cache if prompt_cache is not None else model.make_cache()
    key = mx.random.key(seed) if seed is not None else None
    detok = tokenizer.detokenizer
    detok.reset()
    text, emitted, n_gen, cycles, committed = "", 0, 0, 0, 0
    reached = [0] * block_size
    accepted_at = [0] * block_size
    timings: Dict[str, float] = {}
    tic = time.perf_counter()
    prompt_time, processed = 0.0, 0
    mx.reset_peak_memory()
    for cyc in decode(
        model, ids, cache, params, max_tokens=max_tokens, block_size=block_size,
        use_selector=use_selector, key=key, prefill_step_size=prefill_step_size,
        profile=profile,
    ):
        if cyc.drafted == 0 and cycles == 0 and n_gen == 0:
            prompt_time, processed = time.perf_counter() - tic, cyc.prompt_tokens
            tic = time.perf_counter()
        else:
            cycles += 1
            committed += len(cyc.tokens)
            for k in range(min(cyc.accepted + 1, cyc.drafted)):
                reached[k] += 1
                accepted_at[k] += k < cyc.accepted
        for name, t in cyc.timings.items():
            timings[name] = timings.get(name, 0.0) + t
        finish, new_tokens = None, []
        for t in cyc.tokens:
            if t in eos:
                finish = "stop"
                break
            new_tokens.append(t)
            detok.add_token(t)
            n_gen += 1
            if n_gen >= max_tokens:
                finish = "length"
                break
        if finish:
            detok.finalize()
        text += detok.last_segment
        if stops:
            hits = [(text.find(s, max(0, emitted - len(s))), s) for s in stops]
            hits = [h for h in hits if h[0] >= 0]
            if hits:
                text, finish = text[: min(h[0] for h in hits)], "stop"
        end = len(text) if finish else len(text) - _held_back(text, stops)
        piece, emitted = text[emitted:end], max(emitted, end)
        elapsed = max(time.perf_counter() - tic, 1e-9)
        yield GenerationResponse(
            text=piece,
            tokens=new_tokens,
            accepted=cyc.accepted,
            finish_reason=finish,
            prompt_tokens=len(ids),
            prompt_processed=processed,
            prompt_tps=processed / max(prompt_time, 1e-9),
            generation_tokens=n_gen,
            generation_tps=n_gen / elapsed,
            tau=committed / cycles if cycles else 0.0,
            cycles=cycles,
            peak_memory=mx.get_peak_memory() / 1e9,
            acceptance=[a / r if r else 0.0 for a, r in zip(accepted_at, reached)][
                : block_size - 1
            ],
            timings=dict(timings),
        )
        if finish:
            return


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
