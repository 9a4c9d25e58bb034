"""Batched speculative decoding: rows draft, verify and accept together (continuous batching).

The target's attention caches are mlx-lm ``BatchKVCache`` (left padded, one write index for
all rows); a hybrid's recurrent layers keep a state per row, rewound after each verify to
what that row kept (``model/recurrent.py``).

After a verify of L tokens row i keeps k_i of them. Per-row rollback: trim every row to the
longest keep m = max k_i, then shift row i right by m - k_i (mlx-lm's own right-padding
``prepare`` / ``finalize``), which moves its rejected tail out past the write index and grows
its left padding; the causal mask already hides left padding. No re-feed and no extra forward;
the cost is one copy of the caches per cycle. The drafter's context uses the same cache type
and the same shift, with a mask of our own (left padding and the sliding window).

Joining rows are prefilled alone (``decode.prefill``, one chunk per ``step``) and then merged
into the batch between cycles; finished rows are filtered out between cycles.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache

from ..errors import DFlashError
from ..model.drafter import embed_block
from ..model.recurrent import recurrent
from .acceptance import SamplingParams
from .lookup import FIXED_MIN_MATCH, Lookup
from .propose import accept, copied_drafts, propose
from .schedule import Scheduler
from .state import DFlashModel, PromptCache
from .steps import Cycle, prefill, prefill_chunk

COMPACT_EVERY = 8  # cycles between drops of the padding all rows share


@dataclass
class Row:
    """One request decoding in the batch.

    Args:
        uid: the caller's id. prompt: token ids. params: its sampling law.
        max_tokens: its budget. block: its largest block (None: ``auto``, planned per cycle
            by ``batch_auto.BatchPlanner`` from ``sched``).
        use_selector: walk the DFlash 2 lattice. key: its own PRNG key.
        lookup: verify drafts copied from its context (``lookup.py``) when its committed
            tokens have a match of at least ``FIXED_MIN_MATCH`` tokens.
    """

    uid: int
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    block: int | None
    use_selector: bool
    key: mx.array
    lookup: bool = True
    sched: Scheduler | None = None  # block=None rows: their acceptance (``batch_auto``)
    history: list[int] = field(default_factory=list)
    generated: int = 0
    prefilled: int = -1  # prompt tokens in the joining cache; -1 before the first chunk
    reused: int = 0  # prompt tokens the joining cache already held
    index: Lookup | None = None  # the n-gram index of history, when lookup is on


def check_kv(kv_bits: int | None) -> None:
    """Refuse ``kv_bits`` for a batched row: ``BatchKVCache`` rows are not quantized here.

    Args:
        kv_bits: the request's setting.

    Raises:
        DFlashError: kv_bits is set.
    """
    if kv_bits is not None:
        raise DFlashError(
            "kv_bits is not supported with batched decoding (rows share mlx-lm's "
            "BatchKVCache); decode one request at a time (stream_generate, or `dflash serve "
            "--max-batch 1`), or leave kv_bits unset"
        )


def _as_kv(keys, values, n) -> KVCache:
    """A single-row mlx-lm KVCache holding n rows of keys/values (for ``BatchKVCache.merge``)."""
    c = KVCache()
    c.keys, c.values, c.offset = keys, values, n
    return c


def _extend(batch: list | None, single: list) -> list:
    """Append one merged row to each layer's batch cache (or start the batch): attention
    layers' as a ``BatchKVCache``, recurrent layers' states stacked by row."""
    merged = [_one_row(c) for c in single]
    if batch is None:
        return merged
    for b, m in zip(batch, merged):
        b.extend(m)
    return batch


def _one_row(c):
    if not recurrent(c):
        return BatchKVCache.merge([c])
    return (type(c).merge if hasattr(type(c), "merge") else ArraysCache.merge)([c])


def _shift(caches: list, pad: list[int]) -> None:
    """Move row i's last pad[i] entries out past the write index (their left padding grows)."""
    for c in caches:
        if recurrent(c):  # a state holds what its row kept (``rewind_rows``)
            continue
        c.prepare(right_padding=pad)
        c.finalize()


