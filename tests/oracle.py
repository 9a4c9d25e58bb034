"""A drafter wrapper that proposes a known continuation, to force chosen acceptance patterns."""

import mlx.core as mx


class OracleDrafter:
    """Wraps a real drafter; its logits put the known next tokens on top.

    Args:
        real: the loaded drafter. sequence: prompt + the target's continuation.
        wrong_at: block rows (1-based) whose proposal is replaced by a wrong token.
        vocab: vocabulary size.
    """

    def __init__(self, real, sequence, wrong_at=(), vocab=None):
        self.real, self.sequence, self.wrong_at = real, list(sequence), set(wrong_at)
        self.vocab = vocab
        self.pos = 0

    def __getattr__(self, name):
        return getattr(self.real, name)

    def step(self, block_embeds, cache):
        self.pos = cache[0].offset  # absolute position of the anchor
        return self.real.step(block_embeds, cache)

    def logits(self, hidden, lm_head):
        L = hidden.shape[1]
        real = self.real.logits(hidden, lm_head)
        rows = []
        for t in range(1, L + 1):
            i = self.pos + t
            tok = self.sequence[i] if i < len(self.sequence) else 0
            if t in self.wrong_at:
                tok = (tok + 1) % real.shape[-1]
            rows.append(tok)
        onehot = mx.zeros(real.shape).at[0, mx.arange(L), mx.array(rows)].add(200.0)
        return real + onehot
