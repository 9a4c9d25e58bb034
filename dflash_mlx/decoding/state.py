"""The loaded pair and the reusable per-conversation cache."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import QuantizedKVCache

from ..errors import DFlashError
from ..model.drafter import ContextCache, DFlashDrafter, embed_block
from ..model.recurrent import recurrent
from ..model.target import TargetAdapter

_thread = threading.local()


class _ClearStreams:
    """Kept in the locals of a thread that decodes: when the thread ends, its MLX streams
    and compile cache go with it, while Python still runs. Left to MLX they go after the
    interpreter has finalised, which aborts the process (exit 134); MLX asks each thread
    to call ``mx.clear_streams()`` at its end."""

    def __del__(self):
        clear = getattr(mx, "clear_streams", None)
        if clear is not None:
            clear()


@dataclass
class DFlashModel:
    """A target (mlx-lm model) with its drafter.

    Attributes:
        target: the mlx-lm model. drafter: the DFlash drafter. adapter: capture/rollback.
        target_path, drafter_path: where they were loaded from.
        name: what to call the pair (a registry alias, a Hub id or a directory name).
        tuning: the ``block_size="auto"`` scheduler's costs and priors (``warmup.warm_up``).
    """

    target: object
    drafter: DFlashDrafter
    adapter: TargetAdapter
    target_path: str = ""
    drafter_path: str = ""
    name: str = ""
    # Costs measured here and acceptance priors for block_size="auto" (schedule.Tuning).
    tuning: object | None = None
    # The LM head over the drafter's draft vocabulary (draft_vocab.DraftHead), or None.
    draft_head: object | None = None
    # Held by each step of a decode (``step``): threads sharing the pair take turns, since
    # the adapter's captured layers and the tuning are the pair's, not a request's.
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)
    # Where the pair's later notes go (``load``'s notices, a no-op under quiet; None: stderr).
    notes: Callable[[str], None] | None = field(default=None, repr=False, compare=False)
    # The ``mx.distributed.Group`` the target is sharded over (None: one process); the
    # ``auto`` schedule then follows rank 0 (``distributed/policy.py``).
    group: object | None = field(default=None, repr=False, compare=False)
    # That group as ``distributed.describe`` says it (ranks, shard mode, backend, link), or
    # None: the warm-up costs are stored per group, and ``dflash bench`` reports it.
    group_info: dict | None = field(default=None, repr=False, compare=False)
    # The tokenizer ``load`` returned with this pair (None: built by hand); another tokenizer
    # passes the door only where its ids mean what this one's do (``inputs.check_tokenizer``).
    tokenizer: object | None = field(default=None, repr=False, compare=False)

    @property
    def block_size(self) -> int:
        """The checkpoint's block size (the default runtime block size)."""
        return self.drafter.args.block_size

    def embed_block(self, anchor: mx.array, length: int) -> mx.array:
        """Embed [anchor, mask, ..., mask] of the given length -> [1, length, H]."""
        args = self.drafter.args
        masks = mx.full((length - 1,), args.mask_token_id, mx.uint32)
        ids = mx.concatenate([anchor.reshape(1), masks]).astype(mx.uint32)
        return embed_block(self.adapter.embed, ids[None], args, self.drafter.fc.weight.dtype)

    def draft_logits(self, hidden: mx.array) -> mx.array:
        """Drafter logits [.., V'] over the draft vocabulary ([.., V] without one)."""
        head = self.draft_head if self.draft_head is not None else self.adapter.lm_head
        return self.drafter.logits(hidden, head)

    def to_target(self, idx: mx.array) -> mx.array:
        """Map indices into ``draft_logits``' last axis to target ids (uint32)."""
        if self.draft_head is None:
            return idx.astype(mx.uint32)
        return self.draft_head.to_target(idx)

    @property
    def draft_size(self) -> int:
        """How many ids the drafter can propose: the draft vocabulary's, else the target's."""
        return self.adapter.vocab_size if self.draft_head is None else self.draft_head.size

    def make_cache(self) -> PromptCache:
        """An empty cache for one conversation (it knows the pair it was made for)."""
        cache = PromptCache(self.adapter.make_cache(), self.drafter.make_cache())
        cache.owner = self.identity
        return cache

    @property
    def identity(self) -> str:
        """What a ``PromptCache`` records of the pair that made it: its name and paths
        (a pair loaded twice from the same files shares its caches)."""
        paths = f"{self.target_path}, {self.drafter_path}" if self.target_path else id(self)
        return f"{self.name or 'a pair'} ({paths})"

    @contextmanager
    def turn(self):
        """Hold the pair for one step of a decode (``lock``): two threads decoding on it
        interleave step by step instead of corrupting each other. A thread other than the
        main one also gets its MLX streams cleared when it ends (``_ClearStreams``)."""
        main = threading.current_thread() is threading.main_thread()
        if not main and getattr(_thread, "clear", None) is None:
            _thread.clear = _ClearStreams()
        with self.lock:
            yield

    def step(self, steps):
        """The next item of a decode generator, or None at its end, in a ``turn``.

        Args:
            steps: a generator such as ``loop.decode``'s.
        """
        with self.turn():
            return next(steps, None)