class BatchDecoder:
    """The rows of a batch and their caches; ``join`` then ``step`` until rows finish.

    Args:
        model: the loaded pair (a hybrid's recurrent layers rewind row by row).
        block_size: an auto row's block when ``step`` is given no plan.
        prefill_step_size: prompt tokens per prefill chunk.
    """

    def __init__(self, model: DFlashModel, block_size: int, prefill_step_size: int = 2048):
        self.model, self.block = model, block_size
        self.step_size = prefill_chunk(prefill_step_size)
        self.rows: list[Row] = []
        self.target: list | None = None  # BatchKVCache per target layer
        self.context: list | None = None  # BatchKVCache per drafter layer
        self.joining: list[tuple[Row, PromptCache]] = []
        self.cycles = 0
        self.drafting: list[int] = []  # the rows the drafter drafts for this cycle
        args = model.drafter.args
        windows = {args.window(i) for i in range(args.num_hidden_layers)}
        # One mask serves every drafter layer: a window only when all layers share it.
        self.window = windows.pop() if len(windows) == 1 else None

    # -- rows joining and leaving ----------------------------------------------------
    def join(self, row: Row, cache: PromptCache | None = None) -> None:
        """Queue a row for prefill; ``cache`` (e.g. a server's shared one) lends its prefix."""
        self.joining.append((row, cache if cache is not None else self.model.make_cache()))

    def prefill_step(self) -> tuple[Row, Cycle] | None:
        """Run one prefill chunk of the first joining row; when its prompt is done, merge it
        into the batch and return (row, the Cycle holding its first token)."""
        if not self.joining:
            return None
        row, cache = self.joining[0]
        if row.prefilled < 0:
            row.prefilled = row.reused = cache.reuse(self.model, row.prompt)
        end = min(len(row.prompt), row.prefilled + self.step_size)
        # Only the last chunk's token is kept: processors (a grammar keeps state) see only it.
        params = row.params if end == len(row.prompt) else replace(row.params, processors=[])
        first, key = prefill(self.model, row.prompt[:end], cache, params, row.key)
        row.prefilled = end
        if end < len(row.prompt):
            return None
        self.joining.pop(0)
        row.key, row.history = key, list(row.prompt) + first.tokens
        row.index = Lookup(row.history) if row.lookup else None
        first.prompt_tokens = len(row.prompt) - row.reused
        self._merge(cache)
        self.rows.append(row)
        row.generated = 1
        return row, first

    def _merge(self, cache: PromptCache) -> None:
        self.model.drafter.flush_context(cache.drafter)  # prefill leaves its rows pending
        self.target = _extend(self.target, cache.target)
        ctx = [_as_kv(c.keys, c.values, c.size) for c in cache.drafter]
        offsets = [c.offset for c in cache.drafter]
        self.context = _extend(self.context, ctx)
        for c, off in zip(self.context, offsets):  # rope positions: rows ever appended
            c.offset = mx.concatenate([c.offset[:-1], mx.array([off])])

    def remove(self, uid: int) -> None:
        """Drop a row (finished or aborted), joining or decoding."""
        self.joining = [(r, c) for r, c in self.joining if r.uid != uid]
        keep = [i for i, r in enumerate(self.rows) if r.uid != uid]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.target = self.context = None
            return
        for c in self.target + self.context:
            c.filter(mx.array(keep))

    def __len__(self) -> int:
        return len(self.rows)

    # -- one cycle for every decoding row --------------------------------------------
    def step(self, plan: list | None = None) -> list[tuple[Row, Cycle]]:
        """One draft - verify - accept cycle for all decoding rows (one host sync).

        Args:
            plan: per row, its ``batch_auto.Option`` (block; copy: verify its context's
                lookup draft on any match); None: each row's own block (``block_size`` for
                an auto row), copied where a match of ``FIXED_MIN_MATCH`` tokens rests.

        Returns:
            (row, Cycle) per decoding row, in batch order.
        """
        rows = self.rows
        if not rows:
            return []
        want = [o.block for o in plan] if plan else [r.block or self.block for r in rows]
        blocks = [max(1, min(b, r.max_tokens - r.generated)) for r, b in zip(rows, want)]
        least = [FIXED_MIN_MATCH] * len(rows)  # a fixed block copies on this long a match
        for i, (r, o) in enumerate(zip(rows, plan or [])):
            least[i] = least[i] if r.sched is None else int(o.copy)  # auto: as planned
        L = max(blocks)
        keys = []
        for r in rows:
            r.key, k_draft, k_acc = mx.random.split(r.key, 3)
            keys.append((k_draft, k_acc))
        anchors = mx.array([r.history[-1] for r in rows], dtype=mx.uint32)
        copies = [self._copy(r, b, m) for r, b, m in zip(rows, blocks, least)]
        drafts, q_full = self._draft(anchors, L, blocks, keys, copies)
        ids = mx.concatenate([anchors[:, None], _pad(drafts, L - 1)], axis=1)  # [B, L]
        adapter = self.model.adapter
        snap = adapter.snapshot(self.target) if adapter.is_hybrid else None
        v_logits, feats = adapter(ids, self.target)
        outs = [
            accept(v_logits[i : i + 1, :b], r.history, drafts[i], q_full[i], r.params, keys[i][1])
            for i, (r, b) in enumerate(zip(rows, blocks))
        ]
        mx.eval([o for pair in outs for o in pair], drafts)  # the cycle's one host sync
        kept = [int(n.item()) + 1 for n, _ in outs]
        self._rollback(L, kept, feats, snap)
        result = []
        for i, (r, b, (n, bonus)) in enumerate(zip(rows, blocks, outs)):
            a = kept[i] - 1
            committed = drafts[i].tolist()[:a] + [bonus.item()]
            r.history += committed
            r.generated += len(committed)
            if r.index is not None:
                r.index.extend(committed)
            match = copies[i][2] if copies[i] else 0
            result.append((r, Cycle(committed, a, b - 1, lookup=match)))
        self.cycles += 1
        if self.cycles % COMPACT_EVERY == 0:
            self._compact()
        return result

    def _copy(self, row: Row, b: int, least: int):
        """(copied drafts [b - 1], their proposal rows or None, match length) when the
        row's context has a match of at least ``least`` tokens (0: never), else None."""
        if row.index is None or b < 2 or least < 1:
            return None
        tokens, match = row.index.propose(b - 1)
        if match < least:
            return None
        return (*copied_drafts(tokens, self.model.adapter.vocab_size, row.params), match)

    def _draft(self, anchors, L, blocks, keys, copies):
        """Drafts [b_i - 1] and proposal rows (or None) per row: copied ones where given,
        the rest from one drafter pass (none when every drafting row copies). The drafter's
        head, most of its cost, reads only the drafting rows' positions."""
        out = [c[:2] if c else (mx.array([], dtype=mx.uint32), None) for c in copies]
        todo = [i for i, (c, b) in enumerate(zip(copies, blocks)) if c is None and b >= 2]
        self.drafting = todo
        model, drafter = self.model, self.model.drafter
        if todo:
            args = drafter.args
            masks = mx.full((len(blocks), L - 1), args.mask_token_id, mx.uint32)
            ids = mx.concatenate([anchors[:, None], masks], axis=1)
            emb = embed_block(model.adapter.embed, ids, args, drafter.fc.weight.dtype)
            ctx = self.context
            kv = [c.keys_and_values() if c.keys is not None else (None, None) for c in ctx]
            hidden = drafter(emb, kv, ctx[0].offset, L, self._context_mask(L))
            width = max(blocks[i] for i in todo)
            hidden = hidden[mx.array(todo), :width]  # [D, width, H]: the drafting rows
            d_logits = model.draft_logits(hidden[:, 1:])  # [D, width-1, V'] (draft vocabulary)
        for j, i in enumerate(todo):
            r, b = self.rows[i], blocks[i]
            out[i] = propose(
                model,
                d_logits[j : j + 1, : b - 1],
                hidden[j : j + 1, 1:b],
                anchors[i],
                r.params,
                r.use_selector,
                keys[i][0],
            )
        return [d for d, _ in out], [q for _, q in out]

    def _context_mask(self, L: int) -> mx.array | None:
        """[B, 1, L, C + L] bool: each block sees its own context rows (the last ``window``
        of them on sliding layers; both demo layers slide alike) and its whole block."""
        c = self.context[0]
        if c.keys is None:
            return None
        C = c._idx
        col = mx.arange(C)[None, :]
        ok = col >= c.left_padding[:, None]  # [B, C]
        if self.window:
            ok = ok & (col >= C - self.window)
        ok = mx.concatenate([ok, mx.ones((ok.shape[0], L), dtype=mx.bool_)], axis=1)
        return ok[:, None, None, :]

    def _rollback(self, L: int, kept: list[int], feats: mx.array, snap: list | None) -> None:
        """Keep the first kept[i] of the L tokens just fed, per row, in both models' caches."""
        m = max(kept)
        pad = [m - k for k in kept]
        if snap is not None and min(kept) < L:  # every row kept all: the states stand
            self.model.adapter.rewind_rows(self.target, kept, snap)
        for c in self.target:
            if not recurrent(c):
                c.trim(L - m)
        _shift(self.target, pad)
        drafter = self.model.drafter
        x_ctx = drafter.project_context(feats[:, :m])
        for layer, c in zip(drafter.layers, self.context):
            c.update_and_fetch(*layer.self_attn.kv(x_ctx, c.offset))
        _shift(self.context, pad)
        mx.async_eval([_arrays(c) for c in self.target + self.context])

    def _compact(self) -> None:
        """Shed the left padding every row has, and drafter context rows that every row's
        window has passed (both only cost attention work)."""
        every = mx.arange(len(self.rows))
        for c in self.target + self.context:
            c.filter(every)
        for c in self.context if self.window else []:
            cut = c._idx - self.window
            if cut > 0:
                c.keys, c.values = c.keys[..., cut:, :], c.values[..., cut:, :]
                c._idx -= cut
                c.left_padding = mx.maximum(c.left_padding - cut, 0)


def _arrays(c) -> list:
    return [s for s in c.cache if s is not None] if recurrent(c) else [c.keys, c.values, c.offset]


def _pad(rows: list[mx.array], n: int) -> mx.array:
    """Stack 1-D uint32 rows, right-padded with zeros to n -> [B, n]."""
    out = [mx.concatenate([r, mx.zeros((n - r.shape[0],), mx.uint32)]) for r in rows]
    return mx.stack(out) if n else mx.zeros((len(rows), 0), mx.uint32)
