"""The generation worker of ``dflash_mlx.server``: a bounded FIFO of jobs run one at a time
in the thread that calls ``Engine.run`` (MLX streams are per thread; the decode loop makes its
own on first use there), with cancellation at the next cycle and one prompt cache shared by
all requests."""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import List, Optional

from .. import generation
from ..errors import DFlashError
from ..settings import GenerationConfig
from ..state import Interrupted
from .schema import APIError, bad

logger = logging.getLogger("dflash_mlx.server")


@dataclass
class Job:
    """One queued generation. ``out`` receives ("data", GenerationResponse), ("error",
    APIError) and finally ("end", None); ``cancel`` is set when the client goes away."""

    ids: List[int]
    gen: GenerationConfig
    processors: list = field(default_factory=list)  # e.g. a grammar (structured output)
    out: "queue.Queue" = field(default_factory=queue.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)


class Engine:
    """The generation worker: a bounded FIFO of jobs, run one at a time."""

    def __init__(self, model, tokenizer, max_queue: int = 16):
        self.model, self.tokenizer = model, tokenizer
        self.jobs: "queue.Queue[Job]" = queue.Queue(maxsize=max(1, int(max_queue)))
        self.cache = None
        self.running = False
        self.current: Optional[Job] = None
        self.served = self.cancelled = 0
        self.stopping = threading.Event()

    def submit(self, job: Job) -> bool:
        """Queue a job; False when the queue is full."""
        if self.stopping.is_set():
            return False
        try:
            self.jobs.put_nowait(job)
            return True
        except queue.Full:
            return False

    def run(self) -> None:
        """Serve jobs until ``stop``; call from the thread that owns the MLX stream."""
        self.cache = self.model.make_cache()
        while not self.stopping.is_set():
            try:
                job = self.jobs.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                self._run(job)
            except BaseException:  # KeyboardInterrupt mid-generation: answer, then stop
                job.out.put(("error", APIError(503, "the server is shutting down")))
                job.out.put(("end", None))
                raise
        self._drain()

    def stop(self) -> None:
        """Stop after the current generation, which is cancelled at its next cycle."""
        self.stopping.set()
        job = self.current
        if job is not None:
            job.cancel.set()

    def _drain(self) -> None:
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            job.out.put(("error", APIError(503, "the server is shutting down")))
            job.out.put(("end", None))

    def _run(self, job: Job) -> None:
        if job.cancel.is_set():  # its client left while it waited
            self.cancelled += 1
            job.out.put(("end", None))
            return
        self.running, self.current = True, job
        self.cache.interrupt = job.cancel  # a client gone mid-prefill stops it at a chunk
        gen = generation.stream_generate(
            self.model,
            self.tokenizer,
            job.ids,
            config=job.gen,
            prompt_cache=self.cache,
            logits_processors=job.processors,
        )
        try:
            for r in gen:
                job.out.put(("data", r))
                if job.cancel.is_set() and not r.finish_reason:
                    logger.info("generation cancelled (client gone or server stopping)")
                    self.cancelled += 1
                    break
        except Interrupted:
            logger.info("prefill cancelled (client gone or server stopping)")
            self.cancelled += 1
            job.out.put(("error", APIError(503, "the request was cancelled before its answer")))
        except DFlashError as e:
            job.out.put(("error", bad(str(e))))
        except Exception as e:  # noqa: BLE001 - one request must not take the server down
            logger.exception("generation failed")
            self.cache = self.model.make_cache()  # its contents are unknown now
            job.out.put(("error", APIError(500, f"generation failed: {type(e).__name__}: {e}")))
        finally:
            gen.close()
            self.served += 1
            self.running, self.current = False, None
            job.out.put(("end", None))
