"""A drafter wrapper that proposes a known continuation, to force chosen acceptance patterns."""

import mlx.core as mx
import numpy as np


class OracleDrafter:
    """Wraps a real drafter; its logits put the known next tokens on top.

    Args:
        real: the loaded drafter. sequence: prompt + the target's continuation.
        wrong_at: block rows (1-based) whose proposal is replaced by a wrong token.
        vocab: vocabulary size.
    """

    def __init__(self, real, sequence, wrong_at=(), vocab=None, second_at=()):
        self.real, self.sequence, self.wrong_at = real, list(sequence), set(wrong_at)
        self.second_at = set(second_at)  # rows where the known token ranks second
        self.vocab = vocab
        self.pos = 0

    def __getattr__(self, name):
        return getattr(self.real, name)

    def step(self, block_embeds, cache):
        from dflash_mlx.cpu import draft_step

        self.pos = cache[0].position  # absolute position of the anchor
        return draft_step.step(self.real, block_embeds, cache)  # compiled, as decoding runs

    def logits(self, hidden, lm_head):
        L = hidden.shape[1]
        real = self.real.logits(hidden, lm_head)
        # With a draft vocabulary (a DraftHead) columns are its ids; a token outside it
        # cannot be proposed, so that row keeps the real drafter's choice.
        ids = getattr(lm_head, "ids", None)
        ids = None if ids is None else np.array(ids).tolist()
        rows, cols = [], []
        for t in range(1, L + 1):
            i = self.pos + t
            tok = self.sequence[i] if i < len(self.sequence) else 0
            if t in self.second_at and ids is None:  # the known token +200, a wrong one +400
                rows += [t - 1, t - 1]
                cols += [tok, (tok + 1) % real.shape[-1]]
                tok = (tok + 1) % real.shape[-1]
            elif t in self.wrong_at:
                tok = (tok + 1) % real.shape[-1] if ids is None else ids[0] + (tok == ids[0])
            if ids is not None:
                if tok not in ids:
                    continue
                tok = ids.index(tok)
            rows.append(t - 1)
            cols.append(tok)
        if not rows:
            return real
        onehot = mx.zeros(real.shape).at[0, mx.array(rows), mx.array(cols)].add(200.0)
        return real + onehot


class BatchOracle:
    """The batched counterpart: row r of a ``BatchDecoder`` proposes the known continuation
    of its request (``sequences[uid]``), wrong at ``wrong_at[uid]`` block rows.

    Args:
        real: the loaded drafter. decoder: the BatchDecoder whose rows are drafted.
        sequences, wrong_at: per uid, as for ``OracleDrafter``.
    """

    def __init__(self, real, decoder, sequences, wrong_at):
        self.real, self.decoder = real, decoder
        self.sequences, self.wrong_at = sequences, wrong_at
        self.pos = []

    def __getattr__(self, name):
        return getattr(self.real, name)

    def __call__(self, block_embeds, ctx_kv, offset, block_size=None, mask=None):
        self.pos = mx.broadcast_to(mx.array(offset), (block_embeds.shape[0],)).tolist()
        return self.real(block_embeds, ctx_kv, offset, block_size, mask)

    def logits(self, hidden, lm_head):
        L = hidden.shape[1]
        real = self.real.logits(hidden, lm_head)
        onehot = mx.zeros(real.shape)
        for b, r in enumerate(self.decoder.drafting):  # the head reads the drafting rows
            row = self.decoder.rows[r]
            seq, wrong = self.sequences[row.uid], self.wrong_at.get(row.uid, ())
            toks = []
            for t in range(1, L + 1):
                i = self.pos[r] + t
                tok = seq[i] if i < len(seq) else 0
                toks.append((tok + 1) % real.shape[-1] if t in wrong else tok)
            onehot = onehot.at[b, mx.arange(L), mx.array(toks)].add(200.0)
        return real + onehot
