"""How big a pair's parts are, from file headers and configs alone (no weight is read):
the weights of a safetensors directory or a GGUF file as MLX will hold them, the drafter
with its caches, the target's KV cache and the largest temporary of a decode. Estimates,
for ``memory.py``'s plan; only the standard library at import.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

_ST_BYTES = {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "U32": 4, "I8": 1, "U8": 1, "BOOL": 1}
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?"}
_GGUF_SCALARS |= {10: "<Q", 11: "<q", 12: "<d"}
# GGUF tensor type -> bytes per weight once MLX holds it on Metal (4 / 8 bits, group 32,
# float16 scales and biases; float tensors become float16)
_GGUF_METAL = {0: 2.0, 1: 2.0, 2: 0.625, 3: 0.625, 8: 1.125}


_ST_HEADER_MAX = 100 << 20  # a header's JSON table; a damaged file's first bytes say more


def _safetensors(files) -> tuple[int, int, str | None, int]:
    """(bytes of all tensors, float elements, the embedding's dtype, bytes of the other
    tensors: packed quantized words, ids) from safetensors headers: an 8-byte length and a
    JSON table of byte ranges; no weight is read."""
    import json
    import struct

    total = floats = other = 0
    embed = None
    for f in files:
        with open(f, "rb") as fh:
            head = fh.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < n <= min(Path(f).stat().st_size - 8, _ST_HEADER_MAX):
                raise ValueError(f"{f} has no safetensors header")  # the loader says why
            table = json.loads(fh.read(n))
        for name, t in table.items():
            if name == "__metadata__":
                continue
            a, b = t["data_offsets"]
            total += b - a
            if t["dtype"].startswith(("F", "BF")):
                floats += (b - a) // _ST_BYTES.get(t["dtype"], 2)  # F16, BF16, F8: 2 or less
                if "embed_tokens" in name and embed is None or name.endswith("embed_tokens.scales"):
                    embed = t["dtype"]
            else:
                other += b - a
    return total, floats, embed, other


def _gguf(path, cpu: bool) -> tuple[int, dict]:
    """(bytes the tensors take once loaded, the mlx-lm config) of a GGUF file's header.

    Args:
        path: the ``.gguf`` file. cpu: MLX's CPU backend, which dequantizes to float32.
    """
    import mmap
    import struct

    from .gguf import model_config
    from .gguf_header import _TENSOR_BLOCKS, _Header

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        h = _Header(data, path)
        h.take(8, "magic and version")
        n_tensors, n_kv = h.u64("tensor count"), h.u64("metadata count")
        meta = {}
        for _ in range(n_kv):
            key = h.string("metadata key").decode("utf-8", "replace")
            kind = h.u32(f"type of {key}")
            if kind in _GGUF_SCALARS:
                meta[key] = struct.unpack_from(_GGUF_SCALARS[kind], data, h.pos)[0]
            elif kind == 8:
                meta[key] = h.string(key).decode("utf-8", "replace")
                continue
            elif kind == 9:
                count = struct.unpack_from("<Q", data, h.pos + 4)[0]
                meta[key] = [None] * min(count, 1 << 22)
            h.value(kind, key)
        total = 0
        for _ in range(n_tensors):
            name = h.string("tensor name")
            n = 1
            for _ in range(h.u32(f"dimension count of {name}")):
                n *= h.u64(f"shape of {name}")
            kind = h.u32(f"type of {name}")
            h.u64(f"offset of {name}")
            if kind not in _TENSOR_BLOCKS:
                kind = 0
            total += int(n * (4 if cpu else _GGUF_METAL[kind]))
    return total, model_config(meta)


def text_config(cfg: dict) -> dict:
    """The language model's config (``text_config`` of multimodal ones, merged)."""
    text = cfg.get("text_config")
    return {**cfg, **text} if isinstance(text, dict) else cfg


