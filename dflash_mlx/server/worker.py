"""The generation worker of ``dflash_mlx.server``: a bounded FIFO of jobs served in the thread
that calls ``Engine.run`` (MLX streams are per thread; the decode loop makes its own on first
use there), with cancellation at the next cycle. Each job takes the prompt cache that shares
the longest prefix with it out of a pool (``prompt_cache.PromptPool``) and gives it back
when its caches are done with: at its end, or once its prefill is merged into a batch.

With ``max_batch`` > 1 (the default) up to that many jobs decode together
(``batching.BatchGenerator``): jobs join and leave between cycles and the queue holds the jobs
waiting for a row. Vision-language targets, and ``max_batch`` 1, run one job at a time."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import mlx.core as mx

from .. import generation
from ..batching import one_at_a_time
from ..decoding.state import Interrupted
from ..errors import DFlashError
from ..settings import GenerationConfig
from ..vision.images import ImageError
from ..vision.notes import batch_note
from .images import api_error
from .prompt_cache import PromptPool, default_bytes
from .schema import APIError, bad, shutting_down

logger = logging.getLogger("dflash_mlx.server")


def batch_generator(model, tokenizer, max_batch: int):
    """The engine's ``BatchGenerator`` (every rank's under ``mlx.launch``, where every
    request is batched): one of a single row decodes alone, through ``stream_generate``,
    so that ``--kv-bits`` runs there as in one process's ``--max-batch 1``."""
    from ..batching import BatchGenerator

    return BatchGenerator(model, tokenizer, max_batch, solo=max_batch == 1)


