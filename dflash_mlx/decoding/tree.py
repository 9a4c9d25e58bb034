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

from ..model.selector import top_candidates
from .acceptance import accept_greedy, accept_sampled, sample_rows, target_probs

MAX_SIBLINGS = 3  # past 3 (Recall@4), each more sibling catches under 2% of the misses
SIBLING_PRIOR = 0.08  # share of the path's first-token misses caught per sibling, a priori


def siblings_for(rows: int) -> int:
    """Siblings in a fixed block of ``rows`` verify rows: half its drafts, at most 3 (4 rows:
    1, 8 rows: 3)."""
    return max(0, min(MAX_SIBLINGS, (rows - 1) // 2))


def siblings(logits0: mx.array, first: mx.array, s: int, to_target) -> mx.array:
    """The drafter's best ``s`` first tokens other than the path's (lazy, no host sync).

    A draft vocabulary of V' ids has at most V' - 1 of them (``DFlashModel.draft_size``):
    fewer are returned then.

    Args:
        logits0: the drafter's logits at the first draft position [V'].
        first: the path's first draft [] (target id). s: siblings wanted.
        to_target: maps indices into ``logits0`` to target ids.

    Returns:
        [min(s, V' - 1)] uint32 target ids, best first.
    """
    k = min(s + 1, logits0.shape[-1])
    _, cand = top_candidates(logits0[None, None], k)
    cand = to_target(cand[0, 0])  # [k]
    # the path's own token (if among them) sorts last; the rest keep their rank
    order = mx.argsort((cand == first).astype(mx.int32) * k + mx.arange(k))
    return cand[order[: min(s, k - 1)]].astype(mx.uint32)


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


def commit(accepted: int, first: int, drafts: list[int], sibs: list[int], after: list[int]):
    """The tree's rule, greedy or sampled, once the path is accepted by its own law.

    Args:
        accepted: the path's drafts accepted. first: the token the path's rule commits
            after them (its bonus). drafts: the path's drafts. sibs: the siblings.
        after: the target's token after each sibling (its argmax, or a draw from its law).

    Returns:
        (accepted drafts, committed ids, verify rows to keep in order, sibling taken: 0 for
        none, else its 1-based rank).
    """
    if accepted == 0 and first in sibs:  # a missed first draft: the target's token is a sibling
        j = sibs.index(first)
        return 1, [first, after[j]], [0, 1 + len(drafts) + j], j + 1
    return accepted, drafts[:accepted] + [first], list(range(accepted + 1)), 0


def verify(adapter, cache: list, anchor, drafts, sibs, clock, params=None, q=None, key=None):
    """Verify the tree [anchor, path drafts, siblings] and keep the committed rows.

    The path is accepted by its own rule (greedy, or rejection sampling); its first committed
    token has the target's law whatever the siblings are. When the first draft is missed and
    that token is a sibling, the sibling's row gives one more token (``commit``): its argmax,
    or a draw from its law with a key of its own.

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
    rows = v_logits[0]  # [fed, V]
    if params is None or params.greedy:
        n_acc, targets = accept_greedy(rows[:chain], drafts)
        bonus, after = targets[n_acc], mx.argmax(rows[chain:], axis=-1)
    else:
        k_path, k_side = mx.random.split(key)
        p = target_probs(rows, params)
        n_acc, bonus = accept_sampled(p[:chain], drafts, q, k_path)
        after = sample_rows(p[chain:], k_side)  # [s]: the token after each sibling
    mx.eval(n_acc, bonus, after, drafts, sibs)  # the cycle's one host sync
    a, committed, kept, taken = commit(
        n_acc.item(), bonus.item(), drafts.tolist(), sibs.tolist(), after.tolist()
    )
    clock.lap("acceptance")
    adapter.keep_rows(cache, fed, kept)
    feats = feats[:, mx.array(kept)] if taken else feats[:, : a + 1]
    return a, committed, feats, taken