def config_int(cfg: dict, key: str, default: int = 0) -> int:
    v = cfg.get(key, default)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else default


def kv_cache_bytes(cfg: dict, context: int, dtype_bytes: int, kv_bits=None, group=64) -> int:
    """The target's KV cache at ``context`` tokens, plus a hybrid's recurrent states.

    Args:
        cfg: the target's config (``text_config`` merged). context: tokens held.
        dtype_bytes: bytes of the compute dtype. kv_bits, group: a quantized cache's bits
            and group size (mlx-lm's ``QuantizedKVCache``: packed values, then a scale and a
            bias in the compute dtype per group); None keeps the cache in the compute dtype.
    """
    layers = config_int(cfg, "num_hidden_layers")
    heads = config_int(cfg, "num_attention_heads", 1)
    kv_heads = config_int(cfg, "num_key_value_heads", heads)
    head_dim = config_int(cfg, "head_dim", config_int(cfg, "hidden_size") // heads)
    per = kv_bits / 8 + 2 * dtype_bytes / group if kv_bits else dtype_bytes
    attention, state = layers, 0
    if "linear_num_value_heads" in cfg:  # qwen3_5 / qwen3_next: 1 layer in N has attention
        attention = layers // config_int(cfg, "full_attention_interval", 4)
        hv, hk = config_int(cfg, "linear_num_value_heads"), config_int(cfg, "linear_num_key_heads")
        dk, dv = config_int(cfg, "linear_key_head_dim"), config_int(cfg, "linear_value_head_dim")
        conv = (config_int(cfg, "linear_conv_kernel_dim", 4) - 1) * (2 * hk * dk + hv * dv)
        # the conv window and the float32 recurrence, twice: a snapshot for the rollback
        state = 2 * (layers - attention) * (conv * dtype_bytes + hv * dk * dv * 4)
    return int(attention * 2 * kv_heads * head_dim * context * per) + state


def transient_bytes(cfg: dict, context: int, dtype_bytes: int, cpu: bool) -> int:
    """The largest temporary of a decode: a prefill chunk's activations and its [chunk,
    vocab] logits (on the CPU also its unfused attention scores), or a verify of 16 rows
    with its float32 probabilities.

    Args:
        cfg: the target's config. context: tokens in the cache. dtype_bytes: compute dtype.
        cpu: MLX's CPU backend (chunks of 256 rather than 512, attention unfused).
    """
    chunk = 256 if cpu else 512
    vocab, hidden = config_int(cfg, "vocab_size"), config_int(cfg, "hidden_size")
    inter = config_int(cfg, "intermediate_size", 4 * hidden)
    rows = chunk * (vocab + 4 * hidden + 3 * inter) * dtype_bytes
    if cpu:
        rows += config_int(cfg, "num_attention_heads", 1) * chunk * context * 4
    verify = 16 * vocab * (dtype_bytes + 3 * 4)
    return max(rows, verify)


def target_size(path, cpu: bool) -> tuple[int, dict, int, int]:
    """(weight bytes, config, compute dtype bytes, load-time extra bytes) of a target."""
    import json

    if isinstance(path, Remote):
        return path.weights, text_config(path.cfg), path.dtype_bytes, 0
    if path.is_file():  # a GGUF file
        size, cfg = _gguf(path, cpu)
        return size, cfg, 4 if cpu else 2, size // 2 if cpu else 0
    cfg = text_config(json.loads((path / "config.json").read_text()))
    size, _, embed, _ = _safetensors(_weight_files(path))
    return size, cfg, _ST_BYTES.get(embed or "BF16", 2), 0


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files of a directory, all of them there (a download half done has
    its index naming one that is not: the sizes would be short).

    Raises:
        FileNotFoundError: no weights, or one the index names is missing.
    """
    import json

    files = sorted(path.glob("*.safetensors"))
    index = path / "model.safetensors.index.json"
    named = json.loads(index.read_text()).get("weight_map", {}) if index.is_file() else {}
    missing = sorted(set(named.values()) - {f.name for f in files})
    if missing or not files:
        raise FileNotFoundError(f"{path / (missing or ['*.safetensors'])[0]} is missing")
    return files


def drafter_size(path, context: int, dtype_bytes: int, cpu: bool, bits: int = 0) -> tuple[int, int]:
    """(weight bytes, context cache bytes) of a drafter loaded in the target's dtype.

    Args:
        path: its directory, or a ``Remote``. context: tokens its cache holds at most.
        dtype_bytes: the compute dtype's. cpu: MLX's CPU backend (exact 16-bit copies).
        bits: 4 / 8 when a dense checkpoint's layers are quantized at load
            (``load(draft_quant=)``, ``model/quantize.py``); a pre-quantized checkpoint
            counts its packed words and scales as stored.
    """
    import json

    from ..model.config import DrafterArgs

    if isinstance(path, Remote):
        args, floats, packed = DrafterArgs.from_dict(path.cfg), path.weights // path.dtype_bytes, 0
    else:
        args = DrafterArgs.from_dict(json.loads((path / "config.json").read_text()))
        _, floats, _, packed = _safetensors(_weight_files(path))
    quantized = quantizable(args) if bits and not packed else 0
    per = dtype_bytes + (2 if cpu else 0)  # the CPU's exact 16-bit copies
    weights = (floats - quantized) * per + packed
    weights += quantized * (bits / 8 + 2 * dtype_bytes / 64)  # words, a scale and bias per 64
    weights += (args.draft_vocab_size or 0) * args.hidden_size * dtype_bytes  # draft head
    head_dim = args.head_dim or args.hidden_size // args.num_attention_heads
    rows = sum(min(context, args.window(i) or context) for i in range(args.num_hidden_layers))
    return int(weights), rows * 2 * args.num_key_value_heads * head_dim * dtype_bytes


def quantizable(args) -> int:
    """Weights of a drafter's attention and MLP projections whose input width a group of 64
    divides: those ``model/quantize.py`` quantizes.

    Args:
        args: its ``DrafterArgs``.
    """
    H, inter = args.hidden_size, args.intermediate_size
    q, kv = args.num_attention_heads * args.head_dim, args.num_key_value_heads * args.head_dim
    per = (H * (q + 2 * kv) + 2 * H * inter if H % 64 == 0 else 0) + (q * H if q % 64 == 0 else 0)
    per += H * inter if inter % 64 == 0 else 0
    return args.num_hidden_layers * per


@dataclass
class Remote:
    """A Hub repo not downloaded yet, as the plan sees it: its ``config.json`` and the bytes
    of its safetensors files as the Hub lists them (stored in ``dtype_bytes`` per float)."""

    cfg: dict
    weights: int

    @property
    def dtype_bytes(self) -> int:
        dtype = text_config(self.cfg).get("torch_dtype") or self.cfg.get("dtype")
        return 4 if dtype == "float32" else 2


def complete(path: Path) -> bool:
    """Whether a local target or drafter has all its weights (a ``.gguf`` file, or a
    directory with every safetensors file its index names)."""
    if path.is_file():
        return True
    try:
        _weight_files(path)
    except (OSError, ValueError):
        return False
    return True


def remote(repo_id: str) -> Remote | None:
    """What the Hub says of a repo before a download: the sizes of its safetensors files
    (one request) and its ``config.json`` (fetched alone); None when the Hub lists no
    safetensors or not all their sizes.

    Args:
        repo_id: 'owner/name'.

    Raises whatever huggingface_hub raises (the caller skips the plan then).
    """
    from . import hub

    sizes = [n for f, n in hub.remote_files(repo_id).items() if f.endswith(".safetensors")]
    if not sizes or any(not isinstance(n, int) or n <= 0 for n in sizes):
        return None
    return Remote(hub.remote_config(repo_id), sum(sizes))