@dataclass
class Job:
    """One queued generation. ``out`` receives ("data", GenerationResponse), ("error",
    APIError) and finally ("end", None); ``cancel`` is set when the client goes away.
    With images, ``vision`` is the prompt ``vision.request.prepare`` made of ``ids`` (the
    engine decodes it as it is: the processor runs once per request), and its ``keys``
    (``ids`` with each image's rows keyed by its hash) are what the prompt pool matches."""

    ids: list[int]
    gen: GenerationConfig
    processors: list = field(default_factory=list)  # e.g. a grammar (structured output)
    out: queue.Queue = field(default_factory=queue.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    vision: object | None = None

    def request(self) -> tuple:
        """(the engine's prompt, its image keywords): the ids alone without images, today's
        text path."""
        return self.ids, ({} if self.vision is None else {"images": self.vision})

    def cached(self) -> list[int]:
        """The ids the prompt pool matches (with images, their hash-keyed rows)."""
        return self.ids if self.vision is None else self.vision.keys


class Engine:
    """The generation worker: a bounded FIFO of jobs, decoded up to ``max_batch`` at a time.

    Args:
        model, tokenizer: the loaded pair. max_queue: jobs that may wait for a row (503 past
            it). max_batch: jobs decoding together (1: one at a time; a VLM's always are).
        cache_bytes: the prompt caches' budget (None: ``prompt_cache.default_bytes``).
        disk: the prompt caches' disk tier (``prompt_cache_disk.DiskTier``), or None.
        lockstep: under ``mlx.launch``, rank 0's ``distributed.follow.Lead``: the pool and
            every batch are wrapped so that the other ranks repeat their calls (always
            batched then: a one-at-a-time job could not be cancelled alike on every rank).
    """

    def __init__(
        self,
        model,
        tokenizer,
        max_queue: int = 16,
        max_batch: int = 8,
        cache_bytes: int | None = None,
        disk=None,
        lockstep=None,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.jobs: queue.Queue[Job] = queue.Queue(maxsize=max(1, int(max_queue)))
        self.max_batch = 1 if one_at_a_time(model) else max(1, int(max_batch))
        # one at a time where a batch was asked: said in each answer's notes (a VLM's)
        self.solo_note = batch_note(model, int(max_batch)) if self.max_batch == 1 else None
        budget = default_bytes(model) if cache_bytes is None else cache_bytes
        self.pool = PromptPool(model, budget, disk)
        self.lockstep = lockstep
        if lockstep is not None:
            self.pool = lockstep.pool(self.pool)
            lockstep.hello({"max_batch": self.max_batch, "cache_bytes": self.pool.max_bytes})
            if lockstep.dog is not None:
                lockstep.dog.on_fault = self.abandon
        self.lent: dict[int, object] = {}  # batched jobs' prompt caches until their prefill ends
        self.running = False
        self.current: Job | None = None
        self.active: dict[int, Job] = {}  # batched jobs by row uid
        self.served = self.cancelled = 0
        self.stopping = threading.Event()  # no new job starts; the loop ends when idle
        self.finished = threading.Event()  # ``run`` returned
        self.closing = False  # new jobs are refused (a stop began)
        self.forced = False  # running jobs are ended with a 503 (``stop``)
        self._gate = threading.Lock()  # a job is queued, or refused, never left behind

    @property
    def occupancy(self) -> int:
        """Jobs decoding (or prefilling) now."""
        batched = self.max_batch > 1 or self.lockstep is not None
        return len(self.active) if batched else int(self.current is not None)

    def has_room(self) -> bool:
        """Whether a job submitted now would be queued (a request's images are decoded
        only then)."""
        return not (self.closing or self.stopping.is_set() or self.jobs.full())

    def submit(self, job: Job) -> bool:
        """Queue a job; False when the queue is full or the server is stopping."""
        with self._gate:
            if self.closing or self.stopping.is_set():
                return False
            try:
                self.jobs.put_nowait(job)
                return True
            except queue.Full:
                return False

    def run(self) -> None:
        """Serve jobs until ``close`` or ``stop``; call from the thread that owns the MLX
        stream."""
        try:
            batched = self.max_batch > 1 or self.lockstep is not None
            self._run_batched() if batched else self._run_serial()
        finally:
            if self.lockstep is not None:
                self.lockstep.quit()
            self.finished.set()

    def close(self) -> None:
        """Begin an orderly stop: refuse new jobs, answer the queued ones 503, and let
        ``run`` return once the running ones end (``stop`` ends them)."""
        with self._gate:
            self.closing = True
            self._drain()
        self.stopping.set()

    def _run_serial(self) -> None:
        while not self.stopping.is_set():
            try:
                job = self.jobs.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                self._run(job)
            except BaseException:  # KeyboardInterrupt mid-generation: answered, stop
                job.out.put(("end", None))
                raise
        self.close()  # what was queued meanwhile gets its 503

    def stop(self) -> None:
        """Stop now: the running jobs are ended at their next cycle (or prefill chunk) with
        a 503 (a stream: its error event), never passed off as finished."""
        self.forced = True
        self.stopping.set()
        for job in [self.current, *list(self.active.values())]:
            if job is not None:
                job.cancel.set()

    def _drain(self) -> None:
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            job.out.put(("error", shutting_down()))
            job.out.put(("end", None))

    def _run(self, job: Job) -> None:
        if job.cancel.is_set():  # its client left while it waited
            self.cancelled += 1
            job.out.put(("end", None))
            return
        self.running, self.current = True, job
        cache = self.pool.take(job.cached())
        cache.interrupt = job.cancel  # a client gone mid-prefill stops it at a chunk
        keep = True
        prompt, extra = job.request()
        gen = generation.stream_generate(
            self.model,
            self.tokenizer,
            prompt,
            config=job.gen,
            prompt_cache=cache,
            logits_processors=job.processors,
            **extra,
        )
        try:
            for r in gen:
                if self.solo_note:
                    r.notes.append(self.solo_note)
                job.out.put(("data", r))
                if job.cancel.is_set() and not r.finish_reason:
                    logger.info("generation cancelled (client gone or server stopping)")
                    self.cancelled += 1
                    if self.forced:
                        job.out.put(("error", shutting_down()))
                    break
        except Interrupted:
            logger.info("prefill cancelled (client gone or server stopping)")
            self.cancelled += 1
            job.out.put(("error", shutting_down()))
        except ImageError as e:  # e.g. a model without vision: its 400 in the API's shape
            job.out.put(("error", api_error(e)))
        except DFlashError as e:
            job.out.put(("error", bad(str(e))))
        except Exception as e:
            logger.exception("generation failed")
            keep = False  # the cache's contents are unknown now
            job.out.put(("error", APIError(500, f"generation failed: {type(e).__name__}: {e}")))
        except BaseException:  # Ctrl-C mid-cycle: the answer first, then stop
            keep = False
            job.out.put(("error", shutting_down()))
            raise
        finally:
            gen.close()
            self.pool.give(cache, keep)
            self.served += 1
            self.running, self.current = False, None
            job.out.put(("end", None))

    # -- continuous batching ---------------------------------------------------------
    def _run_batched(self) -> None:
        gen = self._batch()
        try:
            while not self.stopping.is_set() or self.active:
                self._admit(gen)
                self.running = bool(self.active)
                if not self.active:
                    continue
                try:
                    results = gen.step()
                except Exception as e:
                    logger.exception("batched generation failed")
                    self._fail_all(APIError(500, f"generation failed: {type(e).__name__}: {e}"))
                    gen = self._batch()
                    continue
                for uid, r in results:
                    job = self.active.get(uid)
                    if uid in self.lent:  # its prefill is merged: the batch holds a copy
                        self.pool.give(self.lent.pop(uid))
                    if job is not None:
                        job.out.put(("data", r))
                        if r.finish_reason:
                            self._end(uid)
                for uid in [u for u, j in self.active.items() if j.cancel.is_set()]:
                    logger.info("generation cancelled (client gone or server stopping)")
                    gen.remove(uid)
                    self.cancelled += 1
                    if self.forced:  # in prefill or mid-answer: a 503, never a cut 200
                        self.active[uid].out.put(("error", shutting_down()))
                    self._end(uid)
                if not self.active:
                    mx.clear_cache()  # the batch's caches are gone: give their memory back
        except BaseException:  # KeyboardInterrupt mid-generation: answer, then stop
            self._fail_all(shutting_down())
            raise
        finally:
            self.running = False
        self.close()  # what was queued meanwhile gets its 503

    def _batch(self):
        gen = batch_generator(self.model, self.tokenizer, self.max_batch)
        return gen if self.lockstep is None else self.lockstep.batch(gen)

    def abandon(self, why: str, settle: float = 2.0) -> None:
        """The group of ranks broke (``distributed.faults``): answer every queued and
        running job 503 now, from another thread (the worker may be stuck in a collective),
        and give their answers up to ``settle`` seconds to be taken."""
        err = APIError(
            503,
            f"the server stopped: {why}; retry when it is back",
            code="server_group_broken",
        )
        with self._gate:
            self.closing = True
            jobs = [self.current, *list(self.active.values())]
            while True:
                try:
                    jobs.append(self.jobs.get_nowait())
                except queue.Empty:
                    break
        for job in jobs:
            if job is not None:
                job.out.put(("error", err))
                job.out.put(("end", None))
        deadline = time.monotonic() + settle
        while time.monotonic() < deadline and any(j and not j.out.empty() for j in jobs):
            time.sleep(0.05)
        time.sleep(0.2)  # the handlers write what they took

    def _admit(self, gen) -> None:
        """Move queued jobs into free rows (waiting briefly when nothing is decoding)."""
        while len(self.active) < self.max_batch and not self.stopping.is_set():
            try:
                job = self.jobs.get(timeout=0.1) if not self.active else self.jobs.get_nowait()
            except queue.Empty:
                return
            if job.cancel.is_set():  # its client left while it waited
                self.cancelled += 1
                job.out.put(("end", None))
                continue
            cache = self.pool.take(job.cached())
            try:
                prompt, extra = job.request()
                uid = gen.insert(prompt, job.gen, cache=cache, processors=job.processors, **extra)
            except DFlashError as e:
                self.pool.give(cache)
                self.served += 1  # counted like a refused job of the one-at-a-time path
                err = api_error(e) if isinstance(e, ImageError) else bad(str(e))
                job.out.put(("error", err))
                job.out.put(("end", None))
                continue
            self.active[uid] = job
            self.lent[uid] = cache
            self.running = True

    def _end(self, uid: int, keep: bool = True) -> None:
        if uid in self.lent:  # left before its prefill ended: its chunks are consistent
            self.pool.give(self.lent.pop(uid), keep)
        job = self.active.pop(uid)
        self.served += 1
        self.running = bool(self.active)
        job.out.put(("end", None))

    def _fail_all(self, err: APIError) -> None:
        for uid in list(self.active):
            self.active[uid].out.put(("error", err))
            self._end(uid, keep=False)
