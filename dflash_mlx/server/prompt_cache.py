"""The server's prompt caches: several ``PromptCache``s (target KV or hybrid state, the
drafter's context) keyed by the tokens they hold, so that agents and chats sharing a server
do not evict each other.

A request takes the entry whose prefix it can reuse longest out of the pool (no array is
copied: ``PromptCache.reuse`` trims it in place) and gives it back when its caches are done
with, keyed by the tokens it holds then. While an entry is out, a second request sharing its
prefix takes the next best entry or starts fresh. A request whose prompt branches off an
entry's (another conversation after the same system prompt) gets a copy of the shared prefix
when the branch would cut more than ``fork_min`` tokens, and the entry stays whole; a
shorter cut (an agent's next turn re-rendering the end of its last answer) trims the entry
in place. Hybrid entries are never copied: they go back to their checkpoint. Entries past
``max_bytes`` go, least recently used first, to the disk tier when there is one
(``prompt_cache_disk.DiskTier``), else away.

mlx-lm's ``LRUPromptCache`` copies a cache for every request and holds target caches only;
an entry here also holds the drafter's context and a hybrid's checkpoint.
"""

from __future__ import annotations

import copy
import logging
import threading

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from ..decoding.state import PromptCache
from ..errors import DFlashError
from ..loading.memory import MAX_MEMORY_GB as MAX_GB  # one bound for every GB setting

logger = logging.getLogger("dflash_mlx.server")

GB = 10**9
DEFAULT_SHARE = 0.25  # of the memory the budget leaves beside the pair's weights
FALLBACK_BYTES = 2 * GB  # when the budget cannot be measured
FORK_MIN = 256  # a branch cutting more cached tokens than this copies the shared prefix


def default_bytes(model, max_memory: float | None = None) -> int:
    """``--prompt-cache-gb``'s default: a quarter of what the device budget
    (``memory.device_budget``) leaves beside the pair's weights.

    Args:
        model: the loaded pair. max_memory: ``--max-memory`` in GB (None: the device's).
    """
    from ..loading.memory import device_budget

    budget, _ = device_budget(max_memory)
    if not budget:
        return FALLBACK_BYTES
    return int(max(0, budget - weight_bytes(model)) * DEFAULT_SHARE)


def weight_bytes(model) -> int:
    """The bytes of the pair's weights (target and drafter)."""
    weights = sum(a.nbytes for _, a in tree_flatten(model.target.parameters()))
    return weights + sum(a.nbytes for _, a in tree_flatten(model.drafter.parameters()))


def pool_gb(model, cache_gb: float | None, max_memory: float | None) -> float | None:
    """``--prompt-cache-gb`` inside ``--max-memory``: the default sized from that budget,
    a larger value refused (None: no budget given, the device's default applies).

    Args:
        model: the loaded pair. cache_gb: ``--prompt-cache-gb`` or None. max_memory: GB.

    Raises:
        DFlashError: cache_gb is more than the budget leaves beside the weights.
    """
    if max_memory is None:
        return cache_gb
    if cache_gb is None:
        return default_bytes(model, max_memory) / GB
    left = max(0, max_memory * GB - weight_bytes(model))
    if check_gb(cache_gb) * GB > left:
        raise DFlashError(
            f"--prompt-cache-gb {cache_gb:g} does not fit in --max-memory {max_memory:g} beside "
            f"the weights ({left / GB:.3g} GB left); use --prompt-cache-gb "
            f"{left * DEFAULT_SHARE / GB:.3g} or less, or a larger --max-memory"
        )
    return cache_gb


def check_gb(value) -> float | None:
    """``--prompt-cache-gb`` as a number of GB (None: the default).

    Raises:
        DFlashError: not a finite number from 0 to ``MAX_GB``.
    """
    if value is None:
        return None
    try:
        gb = float(value)
    except (TypeError, ValueError, OverflowError):
        gb = float("nan")
    if not 0 <= gb <= MAX_GB:
        raise DFlashError(
            f"--prompt-cache-gb must be a number of GB from 0 to {MAX_GB:g} (got {value}); "
            "e.g. --prompt-cache-gb 4 (0 turns the prompt cache off)"
        )
    return gb


def fork(model, cache: PromptCache, n: int) -> PromptCache | None:
    """A copy of the first n tokens of cache (which is left whole), or None when its layers
    cannot be copied so (a hybrid's recurrent state).

    Args:
        model: the loaded pair. cache: an entry. n: tokens to keep (at most its length).
    """
    kinds = (KVCache, QuantizedKVCache)
    if not all(type(c) in kinds and not c.empty() for c in cache.target):
        return None
    model.drafter.flush_context(cache.drafter)  # project pending rows once, in the original
    target = []
    for c in cache.target:
        new = copy.copy(c)  # its settings (a quantized cache's bits and group size)
        # keys / values [1, n_kv, capacity, head_dim] (quantized: tuples) -> their first n rows
        new.keys, new.values = tree_map(lambda a: copy.deepcopy(a[..., :n, :]), (c.keys, c.values))
        new.offset = n
        target.append(new)
    drafter = [_context_prefix(c, len(cache.tokens) - n) for c in cache.drafter]
    out = PromptCache(target, drafter, list(cache.tokens[:n]), kv=cache.kv, owner=cache.owner)
    mx.eval(out.state)  # own buffers now: the entry may be evicted without pinning them
    return out


