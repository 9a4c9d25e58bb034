"""Target adapter: run an mlx-lm model while capturing decoder-layer outputs, and roll back
its caches after a partially accepted verify (docs/algorithm.md §4.3-§4.4).

Nothing in mlx-lm is edited and no class is patched: the adapter wraps the *instances* of
the tapped layers (and, on hybrids, of the recurrent mixers) of one loaded model. The
backend may prepare the layers further (``ops.prepare_target``: on the Linux CPU, compiled
block-only modules and an exact attention twin with the same bits, ``cpu/target.py``).
"""

from __future__ import annotations

import mlx.core as mx
from mlx import nn
from mlx_lm.models.cache import (
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from .. import ops
from ..decoding import tree
from ..errors import UnsupportedModelError
from . import moe, qmm
from .recurrent import Recorder as _Recorder
from .recurrent import recurrent
from .wrapper import Wrapper as _Wrapper

# Architectures whose attention takes positions from ``cache.offset`` and its mask from
# ``make_mask`` of the first layer's cache: they can verify a tree (``tree.py``).
TREE_TYPES = {"llama", "qwen2", "qwen3", "mistral", "qwen3_moe"}

# Architectures whose layer loop, caches and heads the adapter has been checked against.
SUPPORTED = {
    "qwen3",
    "qwen2",
    "llama",
    "mistral",
    "qwen3_moe",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_next",
    "gpt_oss",
    "muse_glimmer",
    "glm4",
    "glm",
    "phi3",
    "gemma3_text",
    "qwen2_5_vl",  # mlx-vlm's, through vision/target.py
}


class _Tap(_Wrapper):
    """Wraps one decoder layer; records its output while a capture is active."""

    def __init__(self, layer: nn.Module, store: dict[int, mx.array], index: int):
        super().__init__(layer)
        object.__setattr__(self, "_store", store)
        object.__setattr__(self, "_index", index)

    def __call__(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        if self._store.get("on") is not None:
            self._store[self._index] = out
        return out


class _TreeRope(_Wrapper):
    """A layer's rotary embedding that, during a tree verify, gives each row its own
    position (the siblings of the first draft share its position): the rows become a batch
    of one-token sequences with one offset each, the same bits as a chain's positions."""

    def __init__(self, inner: nn.Module, state: dict):
        super().__init__(inner)
        object.__setattr__(self, "_state", state)

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        pos = self._state.get("positions")  # [rows] int32, absolute
        if pos is None or x.shape[0] != 1 or x.shape[-2] != pos.size:
            return self.inner(x, offset=offset)
        rows = x.transpose(2, 1, 0, 3)  # [1, H, R, D] -> [R, H, 1, D]
        return self.inner(rows, offset=pos).transpose(2, 1, 0, 3)


class _TreeView:
    """A layer cache seen through a tree verify: everything is the cache's own except the
    attention mask, which is the tree's."""

    def __init__(self, cache, mask: mx.array):
        object.__setattr__(self, "_cache", cache)
        object.__setattr__(self, "_mask", mask)

    def __getattr__(self, name):
        return getattr(self._cache, name)

    def make_mask(self, *args, **kwargs) -> mx.array:
        return self._mask


class _LastRow(_Wrapper):
    """Wraps the model's final norm: while ``state["last"]`` is set it normalises only the
    last row, so the head that follows runs on that row alone (a prefill chunk's [L, V]
    product, and its temporary, are not built). The norm is row-wise: the same bits."""

    def __init__(self, inner: nn.Module, state: dict):
        super().__init__(inner)
        object.__setattr__(self, "_state", state)

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        if self._state.get("last") and x.ndim == 3:
            x = x[:, -1:]  # [B, L, H] -> [B, 1, H]
        return self.inner(x, *args, **kwargs)


def _parts(x) -> list:
    """A cache's keys or values as a list of arrays (quantized ones are a tuple)."""
    return list(x) if isinstance(x, (tuple, list)) else [x]


def _text_model(model: nn.Module) -> nn.Module:
    """The module holding lm_head / embeddings (unwraps multimodal wrappers)."""
    return getattr(model, "language_model", model)


class TargetAdapter:
    """Capture hidden states at ``layer_ids`` and manage rollback for one target model.

    Args:
        model: an mlx-lm model. layer_ids: decoder layers whose outputs the drafter reads.
    """

    def __init__(self, model: nn.Module, layer_ids: list[int]):
        self.model = model
        mtype = getattr(model, "model_type", None) or getattr(model.args, "model_type", "?")
        inner = getattr(_text_model(model), "model", None)
        if mtype not in SUPPORTED or inner is None or not hasattr(inner, "layers"):
            raise UnsupportedModelError(
                f"target architecture '{mtype}' is not supported by dflash-mlx "
                f"(supported: {', '.join(sorted(SUPPORTED))}); run it with mlx_lm instead"
            )
        self.model_type = mtype
        self.inner = inner
        self._store: dict = {}
        self._armed: dict = {}  # "on": the next forward records for a rollback
        # Under pipeline parallelism (``distributed/pipeline.py``) the list keeps every
        # layer's number, None where another process runs it: this one wraps its own.
        self.num_layers = len(inner.layers)
        # How the taps of layers other processes run reach this one (pipeline.TapShare);
        # None: every tapped layer runs here.
        self.share = None
        self.tap(layer_ids)
        layers = [x for x in inner.layers if x is not None]
        self.recorders: list[_Recorder | None] = []
        for layer in layers:
            base = layer.inner if isinstance(layer, _Tap) else layer
            mixer = getattr(base, "linear_attn", None)
            if isinstance(mixer, _Recorder):  # a second adapter on the same model
                object.__setattr__(mixer, "_armed", self._armed)
            elif mixer is not None:
                mixer = base.linear_attn = _Recorder(mixer, self._armed)
            self.recorders.append(mixer)
        self.is_hybrid = any(r is not None for r in self.recorders)
        # a MoE target's routed experts: counted on request, grouped in a verify (moe.py)
        self.experts = moe.wrap([x.inner if isinstance(x, _Tap) else x for x in layers])
        # a rollback re-runs a mixer whose class the tape does not reproduce (said in stats)
        self.replays = any(r is not None and not r._taped for r in self.recorders)
        ops.prepare_target(layers)  # the CPU backend compiles the block-only modules
        if qmm.on_metal():  # a verify's LM head takes the few-row kernel too
            qmm.wrap_head(_text_model(model))
        self._tree: dict = {}  # this forward's: a tree's positions, the last-row head
        norm = getattr(inner, "norm", None)
        if isinstance(norm, (nn.RMSNorm, nn.LayerNorm)):  # row-wise: the last row alone
            inner.norm = _LastRow(norm, self._tree)
        self.last_only = isinstance(inner.norm, _LastRow)
        windowed = getattr(inner, "swa_idx", None) is not None or any(
            getattr(x, "use_sliding", False) for x in layers
        )
        self.tree_ok = mtype in TREE_TYPES and not (self.is_hybrid or windowed)
        self.tree_ok = self.tree_ok and self._wrap_ropes()

    def _wrap_ropes(self) -> bool:
        """Give every layer's rotary embedding tree positions; False if a layer has none."""
        own = [x for x in self.inner.layers if x is not None]
        bases = [x.inner if isinstance(x, _Tap) else x for x in own]
        attns = [getattr(b, "self_attn", None) for b in bases]
        if not all(hasattr(a, "rope") for a in attns):
            return False
        for a in attns:
            if not isinstance(a.rope, _TreeRope):
                a.rope = _TreeRope(a.rope, self._tree)
        return True

    def tap(self, layer_ids: list[int]) -> None:
        """Capture the outputs of these decoder layers on every forward from now on."""
        self.layer_ids = list(layer_ids)
        layers = self.inner.layers
        for i in self.layer_ids:
            if layers[i] is None:  # another pipeline stage's: ``share`` brings its rows
                continue
            if not isinstance(layers[i], _Tap):
                layers[i] = _Tap(layers[i], self._store, i)
            object.__setattr__(layers[i], "_store", self._store)
            object.__setattr__(layers[i], "_index", i)

    # -- pieces the drafter borrows -------------------------------------------------
    def embed(self, ids: mx.array) -> mx.array:
        """Target token embeddings (the drafter's input embedding)."""
        return self.inner.embed_tokens(ids)

    def lm_head(self, h: mx.array) -> mx.array:
        """The target's LM head (or tied embedding) without the target's own logit scaling."""
        tm = _text_model(self.model)
        head = getattr(tm, "lm_head", None)
        if head is not None:
            return head(h)
        return self.inner.embed_tokens.as_linear(h)

    @property
    def hidden_size(self) -> int:
        """Width of the target's residual stream."""
        return self.embed(mx.array([[0]])).shape[-1]

    @property
    def vocab_size(self) -> int:
        """Rows of the target's embedding table."""
        emb = self.inner.embed_tokens
        return emb.weight.shape[0]

    # -- forward with capture ------------------------------------------------------
    def make_cache(self) -> list:
        """Fresh mlx-lm caches for the target.

        Sliding-window layers get a plain KVCache (the model's windowed mask keeps the
        attention identical): a rotating buffer cannot take back a rejected suffix.
        """
        caches = make_prompt_cache(self.model)  # a list, or a list subclass of the model's
        caches[:] = [
            KVCache() if isinstance(c, RotatingKVCache) and c.keep == 0 else c for c in caches
        ]
        return caches

    def prepare(self, cache: list, vision) -> None:
        """Tell the target which request's prompt the next forwards run: its images
        (``vision/prompt.py``), or None; only a vision-language target needs to know."""
        hook = getattr(self.model, "prepare", None)
        if hook is not None:
            hook(cache, vision)

    def __call__(
        self, ids: mx.array, cache: list, chain: int | None = None, last: bool = False
    ) -> tuple[mx.array, mx.array]:
        """Run the target on ids [1, n]; return (logits [1, n, V], features [1, n, nT*H]).

        Args:
            chain: verify a tree (``tree.py``, needs ``tree_ok``): the first ``chain`` ids
                are the anchor and its path, the rest siblings of the path's first draft.
            last: the head on the last row only (a prefill): logits [1, 1, V] where the
                final norm is a known row-wise one (``last_only``), else [1, n, V].
        """
        self._store.clear()
        self._store["on"] = True
        self._tree["last"] = last
        if self.experts is not None:
            self.experts.phase = "prefill" if last else ("plain" if ids.shape[1] == 1 else "verify")
        if chain is not None and ids.shape[1] > chain:
            o, n = cache[0].offset, ids.shape[1]
            m = tree.mask(o, chain, n)
            cache = [_TreeView(c, m) for c in cache]
            self._tree["positions"] = mx.array(tree.positions(o, chain, n), mx.int32)
        try:
            logits = self.model(ids, cache=cache)
            if self.share is None:
                feats = mx.concatenate([self._store[i] for i in self.layer_ids], axis=-1)
            else:
                feats = self.share(self._store, self.layer_ids, ids.shape[:2], logits)
        finally:
            self._store.clear()
            self._tree.clear()
            self._armed.clear()  # only the forward right after a snapshot records
            if self.experts is not None:
                self.experts.phase = None
        return logits, feats

    def can_tree(self, cache: list) -> bool:
        """Whether a tree verify may run on these caches (``KVCache`` layers, or the
        ``QuantizedKVCache`` they become with ``kv_bits``)."""
        return self.tree_ok and all(type(c) in (KVCache, QuantizedKVCache) for c in cache)

    def keep_rows(self, cache: list, fed: int, rows: list[int]) -> None:
        """After a tree verify of ``fed`` rows, make the caches hold only ``rows`` of them
        (ascending, from 0), in order: the committed path's keys and values."""
        n = len(rows)
        if rows == list(range(n)):
            self.rollback(cache, fed, n, None)
            return
        moves = []  # (buffer, first fed row, its kept rows)
        for c in cache:
            o = c.offset - fed
            src = mx.array([o + r for r in rows])
            # a QuantizedKVCache holds (data, scales, biases): each is moved the same way
            moves += [(x, o, x[..., src, :]) for x in _parts(c.keys) + _parts(c.values)]
        # The kept rows are read out before any is written: a buffer written in the graph
        # that also reads it is copied whole (the full context, per layer), not updated.
        mx.eval([kept for _, _, kept in moves])
        for x, o, kept in moves:
            x[..., o : o + n, :] = kept
        for c in cache:
            c.trim(fed - n)

    # -- rollback ------------------------------------------------------------------
    def snapshot(self, cache: list, arm: bool = True) -> list:
        """Copy the recurrent states (ArraysCache lists are mutated in place by a forward).

        Args:
            arm: the next forward records what ``rollback`` needs (a verify follows).
        """
        if arm and self.is_hybrid:
            self._armed["on"] = True
        return [list(c.cache) if recurrent(c) else None for c in cache]

    def rollback(self, cache: list, fed: int, keep: int, snap: list) -> None:
        """Make the caches hold only the first ``keep`` of the ``fed`` tokens just run.

        Attention caches are trimmed; recurrent layers restore the snapshot and run the
        kept steps again: only the recurrence, from the verify's tape, for known mixers;
        the whole mixer on the kept inputs for others. Either equals having fed only those
        tokens. The forward of ``fed`` tokens must have followed ``snapshot(cache)``.
        """
        drop = fed - keep
        if drop == 0:
            return
        for c, rec, s in zip(cache, self.recorders, snap or [None] * len(cache)):
            if recurrent(c):
                rec.rewind(c, s, keep)
            elif c.is_trimmable():
                c.trim(drop)
            else:
                raise UnsupportedModelError(
                    f"cache {type(c).__name__} of '{self.model_type}' cannot be rolled back "
                    "past its window; use a shorter context"
                )

    def rewind_rows(self, cache: list, keeps: list[int], snap: list) -> None:
        """In a batch, make each recurrent layer's row i hold only the first ``keeps[i]``
        tokens of the forward that followed ``snapshot(cache)``; the batch trims and shifts
        its attention caches itself (``decoding/batch.py``)."""
        for c, rec, s in zip(cache, self.recorders, snap):
            if recurrent(c):
                rec.rewind(c, s, keeps)

    def restore(self, cache: list, snap: list, n_keep: int, n_have: int) -> bool:
        """Put recurrent layers back to a snapshot taken at n_keep tokens and trim the
        attention layers to match; False if some layer cannot."""
        if any(not recurrent(c) and not c.is_trimmable() for c in cache):
            return False
        for c, s in zip(cache, snap):
            if recurrent(c):
                c.cache = list(s)
            else:
                c.trim(n_have - n_keep)
        return True

    def trim_to(self, cache: list, n_keep: int, n_have: int) -> bool:
        """Drop cached tokens beyond n_keep (prefix reuse); False if a layer cannot."""
        drop = n_have - n_keep
        if drop == 0:
            return True
        if any(recurrent(c) or not c.is_trimmable() for c in cache):
            return False
        for c in cache:
            c.trim(drop)
        return True