def convert_at(start: int, n_prompt: int, step: int) -> int:
    """The cache length at which mlx-lm's ``generate_step`` quantizes the cache: the first
    step boundary at or after ``quantized_kv_start``. Its boundaries are the ends of the
    prefill chunks of ``step`` tokens over all but the last prompt token, then every token.

    Args:
        start: quantized_kv_start. n_prompt: the prompt's length. step: prefill_step_size.
    """
    if n_prompt > 1 and start <= n_prompt - 1:
        return min(max(1, -(-start // step)) * step, n_prompt - 1)
    return max(start, n_prompt)


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many leading tokens a and b share, at most ``limit``.

    Args:
        a, b: token ids. limit: the most to count.
    """
    limit, n = min(len(a), len(b), limit), 0
    while n + 256 <= limit and a[n : n + 256] == b[n : n + 256]:
        n += 256  # whole slices first: a long shared system prompt compares in C
    while n < limit and a[n] == b[n]:
        n += 1
    return n


class Interrupted(Exception):
    """A prefill stopped because its ``PromptCache.interrupt`` was set; the cache is
    consistent and holds the prompt tokens that were run."""


@dataclass
class PromptCache:
    """Target caches and drafter context caches holding exactly ``tokens``.

    Pass one to ``stream_generate(prompt_cache=...)`` to reuse a shared prefix across calls
    (multi-turn chat, a server's growing history).
    """

    target: list
    drafter: list[ContextCache]
    tokens: list[int] = field(default_factory=list)
    # (token count, recurrent-state snapshot) taken after the last prefill, hybrids only
    checkpoint: tuple[int, list] | None = None
    # True while a cycle is mutating the caches; an interrupted cycle leaves it set
    busy: bool = False
    # Set it (from a signal handler or another thread) to stop a prefill at its next chunk:
    # ``Interrupted`` is raised and the caches keep the prompt tokens run so far.
    interrupt: threading.Event = field(default_factory=threading.Event)
    # KV quantization of the target's attention caches: (bits, group size, the cache
    # length at which they are converted), set by ``set_kv`` for each decode; None: off.
    kv: tuple[int, int, int] | None = None
    # ``DFlashModel.identity`` of the pair that made it ("": not recorded, never checked)
    owner: str = ""

    def _reset(self, model: DFlashModel) -> None:
        self.target, self.drafter = model.adapter.make_cache(), model.drafter.make_cache()
        self.tokens, self.checkpoint, self.busy = [], None, False

    def set_kv(self, model: DFlashModel, kv: tuple | None, n_prompt: int, step: int) -> None:
        """Quantize the target's attention caches for this decode as mlx-lm's
        ``generate_step`` would (``convert_at``); caches quantized otherwise start over.

        Args:
            model: the pair. kv: (bits, group size, quantized_kv_start), or None.
            n_prompt: the prompt's length. step: mlx-lm's ``prefill_step_size``.
        """
        layers = [x for x in model.adapter.inner.layers if x is not None]
        if kv is not None and any(hasattr(getattr(x, "self_attn", None), "sinks") for x in layers):
            raise DFlashError(  # mlx-lm's generate_step fails on these too (gpt_oss)
                f"kv_bits: '{model.adapter.model_type}' attends with sinks, which mlx-lm's "
                "quantized attention does not take; leave kv_bits unset"
            )
        have = [(c.bits, c.group_size) for c in self.target if isinstance(c, QuantizedKVCache)]
        if have and have[0] != (None if kv is None else tuple(kv[:2])):
            self._reset(model)
        self.kv = None if kv is None else (kv[0], kv[1], convert_at(kv[2], n_prompt, step))

    def quantize(self) -> None:
        """At a step boundary: convert the attention caches once they hold ``kv[2]`` tokens
        (mlx-lm's ``maybe_quantize_kv_cache``; recurrent states are left alone)."""
        if self.kv is None:
            return
        bits, group, at = self.kv
        try:
            maybe_quantize_kv_cache(self.target, at, group, bits)
        except ValueError:  # mx.quantize: the head's width is not a multiple of the group
            width = next(c.keys.shape[-1] for c in self.target if hasattr(c, "to_quantized"))
            raise DFlashError(
                f"kv_group_size {group} does not divide this target's attention head width "
                f"({width}); use a group size that does, or leave kv_bits unset"
            ) from None

    def _quantized(self) -> bool:
        return any(isinstance(c, QuantizedKVCache) for c in self.target)

    def room(self, n: int) -> int:
        """At most ``n`` tokens, and none past the conversion point: a forward that
        crossed it would run tokens after it on the full-precision cache."""
        if self.kv is None or len(self.tokens) >= self.kv[2] or self._quantized():
            return n  # a cache quantized already (an earlier turn's) stays so
        return min(n, self.kv[2] - len(self.tokens))

    def reuse(self, model: DFlashModel, prompt: list[int]) -> int:
        """Keep the longest usable cached prefix of prompt; return its length.

        At least one prompt token is always left to run (its logits start generation).
        Recurrent layers cannot drop tokens: they go back to the checkpoint taken after the
        last prefill when that is still a prefix, else everything is reset.
        """
        if self.busy:  # interrupted mid-cycle (e.g. Ctrl-C): contents unknown, start over
            self._reset(model)
        n = self.common(prompt)
        have = len(self.tokens)
        if n == have:
            return n
        adapter = model.adapter
        if not adapter.trim_to(self.target, n, have):
            ck = self.checkpoint
            if ck is None or ck[0] > n or not adapter.restore(self.target, ck[1], ck[0], have):
                self.target, self.drafter = adapter.make_cache(), model.drafter.make_cache()
                self.tokens, self.checkpoint = [], None
                return 0
            n = ck[0]
        for c in self.drafter:
            c.trim(have - n)
        del self.tokens[n:]
        return n

    def common(self, prompt: list[int]) -> int:
        """The length of the longest common prefix of ``tokens`` and prompt, leaving at least
        one prompt token to run."""
        return common_prefix(self.tokens, prompt, len(prompt) - 1)

    def trimmable(self) -> bool:
        """Whether every target layer can drop cached tokens (no recurrent state)."""
        return all(not recurrent(c) and c.is_trimmable() for c in self.target)

    def usable(self, prompt: list[int]) -> int:
        """How many prompt tokens ``reuse`` would keep, changing nothing (a pool of caches
        picks the best one with it).

        Args:
            prompt: the request's token ids.
        """
        if self.busy:
            return 0
        n = self.common(prompt)
        if n == len(self.tokens) or self.trimmable():
            return n
        ck = self.checkpoint
        if ck is None or ck[0] > n:
            return 0
        ok = all(recurrent(c) or c.is_trimmable() for c in self.target)
        return ck[0] if ok else 0

    @property
    def nbytes(self) -> int:
        """Bytes held: the target's caches, the drafter's context (rows and pending
        features) and a hybrid's checkpoint."""
        total = sum(c.nbytes for c in self.target if not c.empty())
        total += sum(a.nbytes for c in self.drafter for a in c.state)  # buffers and pending
        if self.checkpoint is not None:
            for layer in self.checkpoint[1]:
                total += sum(a.nbytes for a in layer or () if a is not None)
        return total

    @property
    def state(self):
        """Arrays to evaluate."""
        out = [c.state for c in self.target]
        return out + [c.state for c in self.drafter]
