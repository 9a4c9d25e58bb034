"""The speculative decode loop: draft, select, verify, accept (docs/algorithm.md §1-§4).

One host sync per cycle: the whole cycle is built lazily and evaluated once, when the
accepted count is needed to roll the caches back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import mlx.core as mx

from .. import ops
from .acceptance import SamplingParams, process_rows, sample_rows, target_probs
from .lookup import FIXED_MIN_MATCH, Lookup
from .propose import accept, copied_drafts, propose
from .state import DFlashModel, Interrupted, PromptCache
from .tree import siblings as pick_siblings
from .tree import siblings_for
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
    """Prompt tokens per target forward: at most step_size, and small enough that a stop
    request (checked between chunks; MLX cannot stop inside an evaluation) is honoured
    within about a second on the CPU (256 tokens) and on a GPU (512)."""
    cap = 256 if mx.default_device() == mx.cpu else 512
    return max(1, min(step_size, cap))


def prefill(
    model: DFlashModel,
    prompt: list[int],
    cache: PromptCache,
    params: SamplingParams,
    key: mx.array,
    step_size: int = 2048,
) -> tuple[Cycle, mx.array]:
    """Run the uncached part of the prompt through the target, feed its features to the
    drafter's context, and choose the first token.

    The prompt runs in chunks (``prefill_chunk``); after each one the caches hold exactly
    ``cache.tokens``, so stopping between chunks leaves them consistent.

    Args:
        model: the loaded pair. prompt: token ids (at least one). cache: reused if it holds
            a prefix of prompt. params: target sampling. key: PRNG key. step_size: the
            most tokens per target forward.

    Returns:
        (the Cycle holding the first token, the key to continue with).

    Raises:
        Interrupted: ``cache.interrupt`` was set; the caches keep the chunks already run.
    """
    adapter, drafter = model.adapter, model.drafter
    start = done = cache.reuse(model, prompt)
    step = prefill_chunk(step_size)
    clock = _Clock(True)
    while done < len(prompt):
        if cache.interrupt.is_set():
            raise Interrupted(f"stopped after {done - start} of {len(prompt) - start} tokens")
        end = min(done + step, len(prompt))
        cache.busy = True  # caches and cache.tokens disagree until this chunk is evaluated
        logits, feats = adapter(mx.array(prompt[done:end])[None], cache.target)
        drafter.append_context(feats, cache.drafter)
        mx.eval(logits[:, -1], cache.state)
        cache.tokens = list(prompt[:end])
        cache.busy = False
        done = end
    if adapter.is_hybrid:
        cache.checkpoint = (len(prompt), adapter.snapshot(cache.target))
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


def _draft(model, cache, anchor, b, params, use_selector, key, clock, n_sib=0):
    """Draft b - 1 tokens after the anchor [1]: (drafts [b - 1], proposal rows or None,
    the first draft's ``n_sib`` siblings [n_sib] or None; ``tree.py``)."""
    if b < 2:
        return mx.array([], dtype=mx.uint32), None, None
    drafter = model.drafter
    hidden = ops.draft_step(drafter, model.embed_block(anchor, b), cache.drafter)
    d_logits = model.draft_logits(hidden[:, 1:])  # [1, b-1, V'] (V' = V without a draft vocab)
    clock.lap("drafter", d_logits)
    drafts, q_full = propose(model, d_logits, hidden[:, 1:], anchor, params, use_selector, key)
    sibs = pick_siblings(d_logits[0, 0], drafts[0], n_sib, model.to_target) if n_sib else None
    clock.lap("selector", drafts)
    return drafts, q_full, sibs


def cycle(
    model: DFlashModel,
    cache: PromptCache,
    params: SamplingParams,
    history: list[int],
    block_size: int,
    use_selector: bool,
    keys: tuple[mx.array, mx.array],
    profile: bool = False,
    copied: list[int] | None = None,
    siblings: int = 0,
) -> Cycle:
    """One draft - select - verify - accept step after ``history`` (its last id is the anchor).

    Args:
        model, cache, params: as for ``decode``. history: committed ids so far.
        block_size: tokens to verify (the anchor and block_size - 1 drafts).
        use_selector: walk the DFlash 2 lattice. keys: (drafting, acceptance) PRNG keys.
        profile: time each stage (adds syncs).
        copied: block_size - 1 drafts to verify instead of drafting (a context-lookup
            draft, ``lookup.py``); their proposal law is a point mass on each.
        siblings: of the block's drafts, how many are siblings of the first draft instead
            of the path's last ones (a greedy tree, ``tree.py``; 0: the path alone).
    """
    adapter, drafter = model.adapter, model.drafter
    clock = _Clock(profile)
    anchor = history[-1]
    a_arr = mx.array([anchor], dtype=mx.uint32)
    siblings = max(0, min(siblings, block_size - 2))  # a path of at least one draft
    chain = block_size - siblings  # the anchor and the path's drafts
    sibs = None
    if copied is not None:
        drafts, q_full = copied_drafts(copied[: block_size - 1], adapter.vocab_size, params)
    else:
        drafts, q_full, sibs = _draft(
            model, cache, a_arr, chain, params, use_selector, keys[0], clock, siblings
        )
        # the device drafts while the host builds the verify's graph
        mx.async_eval(drafts, *([] if sibs is None else [sibs]))
    cache.busy = True
    taken = 0
    if sibs is not None:  # no logits processors
        a, committed, feats, taken = verify_tree(
            adapter, cache.target, a_arr, drafts, sibs, clock, params, q_full, keys[1]
        )
    else:
        snap = adapter.snapshot(cache.target) if adapter.is_hybrid else None
        v_logits, feats = adapter(mx.concatenate([a_arr, drafts])[None], cache.target)
        clock.lap("verify", v_logits, feats)
        n_acc, bonus = accept(v_logits, history, drafts, q_full, params, keys[1])
        mx.eval(n_acc, bonus, drafts)  # the cycle's one host sync
        a = n_acc.item()
        committed = drafts.tolist()[:a] + [bonus.item()]
        clock.lap("acceptance")
        adapter.rollback(cache.target, block_size, a + 1, snap)
        feats = feats[:, : a + 1]
    drafter.append_context(feats, cache.drafter, lazy=False)
    cache.tokens += [anchor] + committed[:-1]
    # Roll back / append on the device while the host builds the next cycle.
    mx.async_eval(cache.state)
    clock.lap("rollback", cache.state)
    cache.busy = False
    n_sib = 0 if sibs is None else siblings
    return Cycle(
        committed, a, block_size - 1, timings=dict(clock.split), siblings=n_sib, sibling=taken
    )


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
    adapter = model.adapter
    feats: list[mx.array] = []

    def step(tok: mx.array, k) -> mx.array:
        logits, f = adapter(tok.reshape(1, 1), cache.target)
        feats.append(f)
        row = logits[0, -1:]  # [1, V]
        nxt = (
            mx.argmax(row, axis=-1) if params.greedy else sample_rows(target_probs(row, params), k)
        )
        return nxt.astype(mx.uint32)

    def tidy():
        if feats:
            model.drafter.append_context(mx.concatenate(feats, axis=1), cache.drafter)
            mx.async_eval(cache.state)
        cache.busy = False

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
        tidy()
        raise
    tidy()  # any other exception leaves cache.busy set: the next request starts over


def decode(
    model: DFlashModel,
    prompt: list[int],
    cache: PromptCache,
    params: SamplingParams,
    *,
    max_tokens: int,
    block_size: int,
    use_selector: bool = True,
    key: mx.array | None = None,
    prefill_step_size: int = 2048,
    profile: bool = False,
    scheduler=None,
    lookup: bool = True,
    tree: bool = True,
) -> Iterator[Cycle]:
    """Generate from a prompt with speculative decoding; yields one Cycle per step.

    Args:
        model: the loaded pair. prompt: token ids (at least one). cache: reused if it
            holds a prefix of prompt. params: target sampling. max_tokens: budget.
        block_size: tokens verified per cycle (anchor + block_size - 1 drafts); ignored
            when a scheduler chooses.
        use_selector: walk the DFlash 2 lattice; False drafts each row's top token.
        key: PRNG key for sampling. profile: time each stage (adds syncs).
        scheduler: a ``schedule.Scheduler`` (``block_size="auto"``) choosing each cycle's
            block from the past only, so every schedule is lossless; None: fixed blocks.
        lookup: verify context-lookup drafts (``lookup.py``) when the committed tokens have
            a match: with a scheduler when it expects them to pay, else for a match of at
            least ``FIXED_MIN_MATCH`` tokens.
        tree: without logits processors, on a target that can, verify the first draft's
            siblings beside the path (``tree.py``).
    """
    key = mx.random.key(int(time.time_ns() % 2**31)) if key is None else key
    with mx.stream(generation_stream()):
        first, key = prefill(model, prompt, cache, params, key, prefill_step_size)
        yield first
        history = list(prompt) + first.tokens
        index = Lookup(history) if lookup else None
        use_tree = tree and not params.processors
        use_tree = use_tree and model.adapter.can_tree(cache.target)
        if scheduler is not None:
            scheduler.tree = use_tree
        n_gen, t_last, switched = 1, time.perf_counter(), False
        while n_gen < max_tokens:
            budget = max_tokens - n_gen
            copied, match = index.propose(model.block_size - 1) if index else ([], 0)
            choice = scheduler.choose(budget, match) if scheduler is not None else None
            b = choice.block if choice else max(1, min(block_size, budget))
            use = choice.lookup if choice else match >= FIXED_MIN_MATCH and b > 1
            key, k_draft, k_acc = mx.random.split(key, 3)
            if b == 1 and choice and not params.processors:
                n = min(budget, scheduler.plain_run())
                run = _plain_run(model, cache, params, history, index, scheduler, n, k_draft)
                ran, t_last = yield from run
                n_gen += ran
                switched = ran > 0
                continue
            keys = (k_draft, k_acc)
            n_sib = 0 if use or not use_tree else choice.siblings if choice else siblings_for(b)
            copy = copied if use else None
            step = cycle(model, cache, params, history, b, use_selector, keys, profile, copy, n_sib)
            step.lookup = match if use else 0
            # a drafted cycle right after plain steps also catches the drafter up on them:
            # a cost of switching, not of the block, so it is not a cost sample
            t_last = _timed(scheduler, b, step, t_last, sample=use or not switched)
            switched = False
            history += step.tokens
            if index is not None:
                index.extend(step.tokens)
            n_gen += len(step.tokens)
            yield step


def _plain_run(model, cache, params, history, index, scheduler, n, key):
    """Up to ``n`` plain steps for ``decode`` (history and index extended in place); returns
    (steps run, the time of the last). The scheduler gets the run's cost per step, from
    its start to its last token: the gaps between tokens are no step's cost (the first
    also fills the pipeline, the last is nearly free)."""
    until = None if index is None else lambda: scheduler.copy_pays(index.match()[0])
    steps = plain_steps(model, cache, params, history, n, key, until)
    ran, start = 0, time.perf_counter()
    t_last = start
    try:
        for step in steps:
            t_last = _timed(scheduler, 1, step, t_last, sample=False)
            history += step.tokens
            if index is not None:
                index.extend(step.tokens)
            ran += 1
            yield step
    finally:
        steps.close()  # closed early: its caches are tidied before ours are read
    if ran > 1:  # one step is mostly the switch's pipeline fill
        scheduler.observe(1, (t_last - start) / ran)
    return ran, t_last


def _timed(scheduler, block, step, since, sample=True) -> float:
    """Give the scheduler a step's wall time (from the previous step's result to this one,
    consumer time included, as it is for every block size; none for a plain step, whose
    run is timed whole, or a drafted cycle right after plain steps, which pays for the
    switch); return now."""
    now = time.perf_counter()
    if scheduler is not None:
        seconds = now - since if sample else None
        scheduler.record(block, step.accepted, seconds, step.lookup, step.siblings, step.sibling)
    return now
