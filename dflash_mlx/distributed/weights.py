"""A digest of a model's files that sees their contents, cheap enough for a 27B checkpoint
(docs/distributed.md, "Checks at start"): ranks whose weights have the same file names and
sizes but other values (another fine-tune, a re-quantization) would pair their collectives
and print text that is nobody's model.

Hashing every byte of 15 GB takes a minute per rank; this reads kilobytes. A safetensors
file gives its whole header (every tensor's name, dtype, shape and offsets) and a small
sample from the middle of each tensor, so a change to any one tensor's values is seen; any
other weight file (GGUF) gives its first ``HEAD`` bytes (metadata and tensor table) and
``BLOCKS`` blocks at fixed places; a config or tokenizer file is hashed whole.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

SAMPLE = 64  # bytes read from the middle of each safetensors tensor
HEAD = 1 << 20  # leading bytes of a weight file without a safetensors header
BLOCKS, BLOCK = 16, 4096  # blocks of that size at fixed places of such a file
WHOLE = 64 << 20  # a config or tokenizer file up to this size is hashed whole


def digest(path) -> str:
    """The content digest of one model file (hex).

    Args:
        path: a ``.safetensors``, ``.gguf``, config or tokenizer file.

    Raises:
        OSError: the file cannot be read.
    """
    p = Path(path)
    h = hashlib.sha256()
    with open(p, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        if p.suffix == ".safetensors" and _safetensors(f, size, h):
            return h.hexdigest()
        f.seek(0)
        if p.suffix in (".safetensors", ".gguf") or size > WHOLE:
            _blocks(f, size, h)
        else:
            h.update(f.read())
    return h.hexdigest()


def _safetensors(f, size: int, h) -> bool:
    """Hash the header and a sample of each tensor; False when it is no valid header."""
    raw = f.read(8)
    if len(raw) < 8:
        return False
    n = struct.unpack("<Q", raw)[0]
    if n > size - 8:
        return False
    header = f.read(n)
    try:
        spans = [
            v["data_offsets"]
            for k, v in json.loads(header).items()
            if k != "__metadata__" and isinstance(v, dict)
        ]
    except (ValueError, TypeError, KeyError, AttributeError):
        return False
    h.update(raw + header)
    for start, end in sorted(s for s in spans if isinstance(s, list) and len(s) == 2):
        mid = 8 + n + (int(start) + int(end) - SAMPLE) // 2
        f.seek(max(8 + n + int(start), mid))
        h.update(f.read(min(SAMPLE, max(0, int(end) - int(start)))))
    return True


def _blocks(f, size: int, h) -> None:
    """Hash the first ``HEAD`` bytes and ``BLOCKS`` blocks spread evenly over the rest."""
    h.update(f.read(HEAD))
    rest = size - HEAD
    if rest <= 0:
        return
    for i in range(BLOCKS):
        f.seek(HEAD + (rest - BLOCK) * i // max(1, BLOCKS - 1) if rest > BLOCK else HEAD)
        h.update(f.read(BLOCK))
