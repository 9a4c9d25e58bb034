"""Continuous batching: ``BatchGenerator`` (requests join and leave between cycles, each with
its own settings, seed, stop strings and statistics) and ``batch_generate`` (mlx-lm style).

Text targets decode on ``batch.BatchDecoder`` (a hybrid's recurrent rows are rewound each by
its own count); a vision-language target's caches carry one request's images, so its
requests are decoded one at a time, in arrival order, through ``stream_generate`` (same
interface, no batching), as are all with ``solo=True``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import mlx.core as mx

from . import inputs
from .decoding.batch import BatchDecoder, Row, check_kv
from .decoding.batch_auto import BatchCosts, BatchPlanner
from .decoding.state import DFlashModel, PromptCache
from .decoding.stats import RequestStats
from .decoding.steps import generation_stream
from .distributed import policy as across
from .errors import DFlashError
from .generation import (
    GenerationResponse,
    Prompt,
    _scheduler,
    _TextStream,
    eos_ids,
    request_ids,
    respond,
    sampling_params,
    stream_generate,
)
from .settings import AUTO, GenerationConfig
from .vision.notes import batch_note, vision_language


def one_at_a_time(model: DFlashModel) -> bool:
    """Whether a batch decodes this pair's requests one at a time (``stream_generate``, and
    its ``auto`` the warm-up's cost tables): a vision-language target's caches carry one
    request's images."""
    return vision_language(model)


@dataclass
class _Request:
    """A request's per-row bookkeeping around its decoder row."""

    row: Row
    text: _TextStream
    stats: RequestStats
    max_tokens: int
    plain: bool | None = None  # the kind of its last planned cycle (auto rows)


