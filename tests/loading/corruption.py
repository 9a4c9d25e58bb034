"""Every way the hostile probe (issue 34) damaged a cache file, as functions of its bytes.

``damage(path, kind)`` rewrites a file in place and puts its mtime back, the harder case:
only its size, inode and ctime then say it changed. ``reseal`` writes a manifest that
matches the damaged files (a forged entry), so the checks after the manifest's are tested.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

DEEP = 100_000  # nesting depth: past Python's recursion limit


def _flip(b: bytes) -> bytes:
    if not b:
        return b"\x01"
    i = len(b) // 2
    return b[:i] + bytes([b[i] ^ 0x40]) + b[i + 1 :]


BYTES = {
    "truncated": lambda b: b[: len(b) // 2],
    "truncated-5000": lambda b: b[: min(5000, len(b) - 1)],  # the probe's cut, or one byte
    "empty": lambda b: b"",
    "random": lambda b: random.Random(len(b)).randbytes(max(len(b), 64)),
    "flipped-byte": _flip,
}
JSON = {
    "{}": "{}",
    "[]": "[]",
    "null": "null",
    "string": '"weights"',
    "1e999": "1e999",
    "NaN": "NaN",
    "-Infinity": "-Infinity",
    "deep-list": "[" * DEEP + "]" * DEEP,
    "deep-object": '{"a":' * DEEP + "1" + "}" * DEEP,
}
BAD_VALUES = {
    "a string": "0.05",
    "null": None,
    "1e999": float("inf"),
    "NaN": float("nan"),
    "a list": [1, 2],
    "an object": {},
    "true": True,
    "a huge int": 10**400,
}


def fields(obj: dict) -> dict[str, str]:
    """Variants of a JSON object: each top-level key missing, and each value replaced by
    each of BAD_VALUES (strings where numbers go, numbers where objects go, ...)."""
    out = {}
    for key in obj:
        out[f"without {key}"] = json.dumps({k: v for k, v in obj.items() if k != key})
        for name, value in BAD_VALUES.items():
            out[f"{key} is {name}"] = json.dumps({**obj, key: value})
    return out


def damage(path: Path, kind: str, text: str | None = None) -> None:
    """Rewrite ``path`` as ``kind`` (a key of BYTES or JSON, "field:<a key of fields()>",
    or "text" with ``text``), keeping its access and modification times."""
    st = path.stat()
    old = path.read_bytes()
    if kind == "text":
        new = text.encode()
    elif kind.startswith("field:"):  # a variant of the object the file holds
        new = fields(json.loads(old))[kind[len("field:") :]].encode()
    elif kind in BYTES:
        new = BYTES[kind](old)
    else:
        new = JSON[kind].encode()
    with open(path, "r+b") as f:  # in place: the same inode, as a careless edit leaves it
        f.truncate(0)
        f.write(new)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def reseal(folder: Path, names, versions=None) -> None:
    """Seal folder's files as they are now (a manifest forged to match damaged files)."""
    from dflash_mlx.loading import cachedir

    manifest = cachedir.read_json(folder / cachedir.MANIFEST) or {}
    if versions is None:
        versions = manifest.get("versions", {})
    assert cachedir.seal(folder, names, versions)
