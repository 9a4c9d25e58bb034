"""DFlash 1 / DFlash 2 drafter (docs/algorithm.md §2, docs/format.md §2-§3): one
bidirectional pass drafts a whole block.

Attribute names follow the released checkpoints so weights load without a renaming table.
The drafter owns no embedding and no LM head: both are borrowed from the target.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx_lm.models.activations import swiglu
from mlx_lm.models.rope_utils import initialize_rope

from .. import ops
from .config import DrafterArgs
from .context import ContextCache
from .conv import TwoTapConv
from .selector import PathSelector

Offset = int | mx.array
PENDING_MAX = 2048  # feature rows a context cache holds unprojected at most


def embed_block(
    embed: Callable[[mx.array], mx.array],
    ids: mx.array,
    args: DrafterArgs,
    dtype: mx.Dtype | None = None,
) -> mx.array:
    """The drafter's block input (docs/algorithm.md §2.2), for decoding and training alike:
    the target's token embedding of the block ids, times ``input_embedding_scale``, in the
    drafter's dtype.

    Args:
        embed: the target's token embedding, e.g. ``TargetAdapter.embed``.
        ids: block ids [N, L], each row ``[anchor, mask, ..., mask]``.
        args: the drafter's configuration.
        dtype: the drafter's compute dtype (``drafter.fc.weight.dtype``); None keeps the
            embedding's.

    Returns:
        [N, L, H] block embeddings.
    """
    emb = embed(ids)
    scale = args.input_embedding_scale
    emb = emb if scale == 1.0 else emb * scale
    return emb if dtype is None else emb.astype(dtype)


def block_mask(anchors: np.ndarray, context: int, block: int, window: int | None) -> np.ndarray:
    """Attention mask for many blocks drafted at once over one shared context (training,
    teacher-forced evaluation): block j sees the context rows before its anchor (the last
    ``window - 1`` of them on sliding layers) and all of its own rows.

    Args:
        anchors: absolute anchor positions [N]. context: context rows T. block: rows per block.
        window: the drafter's sliding window, or None.

    Returns:
        bool mask [N, 1, block, T + block].
    """
    col = np.arange(context)[None, :]
    ctx = col < anchors[:, None]  # [N, T]
    if window:
        ctx &= col >= anchors[:, None] - (window - 1)
    mask = np.concatenate([ctx, np.ones((len(anchors), block), bool)], axis=1)
    return np.broadcast_to(mask[:, None, None, :], (len(anchors), 1, block, context + block))


class Attention(nn.Module):
    """Qwen3 attention whose keys are the context rows followed by the block rows."""

    def __init__(self, args: DrafterArgs):
        super().__init__()
        H, hd = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.scale = hd**-0.5
        self.q_proj = nn.Linear(H, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(H, self.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(H, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, H, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.rope = initialize_rope(
            hd,
            base=args.rope_theta,
            traditional=False,
            scaling_config=args.rope_scaling,
            max_position_embeddings=args.max_position_embeddings,
        )

    def kv(self, x: mx.array, offset: Offset) -> tuple[mx.array, mx.array]:
        """Keys and values of rows x [N, L, H] at positions offset.. -> [N, n_kv, L, hd]."""
        N, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(N, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(N, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return self.rope(k, offset=offset), v

    def __call__(self, x, ctx_kv, offset: Offset, mask=None) -> mx.array:
        """Attend from block rows x [N, L, H] to context + block rows.

        Args:
            ctx_kv: (keys, values) of the context [1 or N, n_kv, C, hd], its
                ContextCache (inference: nothing is copied), or None.
            offset: absolute position of block row 0 (int or [N]).
            mask: None (every row sees everything) or [N, 1, L, C + L] bool / additive.
        """
        N, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(N, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=offset)
        k, v = self.kv(x, offset)
        if isinstance(ctx_kv, ContextCache):
            k, v = ctx_kv.with_block(k, v)
        elif ctx_kv is not None and ctx_kv[0] is not None:
            ck, cv = ctx_kv
            if ck.shape[0] != N:
                ck = mx.broadcast_to(ck, (N,) + ck.shape[1:])
                cv = mx.broadcast_to(cv, (N,) + cv.shape[1:])
            k, v = mx.concatenate([ck, k], axis=2), mx.concatenate([cv, v], axis=2)
        out = ops.attention(q, k, v, self.scale, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(N, L, -1))


class MLP(nn.Module):
    """SwiGLU MLP with Qwen3 names."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    """Drafter layer; DFlash 2 wraps both sublayers in a two-tap conv pair."""

    def __init__(self, args: DrafterArgs):
        super().__init__()
        H = args.hidden_size
        self.self_attn = Attention(args)
        self.mlp = MLP(H, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.has_conv = args.is_dflash2
        if self.has_conv:
            k, gs = args.conv_kernel_size, args.conv_group_size
            self.attention_conv = TwoTapConv(H, k, gs)
            self.mlp_conv = TwoTapConv(H, k, gs)

    def __call__(self, x, ctx_kv, offset: Offset, block_size: int, mask=None) -> mx.array:
        u = self.input_layernorm(x)
        if self.has_conv:
            u, d1 = self.attention_conv.prepare(u, block_size)
            r = self.attention_conv.finish(self.self_attn(u, ctx_kv, offset, mask), d1, block_size)
        else:
            r = self.self_attn(u, ctx_kv, offset, mask)
        h = x + r
        u = self.post_attention_layernorm(h)
        if self.has_conv:
            u, d1 = self.mlp_conv.prepare(u, block_size)
            return h + self.mlp_conv.finish(self.mlp(u), d1, block_size)
        return h + self.mlp(u)


class DFlashDrafter(nn.Module):
    """The drafter backbone plus (DFlash 2) the path selector.

    Args:
        args: parsed drafter config.
    """

    def __init__(self, args: DrafterArgs):
        super().__init__()
        self.args = args
        H = args.hidden_size
        self.fc = nn.Linear(self.feature_size, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.layers = [DecoderLayer(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        if args.is_dflash2:
            self.candidate_selector = PathSelector(H, args.selector_rank, args.vocab_size)
        # Sorted target ids the drafter was trained to score (numpy int32), or None.
        self.draft_vocab: np.ndarray | None = None

    @property
    def feature_size(self) -> int:
        """Width of the target features it reads per token (nT * H)."""
        return len(self.args.target_layer_ids) * self.args.hidden_size

    @property
    def has_selector(self) -> bool:
        """Whether this checkpoint carries a path selector (DFlash 2)."""
        return self.args.is_dflash2

    def make_cache(self) -> list[ContextCache]:
        """One context cache per layer, windowed for sliding layers."""
        return [ContextCache(self.args.window(i)) for i in range(len(self.layers))]

    def project_context(self, features: mx.array) -> mx.array:
        """x_ctx = hidden_norm(fc(concat of target layer outputs)); [N, C, nT*H] -> [N, C, H]."""
        return self.hidden_norm(self.fc(features))

    def context_kv(self, x_ctx: mx.array, offset: Offset = 0):
        """Per-layer context (keys, values) of x_ctx rows starting at offset (training use)."""
        return [layer.self_attn.kv(x_ctx, offset) for layer in self.layers]

    def append_context(
        self, features: mx.array, cache: list[ContextCache], lazy: bool = True
    ) -> None:
        """Add the features [1, n, nT*H] of newly committed tokens to the context caches.

        Lazily by default: they are projected when the drafter next runs (``step``), so a
        request that never speculates (``block_size="auto"`` on a slow BLAS) never pays
        for it; at most ``PENDING_MAX`` rows wait, which bounds the memory held.
        """
        for c in cache:
            c.pending.append(features)
        if not lazy or cache[0].pending_rows > PENDING_MAX:
            self.flush_context(cache)

    def flush_context(self, cache: list[ContextCache]) -> None:
        """Project the pending feature rows into every layer's context K/V."""
        if not cache[0].pending:
            return
        feats = mx.concatenate(cache[0].pending, axis=1)
        x_ctx = self.project_context(feats)
        for layer, c in zip(self.layers, cache):
            c.pending = []
            c.append(*layer.self_attn.kv(x_ctx, c.offset))

    def __call__(
        self,
        block_embeds: mx.array,
        ctx_kv: list,
        offset: Offset,
        block_size: int | None = None,
        mask: mx.array | None = None,
    ) -> mx.array:
        """Run the block rows [N, L, H] through the backbone.

        Args:
            block_embeds: embedded [anchor, mask, ...] rows (several blocks may be
                concatenated along L for training, each block_size rows long).
            ctx_kv: per layer (keys, values) of the context, its ContextCache, or None.
            offset: absolute position of block row 0 (int or [N]).
            block_size: rows per block for the conv taps (default: L).
            mask: optional attention mask [N, 1, L, C + L].

        Returns:
            the final normed hidden states [N, L, H].
        """
        block_size = block_size or block_embeds.shape[1]
        x = block_embeds
        for layer, kv in zip(self.layers, ctx_kv):
            x = layer(x, kv, offset, block_size, mask)
        return self.norm(x)

    def step(self, block_embeds: mx.array, cache: list[ContextCache]) -> mx.array:
        """Inference: one block after the cached context; returns hidden [1, L, H]."""
        self.flush_context(cache)
        return self(block_embeds, cache, cache[0].offset)

    def logits(self, hidden: mx.array, lm_head) -> mx.array:
        """Target LM head, output multiplier and optional soft-capping; [.., H] -> [.., V]."""
        out = lm_head(hidden)
        if self.args.output_multiplier != 1.0:
            out = out * self.args.output_multiplier
        cap = self.args.final_logit_softcapping
        if cap:
            out = mx.tanh(out / cap) * cap
        return out
