"""The speculative decode loop (docs/algorithm.md §1): prefill, then cycles of draft,
select, verify and accept, each block chosen by a policy (``policy.py``); the steps
themselves are in ``steps.py``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import mlx.core as mx

from .acceptance import SamplingParams
from .lookup import Lookup
from .policy import FixedBlock, Pace
from .state import DFlashModel, PromptCache
from .steps import Cycle, cycle, generation_stream, plain_steps, prefill


@dataclass(frozen=True)
class DecodeOptions:
    """How ``decode`` runs, besides the sampling law (``SamplingParams``).

    Attributes:
        max_tokens: tokens to generate (the prefill's first one included).
        block_size: tokens per verify of a fixed policy (the anchor and block_size - 1
            drafts); None: the drafter checkpoint's. Ignored when ``policy`` is given.
        policy: chooses each cycle's block (``schedule.Scheduler`` for ``"auto"``, which
            may also choose plain steps); None: ``FixedBlock(block_size)``.
        use_selector: walk the DFlash 2 lattice; False drafts each row's top token.
        lookup: verify context-lookup drafts (``lookup.py``) when the policy chooses them.
        tree: without logits processors, on a target that can, verify the first draft's
            siblings beside the path (``tree.py``).
        key: PRNG key for sampling (None: drawn from the clock).
        prefill_step_size: the most prompt tokens per target forward (and mlx-lm's
            ``prefill_step_size`` where the KV cache is quantized).
        kv: (kv_bits, kv_group_size, quantized_kv_start): quantize the target's attention
            caches where mlx-lm's ``generate_step`` would (``state.convert_at``); None: off.
        profile: time each stage of a cycle (adds syncs).
        vision: the prompt's images (``vision/prompt.py``), or None.
    """

    max_tokens: int
    block_size: int | None = None
    policy: object | None = None
    use_selector: bool = True
    lookup: bool = True
    tree: bool = True
    key: mx.array | None = None
    prefill_step_size: int = 2048
    profile: bool = False
    kv: tuple[int, int, int] | None = None
    vision: object | None = None


def decode(
    model: DFlashModel,
    prompt: list[int],
    cache: PromptCache,
    params: SamplingParams,
    opts: DecodeOptions,
) -> Iterator[Cycle]:
    """Generate from a prompt with speculative decoding; yields one Cycle per step.

    Args:
        model: the loaded pair. prompt: token ids (at least one). cache: reused if it
            holds a prefix of prompt. params: target sampling. opts: everything else.
    """
    key = mx.random.key(int(time.time_ns() % 2**31)) if opts.key is None else opts.key
    policy = opts.policy or FixedBlock(opts.block_size or model.block_size)
    policy.tree = opts.tree and not params.processors and model.adapter.can_tree(cache.target)
    with mx.stream(generation_stream()):
        step = opts.prefill_step_size
        first, key = prefill(model, prompt, cache, params, key, step, opts.kv, opts.vision)
        yield first
        history = list(prompt) + first.tokens
        index = Lookup(history) if opts.lookup else None
        pace = Pace(policy)
        while (budget := opts.max_tokens - (len(history) - len(prompt))) > 0:
            copied, match = index.propose(model.block_size - 1) if index else ([], 0)
            choice = policy.choose(cache.room(budget), match)
            key, k_draft, k_acc = mx.random.split(key, 3)
            run = policy.plain_run() if choice.block == 1 and not params.processors else 0
            if run:
                until = None if index is None else lambda: policy.copy_pays(index.match()[0])
                steps = plain_steps(model, cache, params, history, min(budget, run), k_draft, until)
                yield from _plain_run(steps, history, index, pace)
                continue
            keys, copy = (k_draft, k_acc), copied if choice.lookup else None
            kw = {"selector": opts.use_selector, "profile": opts.profile}
            step = cycle(model, cache, params, history, choice, keys, copy, **kw)
            step.lookup = match if choice.lookup else 0
            pace.cycle(choice, step)
            _commit(step, history, index)
            yield step


def _commit(step: Cycle, history: list[int], index: Lookup | None) -> None:
    history += step.tokens
    if index is not None:
        index.extend(step.tokens)


def _plain_run(steps, history: list[int], index: Lookup | None, pace: Pace):
    """Yield a run of plain steps (``steps.plain_steps``), ended early when the policy
    expects the lookup draft of a new match to pay."""
    ran, start = 0, time.perf_counter()
    try:
        for step in steps:
            pace.plain_step(step)
            _commit(step, history, index)
            ran += 1
            yield step
    finally:
        steps.close()  # closed early: its caches are tidied before ours are read
    pace.plain_run(ran, start)