def _context_prefix(c, drop: int):
    """A copy of a drafter context cache (no pending rows) without its last ``drop``
    positions, as ``PromptCache.reuse`` trims it: its held rows [1, n_kv, size, head_dim]
    end at ``offset``; those before the new offset are kept."""
    arrays, meta = c.save_state()
    end = max(0, int(meta["offset"]) - drop)
    if "keys" in arrays:
        size = arrays["keys"].shape[2]
        keep = max(0, min(size, end - (int(meta["offset"]) - size)))
        arrays = {k: copy.deepcopy(arrays[k][..., :keep, :]) for k in ("keys", "values")}
        arrays = arrays if keep else {}
    return type(c).load_state(arrays, {**meta, "offset": str(end)})


class PromptPool:
    """Prompt caches keyed by their tokens, least recently used evicted past a byte budget.

    Args:
        model: the loaded pair. max_bytes: the budget (0: nothing is kept between requests).
        disk: where evicted entries go and come back from (``DiskTier``), or None.
        fork_min: a branch cutting more cached tokens than this copies the shared prefix.
    """

    def __init__(self, model, max_bytes: int, disk=None, fork_min: int = FORK_MIN):
        self.model, self.max_bytes, self.disk = model, max(0, int(max_bytes)), disk
        self.fork_min = fork_min
        self.forks = 0
        self.entries: list[list] = []  # [cache, bytes], least recently used first
        self.lock = threading.Lock()  # /health reads the counters from another thread
        self.lookups = self.hits = self.cached = self.prompted = self.evicted = 0
        self.out = 0  # entries taken and not given back
        # under mlx.launch, ``agree(n, k)``: whether every rank restored k tokens from its
        # own disk tier (each reused n from memory); False: none uses its restore
        self.agree = None

    def take(self, prompt: list[int]) -> PromptCache:
        """The cache whose prefix of prompt is longest (memory, then disk), out of the pool;
        a fresh one when none shares a prefix. Give it back with ``give``.

        Args:
            prompt: the request's token ids.
        """
        with self.lock:
            best, n, copied = None, 0, False
            for i, (cache, _) in enumerate(self.entries):
                k = cache.usable(prompt)
                if k > n:
                    best, n = i, k
            if best is not None:
                best, copied = self._lend(best, n)
        restored = None
        if self.disk is not None and len(prompt) - 1 > n:
            restored = self.disk.take(self.model, prompt, n)
        k = 0 if restored is None else restored.usable(prompt)
        if self.disk is not None and self.agree is not None and not self.agree(n, k):
            restored = None  # another rank's tier lacks it: every rank goes without
        if restored is not None:
            if best is not None and not copied:
                self._put(best)  # untouched: back as it was (a copy just goes)
            best, n = restored, restored.usable(prompt)
        with self.lock:
            self.lookups += 1
            self.prompted += len(prompt)
            self.hits += n > 0
            self.cached += n
            self.out += 1
        cache = best if best is not None else self.model.make_cache()
        cache.interrupt = threading.Event()
        return cache

    def _lend(self, i: int, n: int) -> tuple[PromptCache, bool]:
        """Entry i for a request reusing n of its tokens, and whether it is a copy: the
        entry itself, out of the pool, or a copy of its first n tokens when the cut would be
        long (the entry stays, now the most recently used)."""
        cache = self.entries[i][0]
        if len(cache.tokens) - n > self.fork_min:
            copied = fork(self.model, cache, n)
            if copied is not None:
                self.forks += 1
                self.entries.append(self.entries.pop(i))
                return copied, True
        return self.entries.pop(i)[0], False

    def give(self, cache: PromptCache, keep: bool = True) -> None:
        """Put a cache back, keyed by the tokens it holds now (most recently used).

        Args:
            cache: from ``take``. keep: False drops it (its contents are unknown).
        """
        with self.lock:
            self.out = max(0, self.out - 1)
        if keep and not cache.busy and cache.tokens:
            self._put(cache)

    def _put(self, cache: PromptCache) -> None:
        evicted = []
        with self.lock:
            if cache.trimmable():  # an entry holding a prefix of this one adds nothing
                n = len(cache.tokens)
                self.entries = [
                    e
                    for e in self.entries
                    if not (
                        len(e[0].tokens) <= n and cache.tokens[: len(e[0].tokens)] == e[0].tokens
                    )
                ]
            self.entries.append([cache, cache.nbytes])
            while self.entries and self.nbytes > self.max_bytes:
                evicted.append(self.entries.pop(0)[0])
                self.evicted += 1
        for old in evicted:
            if self.disk is not None:
                self.disk.put(old)

    def close(self) -> None:
        """Write the entries held in memory to the disk tier, so a later server restores
        them (least recently used first: the tier keeps the newest); nothing without one."""
        if self.disk is None:
            return
        with self.lock:
            entries, self.entries = [e[0] for e in self.entries], []
        if entries:
            logger.info("saving %d prompt caches to %s", len(entries), self.disk.folder)
        for cache in entries:
            self.disk.put(cache)

    @property
    def nbytes(self) -> int:
        """Bytes held by the entries in the pool (not those taken)."""
        return sum(b for _, b in self.entries)

    def stats(self) -> dict:
        """What ``/health`` and ``/v1/cache`` report."""
        with self.lock:
            out = {
                "entries": len(self.entries),
                "bytes": self.nbytes,
                "max_bytes": self.max_bytes,
                "in_use": self.out,
                "lookups": self.lookups,
                "hits": self.hits,
                "hit_rate": round(self.hits / self.lookups, 4) if self.lookups else 0.0,
                "cached_tokens": self.cached,
                "prompt_tokens": self.prompted,
                "evicted": self.evicted,
                "forks": self.forks,
            }
        out["disk"] = None if self.disk is None else self.disk.stats()
        return out
