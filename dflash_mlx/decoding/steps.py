"""The decode loop's steps (docs/algorithm.md §1-§4): the prefill, one draft - select -
verify - accept cycle, and a run of plain target steps.

One host sync per cycle: the whole cycle is built lazily and evaluated once, when the
accepted count is needed to roll the caches back. ``loop.py`` strings them together.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import mlx.core as mx

from .. import ops
from .acceptance import SamplingParams, process_rows, sample_rows, target_probs
from .policy import Choice
from .propose import accept, copied_drafts, propose
from .state import DFlashModel, Interrupted, PromptCache
from .tree import siblings as pick_siblings
from .tree import verify as verify_tree

_local = threading.local()


def generation_stream() -> mx.Stream:
    """A dedicated stream for the decode loop, one per thread (MLX streams are per thread)."""
    if getattr(_local, "stream", None) is None:
        _local.stream = mx.new_stream(mx.default_device())
    return _local.stream


@dataclass
class Cycle:
    """What one step of the loop committed.

    Attributes:
        tokens: ids committed (accepted drafts then the target's bonus token).
        accepted: drafts accepted. drafted: drafts proposed.
        prompt_tokens: prompt tokens run through the target (prefill event only).
        timings: seconds per stage when profiling.
        lookup: length of the context-lookup match the drafts were copied after (0: the
            drafter drafted them, or a plain step).
        siblings: siblings of the first draft verified beside the path (``tree.py``).
        sibling: the 1-based rank of the sibling committed (0: none).
    """

    tokens: list[int]
    accepted: int = 0
    drafted: int = 0
    prompt_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    lookup: int = 0
    siblings: int = 0
    sibling: int = 0

    @property
    def reached(self) -> int:
        """Draft positions this cycle's path reached: up to the first rejection, within its
        path (a tree's is shorter than its block); a taken sibling ends it at the first."""
        return 1 if self.sibling else min(self.accepted + 1, self.drafted - self.siblings)


class _Clock:
    """Stage timer; evaluates at stage boundaries only when profiling."""

    def __init__(self, on: bool):
        self.on, self.t, self.split = on, time.perf_counter(), {}

    def lap(self, name: str, *arrays) -> None:
        if self.on:
            mx.eval(*arrays)
            now = time.perf_counter()
            self.split[name] = self.split.get(name, 0.0) + now - self.t
            self.t = now


def prefill_chunk(step_size: int) -> int:
    """Prompt tokens per target forward: at most step_size; on the CPU at most 256, small
    enough that a stop request (checked between chunks; MLX cannot stop inside an
    evaluation) is honoured within about a second, and measured no slower than larger
    chunks there. A GPU takes mlx-lm's whole ``prefill_step_size`` (2048 by default)."""
    cap = 256 if mx.default_device() == mx.cpu else step_size
    return max(1, min(step_size, cap))


def prefill(
    model: DFlashModel,
    prompt: list[int],
    cache: PromptCache,
    params: SamplingParams,
    key: mx.array,
    step_size: int = 2048,
    kv: tuple[int, int, int] | None = None,
    vision=None,
) -> tuple[Cycle, mx.array]:
    """Run the uncached part of the prompt through the target, feed its features to the
    drafter's context, and choose the first token.

    The prompt runs in chunks (``prefill_chunk``); after each one the caches hold exactly
    ``cache.tokens``, so stopping between chunks leaves them consistent. The target's head
    runs on the last prompt row only: a chunk evaluates the caches and the features.

    Args:
        model: the loaded pair. prompt: token ids (at least one). cache: reused if it holds
            a prefix of prompt. params: target sampling. key: PRNG key. step_size: the
            most tokens per target forward. kv: (bits, group size, quantized_kv_start) to
            quantize the target's attention caches as mlx-lm would with this step_size.
            vision: the prompt's images (``vision/prompt.py``): the cache matches on its
            keys (an image's rows by its hash) and the target merges its features.

    Returns:
        (the Cycle holding the first token, the key to continue with). Raises
        ``Interrupted`` when ``cache.interrupt`` was set (the chunks run are kept).
    """
    adapter, drafter, keys = model.adapter, model.drafter, getattr(vision, "keys", prompt)
    cache.set_kv(model, kv, len(prompt), step_size)
    start = done = cache.reuse(model, keys)
    adapter.prepare(cache.target, vision)
    step = prefill_chunk(step_size)
    clock = _Clock(True)
    while done < len(prompt):
        if cache.interrupt.is_set():
            raise Interrupted(f"stopped after {done - start} of {len(prompt) - start} tokens")
        end = done + cache.room(min(step, len(prompt) - done))  # stops at a KV conversion
        cache.busy = True  # caches and cache.tokens disagree until this chunk is evaluated
        logits, feats = adapter(mx.array(prompt[done:end])[None], cache.target, last=True)
        drafter.append_context(feats, cache.drafter)
        cache.quantize()
        mx.eval(cache.state, feats, *([logits[:, -1]] if end == len(prompt) else []))
        cache.tokens = list(keys[:end])
        cache.busy = False
        done = end
    if adapter.is_hybrid:
        cache.checkpoint = (len(prompt), adapter.snapshot(cache.target, arm=False))
    last = process_rows(
        logits[0, -1:], mx.array(prompt), mx.array([], mx.uint32), params.processors
    )
    key, sub = mx.random.split(key)
    if params.greedy:
        first = mx.argmax(last, axis=-1)
    else:
        first = sample_rows(target_probs(last, params), sub)
    anchor = first.item()
    clock.lap("prefill")
    return Cycle([anchor], prompt_tokens=len(prompt) - start, timings=dict(clock.split)), key


def _draft(model, cache, params, anchor, chain, n_sib, key, clock, selector=True):
    """Draft chain - 1 tokens after the anchor [1]: (drafts [chain - 1], proposal rows or
    None, the first draft's ``n_sib`` siblings [n_sib] or None; ``tree.py``)."""
    if chain < 2:
        return mx.array([], dtype=mx.uint32), None, None
    hidden = ops.draft_step(model.drafter, model.embed_block(anchor, chain), cache.drafter)
    d_logits = model.draft_logits(hidden[:, 1:])  # [1, b-1, V'] (V' = V without a draft vocab)
    clock.lap("drafter", d_logits)
    drafts, q_full = propose(model, d_logits, hidden[:, 1:], anchor, params, selector, key)
    sibs = pick_siblings(d_logits[0, 0], drafts[0], n_sib, model.to_target) if n_sib else None
    clock.lap("selector", drafts)
    return drafts, q_full, sibs


def _verify_path(model, cache, params, history, a_arr, drafts, q_full, key, clock):
    """Verify the anchor and its drafts as one chain and roll the caches back to what the
    target accepts: (accepted, committed ids, the kept rows' features)."""
    adapter = model.adapter
    snap = adapter.snapshot(cache.target) if adapter.is_hybrid else None
    v_logits, feats = adapter(mx.concatenate([a_arr, drafts])[None], cache.target)
    clock.lap("verify", v_logits, feats)
    n_acc, bonus = accept(v_logits, history, drafts, q_full, params, key)
    mx.eval(n_acc, bonus, drafts)  # the cycle's one host sync
    a = n_acc.item()
    committed = drafts.tolist()[:a] + [bonus.item()]
    clock.lap("acceptance")
    adapter.rollback(cache.target, drafts.size + 1, a + 1, snap)
    return a, committed, feats[:, : a + 1]


def cycle(
    model: DFlashModel,
    cache: PromptCache,
    params: SamplingParams,
    history: list[int],
    choice: Choice,
    keys: tuple[mx.array, mx.array],
    copied: list[int] | None = None,
    *,
    selector: bool = True,
    profile: bool = False,
) -> Cycle:
    """One draft - select - verify - accept step after ``history`` (its last id is the anchor).

    Args:
        model, cache, params: as for ``decode``. history: committed ids so far.
        choice: the block (the anchor and ``choice.block - 1`` drafts to verify) and, of
            those drafts, how many are siblings of the first one instead of the path's
            last ones (a greedy tree, ``tree.py``; ignored for copied drafts).
        keys: (drafting, acceptance) PRNG keys.
        copied: ``choice.block - 1`` drafts to verify instead of drafting (a context-lookup
            draft, ``lookup.py``); their proposal law is a point mass on each.
        selector: walk the DFlash 2 lattice. profile: time each stage (adds syncs).
    """
    clock = _Clock(profile)
    block, anchor = choice.block, history[-1]
    a_arr = mx.array([anchor], dtype=mx.uint32)
    # a path of at least one draft; a draft vocabulary of V' ids has V' - 1 siblings at most
    n_sib = max(0, min(choice.siblings, block - 2, model.draft_size - 1))
    sibs = None
    if copied is not None:
        n_sib = 0
        drafts, q_full = copied_drafts(copied[: block - 1], model.adapter.vocab_size, params)
    else:
        drafts, q_full, sibs = _draft(
            model, cache, params, a_arr, block - n_sib, n_sib, keys[0], clock, selector
        )
        # the device drafts while the host builds the verify's graph
        mx.async_eval(drafts, *([] if sibs is None else [sibs]))
    cache.busy = True
    taken = 0
    if sibs is not None:  # no logits processors
        a, committed, feats, taken = verify_tree(
            model.adapter, cache.target, a_arr, drafts, sibs, clock, params, q_full, keys[1]
        )
    else:
        n_sib = 0
        a, committed, feats = _verify_path(
            model, cache, params, history, a_arr, drafts, q_full, keys[1], clock
        )
    clock.lap("rollback", [c.state for c in cache.target])  # the target holds the kept rows
    ops.append_context(model.drafter, feats, cache.drafter)
    cache.tokens += [anchor] + committed[:-1]
    cache.quantize()
    # Roll back / append on the device while the host builds the next cycle.
    mx.async_eval(cache.state)
    clock.lap("drafter", cache.state)  # the kept rows' features into the drafter's context
    cache.busy = False
    return Cycle(committed, a, block - 1, timings=dict(clock.split), siblings=n_sib, sibling=taken)


def plain_steps(
    model: DFlashModel,
    cache: PromptCache,
    params: SamplingParams,
    history: list[int],
    n: int,
    key: mx.array,
    until=None,
) -> Iterator[Cycle]:
    """``n`` plain target steps (no drafting) after ``history``, pipelined like mlx-lm's
    ``generate_step``: the next step is queued before the current token is read.

    The drafter is not run, but its context must stay current so speculation can resume:
    the features of the fed tokens are appended in one batch when the run ends (or is
    closed early). No logits processors here: with them ``cycle`` runs one step at a time.

    Args:
        model, cache, params: as for ``decode`` (params without processors).
        history: committed ids; the last is fed first. n: steps. key: PRNG key.
        until: called before each next step is queued (the tokens read so far are
            consumed); True ends the run after the step already queued, so stopping early
            wastes no step.
    """
    feats: list[mx.array] = []  # the fed tokens' target features, for the drafter

    def step(tok: mx.array, k) -> mx.array:
        return _plain_step(model, cache, params, tok, k, feats)

    keys = mx.random.split(key, n)
    cache.busy = True  # the drafter context lags until the run ends
    try:
        y = step(mx.array([history[-1]], mx.uint32), keys[0])
        mx.async_eval(y)
        cache.tokens.append(history[-1])
        for i in range(n):
            nxt = None
            if i + 1 < n and not (until is not None and until()):
                nxt = step(y, keys[i + 1])
                mx.async_eval(nxt)
            tok = y.item()
            if nxt is not None:
                cache.tokens.append(tok)  # queued for feeding already
            yield Cycle([tok])
            if nxt is None:
                break
            y = nxt
    except GeneratorExit:  # closed between steps: the caches are consistent, tidy them up
        _catch_up(model, cache, feats)
        raise
    _catch_up(model, cache, feats)  # any other exception leaves cache.busy set: start over


def _plain_step(model, cache, params, tok: mx.array, key, feats: list) -> mx.array:
    """Queue one plain target step on ``tok`` [1]: the next token [1] uint32 (lazy); its
    features go to ``feats``."""
    logits, f = model.adapter(tok.reshape(1, 1), cache.target)
    cache.quantize()
    feats.append(f)
    row = logits[0, -1:]  # [1, V]
    nxt = mx.argmax(row, axis=-1) if params.greedy else sample_rows(target_probs(row, params), key)
    return nxt.astype(mx.uint32)


def _catch_up(model, cache, feats: list) -> None:
    """Append a plain run's features to the drafter's context in one batch."""
    if feats:
        model.drafter.append_context(mx.concatenate(feats, axis=1), cache.drafter)
        mx.async_eval(cache.state)
    cache.busy = False
