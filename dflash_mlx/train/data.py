"""Training batches for the drafter from self-distillation shards (see ``distill.py``).

A batch holds S answers, each padded to a common length T, and ``n_blocks`` anchors per
answer. An anchor a is an answer position (decoding never anchors inside the prompt); its
block is ``[x_a, mask, ...]`` at positions a..a+B-1, it sees the context rows < a, and row k
is labelled with the target's greedy token for position a+k. Rows past the end of the answer
get weight 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash_mlx.model.drafter import block_mask


@dataclass
class Seq:
    """One distilled sequence: where its rows live in a shard."""

    shard: int
    tok0: int  # first token in the shard's tokens
    feat0: int  # first feature row in the shard's feats
    n: int  # tokens (features: n - 1)
    prompt: int  # prompt tokens


class ShardSet:
    """Every finished shard of one or more split folders, features memory-mapped.

    Args:
        root: a split folder (e.g. ``.work/distill/train``) or a list of them.
        min_answer: skip sequences whose answer is shorter than this.
        scale: per-channel divisor of the features (see ``feature_scale``), or None.
    """

    def __init__(self, root, min_answer: int = 2, scale: np.ndarray | None = None):
        roots = [Path(r) for r in root] if isinstance(root, (list, tuple)) else [Path(root)]
        self.root, self.scale = roots[0], scale
        self.shards, self.seqs, self.soft = [], [], []
        dirs = [d for r in roots for d in sorted(r.glob("shard_*")) if d.is_dir()]
        for d in dirs:
            if "." in d.name:
                continue
            soft = None
            if (d / "topk_ids.npy").exists():
                soft = (
                    np.load(d / "topk_ids.npy", mmap_mode="r"),
                    np.load(d / "topk_logp.npy", mmap_mode="r"),
                )
            self.soft.append(soft)
            tokens = np.load(d / "tokens.npy")
            teacher = np.load(d / "teacher.npy")
            feats = np.load(d / "feats.npy", mmap_mode="r")
            starts = np.load(d / "starts.npy")
            plens = np.load(d / "prompt_lens.npy")
            ends = np.append(starts[1:], len(tokens))
            f0 = 0
            k = len(self.shards)
            for s, e, p in zip(starts, ends, plens):
                n = int(e - s)
                if n - p >= min_answer:
                    self.seqs.append(Seq(k, int(s), f0, n, int(p)))
                f0 += n - 1
            self.shards.append((tokens, teacher, feats))
        if not self.seqs:
            raise FileNotFoundError(f"no finished shards under {', '.join(map(str, roots))}")

    @property
    def tokens(self) -> int:
        """Answer tokens held (the positions anchors are drawn from)."""
        return sum(s.n - s.prompt for s in self.seqs)

    def label_counts(self, vocab: int) -> np.ndarray:
        """How often each token is an answer label (the target's greedy output)."""
        counts = np.zeros(vocab, np.int64)
        for s in self.seqs:
            _, teacher, _ = self.shards[s.shard]
            lab = teacher[s.feat0 + s.prompt - 1 : s.feat0 + s.n - 1]
            counts += np.bincount(lab, minlength=vocab)[:vocab]
        return counts

    @property
    def has_soft(self) -> bool:
        """Whether every shard holds the target's top-k log-probabilities."""
        return all(x is not None for x in self.soft)

    def soft_rows(self, s: Seq):
        """(top-k ids [n-1, k], log-probs [n-1, k] float32) of one sequence."""
        ids, logp = self.soft[s.shard]
        rows = slice(s.feat0, s.feat0 + s.n - 1)
        return np.asarray(ids[rows]), np.asarray(logp[rows], dtype=np.float32)

    def rows(self, s: Seq):
        """(tokens [n], teacher [n-1], feats [n-1, D] float32) of one sequence."""
        tokens, teacher, feats = self.shards[s.shard]
        f = np.asarray(feats[s.feat0 : s.feat0 + s.n - 1], dtype=np.float32)
        if self.scale is not None:
            f /= self.scale
        return tokens[s.tok0 : s.tok0 + s.n], teacher[s.feat0 : s.feat0 + s.n - 1], f


def feature_scale(data: ShardSet, rows: int = 50000, seed: int = 0) -> np.ndarray:
    """The root mean square of every feature channel over a sample of rows, floored.

    Target hidden states mix channels of RMS ~3 with a few of ~500 (massive activations);
    under Adam every weight moves at the same rate, so the drafter's ``fc`` sees them
    through standardized inputs, and the scale is folded into ``fc.weight`` at export.
    """
    rng = np.random.default_rng(seed)
    parts = []
    for _, _, feats in data.shards:
        take = np.sort(rng.choice(len(feats), min(len(feats), rows // len(data.shards)), False))
        parts.append(np.asarray(feats[take], dtype=np.float32))
    x = np.concatenate(parts)
    return np.maximum(np.sqrt((x * x).mean(0)), 1e-3).astype(np.float32)


def _bucket(n: int, step: int = 64) -> int:
    return -(-n // step) * step


def build_batch(
    data: ShardSet,
    picks,
    n_blocks: int,
    B: int,
    mask_id: int,
    rng: np.random.Generator,
    window: int | None = None,
    anchors=None,
    soft_k: int = 0,
):
    """Batch arrays for the sequences ``picks`` (indices into ``data.seqs``).

    Args:
        data: the shards. picks: sequence indices [S]. n_blocks: anchors per sequence.
        B: block size. mask_id: the mask token. rng: anchor generator.
        window: the drafter's sliding window. anchors: fixed anchors [S, n_blocks] (eval).
        soft_k: the target's top-k log-probabilities to add per label (0: none; only when
            every shard has them): ``soft_ids`` / ``soft_logp`` [N, B-1, soft_k], -inf
            past the answer.

    Returns:
        dict of numpy arrays: feats [S, T, D], ids [N, B], labels [N, B-1],
        valid [N, B-1] (0 past the answer's end), offsets [N], mask [N, 1, B, T + B].
    """
    seqs = [data.seqs[i] for i in picks]
    parts = [data.rows(s) for s in seqs]  # (tokens [n], teacher [n-1], feats [n-1, D])
    T = _bucket(max(s.n - 1 for s in seqs))
    feats, ids, labels, valid, offs = _empty_batch(
        len(seqs), n_blocks, T, parts[0][2].shape[1], B, mask_id
    )
    soft = data.has_soft and soft_k > 0
    if soft:
        soft_ids = np.zeros((len(ids), B - 1, soft_k), np.int32)  # [N, B-1, soft_k]
        soft_lp = np.full((len(ids), B - 1, soft_k), -np.inf, np.float32)
    for j, (s, (tok, teach, f)) in enumerate(zip(seqs, parts)):
        feats[j, : s.n - 1] = f
        a = _draw_anchors(s, n_blocks, rng) if anchors is None else anchors[j]  # [n_blocks]
        rows = slice(j * n_blocks, (j + 1) * n_blocks)
        ids[rows, 0], offs[rows] = tok[a], a  # the block [x_a, mask, ...] starts at a
        lab, ok, at = _label_rows(teach, a, s.n, B)
        labels[rows], valid[rows] = lab, ok
        if soft:
            soft_ids[rows], soft_lp[rows] = _soft_rows(data.soft_rows(s), at, ok, soft_k)
    out = {
        "feats": feats,
        "ids": ids,
        "labels": labels,
        "valid": valid,
        "offsets": offs,
        "mask": block_mask(offs, T, B, window),
    }
    if soft:
        out["soft_ids"], out["soft_logp"] = soft_ids, soft_lp
    return out


def _empty_batch(S: int, n_blocks: int, T: int, D: int, B: int, mask_id: int):
    """(feats [S, T, D], ids [N, B] all masks, labels [N, B-1], valid [N, B-1], offsets [N])
    before any answer is written in, N = S * n_blocks."""
    N = S * n_blocks
    return (
        np.zeros((S, T, D), np.float32),
        np.full((N, B), mask_id, np.int32),
        np.zeros((N, B - 1), np.int32),
        np.zeros((N, B - 1), np.float32),
        np.zeros(N, np.int32),
    )


def _draw_anchors(s: Seq, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """``n_blocks`` random anchors in the answer of ``s``."""
    lo, hi = s.prompt, s.n - 2  # anchor a needs teacher[a] (row 1's label)
    return rng.integers(lo, hi + 1, size=n_blocks)


def _label_rows(teach: np.ndarray, a: np.ndarray, n: int, B: int):
    """The labels of the blocks anchored at ``a`` [n_blocks] in a sequence of n tokens.

    Returns:
        (labels [n_blocks, B-1] (0 past the answer), ok [n_blocks, B-1] (a label within the
        answer), the teacher rows read [n_blocks, B-1] (clamped into the answer)).
    """
    pos = a[:, None] + np.arange(B - 1)[None, :]  # row k's label is teacher[a + k - 1]
    ok = pos <= n - 2
    at = np.minimum(pos, n - 2)
    return np.where(ok, teach[at], 0), ok, at


def _soft_rows(top_k, at: np.ndarray, ok: np.ndarray, k: int):
    """The target's top-k (ids, log-probs) [n_blocks, B-1, k] at the teacher rows ``at``
    (``ShardSet.soft_rows``' arrays); log-probs -inf past the answer (not ``ok``)."""
    k_ids, k_lp = top_k
    return k_ids[at][..., :k], np.where(ok[..., None], k_lp[at][..., :k], -np.inf)


def shortlist(data: ShardSet, vocab: int, cap: int, floor: int = 256) -> np.ndarray:
    """Token ids the training head scores: every answer label (at least ``floor`` tokens,
    the most frequent first), or the ``cap`` most frequent. Softmax over all 49k entries
    costs most of a CPU step (MLX's CPU exp is scalar); held-out evaluation always uses the
    full vocabulary."""
    counts = data.label_counts(vocab)
    order = np.argsort(-counts, kind="stable")
    n = min(cap, vocab, max(int((counts > 0).sum()), floor))
    return np.sort(order[:n]).astype(np.int32)


def data_roots(data_dir) -> tuple:
    """(train split folders, held-out split folder) of a distill folder (``train/``,
    ``heldout/``) or of an explicit ``(train folders, held-out folder)`` pair."""
    if isinstance(data_dir, tuple):
        return [Path(r) for r in data_dir[0]], Path(data_dir[1])
    return [Path(data_dir) / "train"], Path(data_dir) / "heldout"


class Batches:
    """Reproducible training batches (seeded by step), labels mapped onto the shortlist."""

    def __init__(self, data: ShardSet, drafter, seqs, n_blocks, gamma, vocab_ids, seed, soft_k=0):
        self.data, self.args, self.seqs, self.n_blocks, self.seed = (
            data,
            drafter.args,
            seqs,
            n_blocks,
            seed,
        )
        self.soft_k = soft_k if data.has_soft else 0
        B = self.args.block_size
        self.pos_w = np.exp(-np.arange(B - 1) / gamma).astype(np.float32)
        self.index = np.full(self.args.vocab_size, -1, np.int64)
        self.index[vocab_ids] = np.arange(len(vocab_ids))

    def __call__(self, step: int):
        a, rng = self.args, np.random.default_rng([self.seed, step])
        picks = rng.integers(0, len(self.data.seqs), self.seqs)
        blk = build_batch(
            self.data,
            picks,
            self.n_blocks,
            a.block_size,
            a.mask_token_id,
            rng,
            a.sliding_window,
            soft_k=self.soft_k,
        )
        idx = self.index[blk["labels"]]
        blk["labels"] = np.maximum(idx, 0).astype(np.int32)
        blk["weights"] = (blk["valid"] * (idx >= 0) * self.pos_w).astype(np.float32)
        if "soft_ids" in blk:  # teacher top-k over the shortlist, renormalised
            sidx = self.index[blk.pop("soft_ids")]
            p = np.where(sidx >= 0, np.exp(blk.pop("soft_logp")), 0.0)
            blk["soft_idx"] = np.maximum(sidx, 0).astype(np.int32)
            blk["soft_p"] = (p / np.maximum(p.sum(-1, keepdims=True), 1e-9)).astype(np.float32)
        else:
            shape = blk["labels"].shape + (1,)
            blk["soft_idx"] = np.zeros(shape, np.int32)
            blk["soft_p"] = np.zeros(shape, np.float32)
        return blk


def eval_anchors(data: ShardSet, n_seqs: int, n_blocks: int, seed: int = 1234):
    """Fixed (sequence picks, anchors) for comparable held-out evaluations."""
    rng = np.random.default_rng(seed)
    picks = np.linspace(0, len(data.seqs) - 1, min(n_seqs, len(data.seqs))).astype(int)
    anchors = [rng.integers(data.seqs[i].prompt, data.seqs[i].n - 1, size=n_blocks) for i in picks]
    return picks, np.stack(anchors)
