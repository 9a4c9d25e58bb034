"""Walk a GGUF file's header before MLX reads it: MLX trusts the counts and lengths it
finds there, and a corrupt header (counts overwritten, a truncated file) can segfault it.
Every count, string length and tensor extent is checked against the file's size."""

from __future__ import annotations

import struct
from pathlib import Path

from ..errors import DFlashError

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
