"""Tree verification: the drafter's path plus its next-best first tokens, verified in one
target pass (docs/algorithm.md §4.5).

A block of ``rows`` verify rows holds the anchor, the path's ``chain - 1`` drafts and ``s``
siblings: the drafter's best first tokens other than the path's own. Each sibling is placed
where the path's first draft is (one position after the anchor) and sees only the context and
the anchor, so its row's logits are the target's for the anchor followed by that sibling.

The first draft is where the demo drafter misses most (Recall@1 29.5% at position 0, Recall@4
47.7%), and the path's far positions are rarely reached, so a few rows moved from the end of
the path to siblings of its first token commit more per cycle at the same verify width.
Greedy, the committed tokens are the target's argmax at each kept row: the target's own
output. Sampled, the path's rejection rule draws the first token, and a sibling only lets
the cycle draw one more from its own row: the target's law.
"""

from __future__ import annotations

import mlx.core as mx

from .acceptance import accept_sampled, sample_rows, target_probs
from .selector import top_candidates

MAX_SIBLINGS = 3  # past 3 (Recall@4), each more sibling catches under 2% of the misses
SIBLING_PRIOR = 0.08  # share of the path's first-token misses caught per sibling, a priori


def siblings_for(rows: int) -> int:
    """Siblings in a fixed block of ``rows`` verify rows: half its drafts, at most 3 (4 rows:
    1, 8 rows: 3)."""
    return max(0, min(MAX_SIBLINGS, (rows - 1) // 2))


def siblings(logits0: mx.array, first: mx.array, s: int, to_target) -> mx.array:
    """The drafter's best ``s`` first tokens other than the path's (lazy, no host sync).

    Args:
        logits0: the drafter's logits at the first draft position [V'].
        first: the path's first draft [] (target id). s: siblings wanted.
        to_target: maps indices into ``logits0`` to target ids.

    Returns:
        [s] uint32 target ids, best first.
    """
    _, cand = top_candidates(logits0[None, None], s + 1)
    cand = to_target(cand[0, 0])  # [s + 1]
    # the path's own token (if among them) sorts last; the rest keep their rank
    order = mx.argsort((cand == first).astype(mx.int32) * (s + 1) + mx.arange(s + 1))
    return cand[order[:s]].astype(mx.uint32)


def positions(offset: int, chain: int, rows: int) -> list[int]:
    """Each verify row's position: the path's rows in order, the siblings at the first
    draft's (offset + 1)."""
    return [offset + i for i in range(chain)] + [offset + 1] * (rows - chain)


def mask(offset: int, chain: int, rows: int) -> mx.array:
    """Which keys each verify row sees [rows, offset + rows] (bool): the cached context, the
    path's rows up to its own (rows 0..chain-1), and for a sibling the anchor and itself."""
    i = mx.arange(rows)[:, None]
    j = mx.arange(rows)[None]
    path = (j <= i) & (i < chain)
    sees = path | (j == i) | ((j == 0) & (i >= chain))  # [rows, rows]
    ctx = mx.ones((rows, offset), dtype=mx.bool_)
    return mx.concatenate([ctx, sees], axis=1)


def accept(targets: list[int], drafts: list[int], sibs: list[int]):
    """Greedy acceptance over the tree.

    Args:
        targets: the target's argmax at each verify row (anchor, path drafts, siblings).
        drafts: the path's drafts. sibs: the siblings.

    Returns:
        (accepted drafts, committed ids, verify rows to keep in order, sibling taken: 0 for
        none, else its 1-based rank).
    """
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    if a:
        return a, drafts[:a] + [targets[a]], list(range(a + 1)), 0
    for j, t in enumerate(sibs):
        if t == targets[0]:
            row = 1 + len(drafts) + j
            return 1, [t, targets[row]], [0, row], j + 1
    return 0, [targets[0]], [0], 0


def verify(adapter, cache: list, anchor, drafts, sibs, clock, params=None, q=None, key=None):
    """Verify the tree [anchor, path drafts, siblings] and keep the committed rows.

    Greedy: ``accept``. Sampled: the path by rejection sampling (``accept_sampled``); when
    its first draft is rejected, the token drawn from the residual is the first token, and
    if it is a sibling the target's row for it gives the next token, drawn from its law.

    Args:
        adapter: the ``TargetAdapter`` (``tree_ok``). cache: its layer caches.
        anchor: [1]; drafts: the path's drafts; sibs: the first draft's siblings.
        clock: the cycle's stage timer. params: the target's sampling (None: greedy).
        q: the path drafts' proposal rows [d, V] (sampled). key: the acceptance PRNG key.

    Returns:
        (accepted drafts, committed ids, the kept rows' features [1, n, F], sibling taken).
    """
    chain = 1 + drafts.size
    fed = chain + sibs.size
    v_logits, feats = adapter(mx.concatenate([anchor, drafts, sibs])[None], cache, chain)
    clock.lap("verify", v_logits, feats)
    if params is None or params.greedy:
        targets = mx.argmax(v_logits[0], axis=-1)  # [fed]
        mx.eval(targets, drafts, sibs)  # the cycle's one host sync
        a, committed, rows, taken = accept(targets.tolist(), drafts.tolist(), sibs.tolist())
    else:
        a, committed, rows, taken = _sampled(v_logits[0], chain, drafts, sibs, params, q, key)
    clock.lap("acceptance")
    adapter.keep_rows(cache, fed, rows)
    feats = feats[:, mx.array(rows)] if taken else feats[:, : a + 1]
    return a, committed, feats, taken


def _sampled(logits, chain: int, drafts, sibs, params, q, key):
    """Sampled acceptance of a tree: (accepted, committed ids, kept rows, sibling taken).

    The first token after the anchor has the target's law either way (the path's rule);
    a sibling only lets the cycle go one token further, drawn from the sibling's own row."""
    k_path, k_side = mx.random.split(key)
    p = target_probs(logits, params)  # [fed, V]
    n_acc, bonus = accept_sampled(p[:chain], drafts, q, k_path)
    after = sample_rows(p[chain:], k_side)  # [s]: the token after each sibling
    mx.eval(n_acc, bonus, after, drafts, sibs)  # the cycle's one host sync
    a, first, side = n_acc.item(), bonus.item(), sibs.tolist()
    if a == 0 and first in side:
        j = side.index(first)
        return 1, [first, after.tolist()[j]], [0, chain + j], j + 1
    return a, drafts.tolist()[:a] + [first], list(range(a + 1)), 0