class BatchGenerator:
    """Decode many requests together; ``insert`` them at any time and ``step`` until done.

    Args:
        model, tokenizer: from ``load``.
        max_batch: rows decoding at once; more requests wait, in arrival order.
        prefill_step_size: prompt tokens per prefill chunk (a joining prompt stalls the
            running rows for one chunk per cycle).
        solo: decode one request at a time through ``stream_generate``, as a
            vision-language target does (its requests may then set ``kv_bits``: a shared
            batch cache is not quantized).
    """

    def __init__(
        self,
        model: DFlashModel,
        tokenizer,
        max_batch: int = 8,
        prefill_step_size=2048,
        solo: bool = False,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.max_batch = inputs.check_count(max_batch, "max_batch")
        step = inputs.check_count(prefill_step_size, "prefill_step_size")
        self.one_by_one = solo or one_at_a_time(model)  # (solo: a one-row batch across ranks)
        self.decoder = None if self.one_by_one else BatchDecoder(model, model.block_size, step)
        self.planner: BatchPlanner | None = None  # made with the first auto row
        self.waiting: list[tuple[Row, PromptCache, _Request]] = []
        self.requests: dict[int, _Request] = {}
        self.solo: dict[int, Iterator[GenerationResponse]] = {}  # one at a time
        self.solo_note = batch_note(model, self.max_batch)  # said in each response's notes
        self.eos = eos_ids(tokenizer)
        self._uids = itertools.count()

    def insert(
        self,
        prompt: Prompt,
        config: GenerationConfig | None = None,
        *,
        cache: PromptCache | None = None,
        raw: bool = False,
        system: str | None = None,
        processors: Sequence = (),
        images: Sequence | None = None,
        **settings,
    ) -> int:
        """Queue a request; return its uid.

        Args:
            prompt, config, raw, system, settings: as for ``stream_generate``.
            processors: extra logits processors of this row (e.g. a grammar,
                ``dflash_mlx.decoding.grammar``), applied after the config's at every block row.
            cache: a prompt cache whose prefix the prefill may reuse (it is copied into the
                batch, then left holding this prompt).
            images: as for ``stream_generate`` (a vision-language target decodes its
                requests one at a time).

        Raises:
            DFlashError: as ``stream_generate`` (bad settings, a prompt of another type or
                that does not fit), at once.
        """
        prompt, system, _ = inputs.check_request(prompt, system, cache, 1, self.model)
        cfg = inputs.settings_config(config, settings).validate(self.model.block_size)
        with self.model.lock:  # the tokenizer is shared with other threads
            kw = {"raw": raw, "system": system, "images": images}
            ids, cfg, vision = request_ids(self.model, self.tokenizer, prompt, cfg, **kw)
        if not self.one_by_one:
            check_kv(cfg.kv_bits)
        uid = next(self._uids)
        if self.one_by_one:  # the prompt is encoded and checked: its ids, with its settings
            self.solo[uid] = stream_generate(
                self.model,
                self.tokenizer,
                ids if vision is None else prompt,
                config=cfg,
                prompt_cache=cache,
                logits_processors=list(processors),
                **({} if vision is None else kw),
            )
            return uid
        block = None if cfg.block_size == AUTO else (cfg.block_size or self.model.block_size)
        seed = cfg.seed if cfg.seed is not None else (time.time_ns() + uid) % 2**31
        params = sampling_params(cfg, processors)
        key = mx.random.key(seed)
        row = Row(uid, ids, params, cfg.max_tokens, block, cfg.use_selector, key, cfg.lookup)
        if block is None:  # auto: the row's acceptance, learnt as a request alone learns it
            with self.model.lock:
                row.sched = _scheduler(self.model, cfg, params, len(ids))
            self.planner = self.planner or _planner(self.model)  # rank 0's under a group
        stats = RequestStats(len(ids), block or self.model.block_size)
        text = _TextStream(self.tokenizer.detokenizer, cfg.stop)
        self.waiting.append((row, cache, _Request(row, text, stats, cfg.max_tokens)))
        return uid

    def remove(self, uid: int) -> None:
        """Abort a request (waiting, joining or decoding); its row leaves the batch."""
        self.waiting = [w for w in self.waiting if w[0].uid != uid]
        self.requests.pop(uid, None)
        with self.model.lock:
            gen = self.solo.pop(uid, None)
            if gen is not None:
                gen.close()
            if self.decoder is not None:
                self.decoder.remove(uid)

    @property
    def occupancy(self) -> int:
        """Rows decoding or prefilling now."""
        if self.one_by_one:
            return min(1, len(self.solo))
        return len(self.decoder) + len(self.decoder.joining)

    def __len__(self) -> int:
        """Requests not finished yet (waiting included)."""
        return len(self.solo) + len(self.waiting) + len(self.requests)

    def step(self) -> list[tuple[int, GenerationResponse]]:
        """Admit waiting requests while there is room, run one prefill chunk of a joining
        request and one cycle of the batch; return (uid, response) for every piece produced.
        A response with ``finish_reason`` set is its request's last. Threads sharing the
        model take turns: a step holds its lock."""
        with self.model.turn():
            return self._solo_step() if self.one_by_one else self._step()

    def _step(self) -> list[tuple[int, GenerationResponse]]:
        dec = self.decoder
        while self.waiting and self.occupancy < self.max_batch:
            row, cache, req = self.waiting.pop(0)
            req.stats.tic = time.perf_counter()
            dec.join(row, cache)
            self.requests[row.uid] = req
        out = []
        with mx.stream(generation_stream()):
            got = dec.prefill_step()
            if got is not None:
                out += self._emit(*got)
            rows = list(dec.rows)
            plan = self._plan(rows)
            tic = time.perf_counter()
            cycles = dec.step(plan)
            if plan and cycles:
                self.planner.record(rows, plan, cycles, time.perf_counter() - tic)
            for row, cyc in cycles:
                out += self._emit(row, cyc)
        return out

    def _plan(self, rows: list[Row]):
        """The planner's per-row options when a row is auto (None: fixed blocks only); a
        row's schedule notes say the plan when its kind (plain or not) changes."""
        if not any(r.sched is not None for r in rows):
            return None
        plan = self.planner.plan(rows)
        said = self.planner.describe(rows, plan)
        for r, o in zip(rows, plan):
            req = self.requests.get(r.uid)
            plain = o.block == 1
            if req is not None and req.plain != plain and len(req.stats.notes) < 20:
                req.stats.notes.append(f"step {r.generated}: {said}")
                req.plain = plain
        return plan

    def _emit(self, row: Row, cyc) -> list[tuple[int, GenerationResponse]]:
        req = self.requests.get(row.uid)
        if req is None:
            return []
        r = respond(req.stats, req.text, cyc, self.eos, req.max_tokens)
        if r.finish_reason:
            if row.sched is not None:  # its acceptance: the next request's prior
                self.model.tuning.finish(row.sched)
            self.remove(row.uid)
        return [(row.uid, r)]

    def _solo_step(self) -> list[tuple[int, GenerationResponse]]:
        if not self.solo:
            return []
        uid = next(iter(self.solo))
        r = next(self.solo[uid], None)
        if r is not None and self.solo_note:
            r.notes.append(self.solo_note)
        if r is None or r.finish_reason:
            self.solo.pop(uid).close()
        return [] if r is None else [(uid, r)]


def _planner(model: DFlashModel) -> BatchPlanner:
    """The batch's auto planner, its costs seeded by the pair's warm-up tables."""
    tables = model.tuning.tables()
    costs = BatchCosts(tables["seconds"], tables.get("lookup_seconds"))
    # under mlx.launch rank 0's plans (its clock), so every rank steps alike
    return across.follow_plans(BatchPlanner(costs, model.block_size), model.group)


@dataclass
class BatchResponse:
    """What ``batch_generate`` returns.

    Attributes:
        texts: the completions, in prompt order. responses: each prompt's last
            GenerationResponse (its statistics). seconds: wall time of the whole batch.
    """

    texts: list[str]
    responses: list[GenerationResponse]
    seconds: float


def _per_prompt(images, n: int) -> list:
    """``batch_generate``'s images: one entry per prompt (None entries: no images).

    Raises:
        DFlashError: not a list or tuple of ``n`` entries.
    """
    if images is None:
        return [None] * n
    if not isinstance(images, (list, tuple)) or len(images) != n:
        got = (
            f"{len(images)} entries" if isinstance(images, (list, tuple)) else type(images).__name__
        )
        raise DFlashError(
            f"images must be a list with one entry per prompt ({n}; None for a prompt "
            f"without images), got {got}"
        )
    return list(images)


def batch_generate(
    model: DFlashModel,
    tokenizer,
    prompts: Sequence[Prompt],
    *,
    config: GenerationConfig | None = None,
    configs: Sequence[GenerationConfig | None] | None = None,
    max_batch: int = 8,
    raw: bool = False,
    system: str | None = None,
    images: Sequence | None = None,
    verbose: bool = False,
    **settings,
) -> BatchResponse:
    """Generate completions for many prompts at once with batched speculative decoding;
    each completion is what ``generate`` returns for its prompt alone (greedy: token for token).

    Args:
        model, tokenizer: from ``load``. prompts: a list (or tuple), each prompt as for
            ``stream_generate``. config: settings for every prompt; configs: one per prompt
            (None entries use config), or one GenerationConfig for all.
        max_batch: rows decoding at once. raw, system: as for ``stream_generate``.
        images: one entry per prompt, each what ``stream_generate`` takes as ``images``
            (None: a prompt without): a vision-language target answers them one at a time.
        verbose: print the aggregate speed at the end.
        settings: ``GenerationConfig`` fields that override config for every prompt.

    Raises:
        DFlashError: a bad setting or prompt, configs not one per prompt, a max_batch that
            is not an int >= 1 (nothing is generated then).
    """
    prompts = inputs.check_prompts(prompts)
    configs = inputs.check_configs(configs, len(prompts), config)
    images = _per_prompt(images, len(prompts))
    gen = BatchGenerator(model, tokenizer, max_batch)
    tic = time.perf_counter()
    uids = [
        gen.insert(p, c, raw=raw, system=system, images=i, **settings)
        for p, c, i in zip(prompts, configs, images, strict=True)
    ]
    texts: dict[int, list[str]] = {u: [] for u in uids}
    last: dict[int, GenerationResponse] = {}
    while len(gen):
        for uid, r in gen.step():
            texts[uid].append(r.text)
            last[uid] = r
    out = BatchResponse(
        ["".join(texts[u]) for u in uids], [last[u] for u in uids], time.perf_counter() - tic
    )
    if verbose:
        n = sum(r.generation_tokens for r in out.responses)
        print(
            f"{len(uids)} prompts, {n} tokens in {out.seconds:.1f} s "
            f"({n / max(out.seconds, 1e-9):.1f} tok/s)"
        )
    return out
