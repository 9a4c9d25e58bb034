"""One entry of the prompt caches' disk tier (``prompt_cache_disk.DiskTier``): its files,
written whole in a fresh folder then renamed into place, and read back only when the
tokens and pair its files record are the ones expected; and the path checks that keep the
tier inside its root (no symbolic link is followed for a read, a write or a removal)."""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import os
import shutil
import stat
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache, load_prompt_cache, save_prompt_cache

from ..decoding.state import PromptCache
from ..loading import cachedir

FILES = ("target.safetensors", "drafter.safetensors", "meta.json")
# what reading a file of another pair, format or version raises (MLX raises RuntimeError
# and ValueError on a bad safetensors file; mlx-lm KeyError on an unknown cache class)
LOAD_ERRORS = (OSError, RuntimeError, ValueError, KeyError, TypeError, IndexError, AttributeError)
_serial = itertools.count()


def digest(obj) -> str:
    """The SHA-256 of obj's JSON (hex)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def entry_name(tokens: list[int]) -> str:
    """The folder name of the entry holding tokens (a hash of them)."""
    return "e-" + digest(tokens)[:24]


def tags(tokens: list[int], pair: str) -> dict[str, str]:
    """What both safetensors files of an entry record: its tokens' and its pair's hashes."""
    return {"dflash_tokens": digest(tokens), "dflash_pair": pair}


def escapes(path: Path, root: Path) -> str | None:
    """Why path must not be followed from root (a link, or resolving outside it); None
    when it is a plain path inside root (or missing)."""
    try:
        if path.is_symlink():
            return "it is a symbolic link"
        real = path.resolve()
    except (OSError, RuntimeError):
        return "it cannot be resolved"
    if real != root and root not in real.parents:
        return f"it resolves outside {root}"
    return None


def irregular(entry: Path) -> str | None:
    """Why an entry's files must not be read (one is a link or not a file); None if not."""
    for name in (*FILES, cachedir.MANIFEST):
        try:
            mode = (entry / name).lstat().st_mode
        except OSError:
            continue  # missing: the manifest check tells
        if not stat.S_ISREG(mode):
            return f"{name} is not a plain file"
    return None


def _context_load(fresh, arrays: dict, meta: dict):
    """A drafter context cache saved with ``save_state``, checked against this pair's."""
    c = type(fresh).load_state(arrays, meta)
    if c.window != fresh.window:
        raise ValueError("a context cache of another window")
    return c


def _same_kind(saved, fresh) -> bool:
    """Whether a loaded target layer cache fits where this pair makes ``fresh`` (an attention
    cache may have been quantized by ``--kv-bits``)."""
    return type(saved) is type(fresh) or (
        type(fresh) is KVCache and type(saved) is QuantizedKVCache
    )


def read(model, entry: Path, meta: dict, want: dict[str, str]) -> PromptCache:
    """The entry's caches for model.

    Args:
        model: the pair. entry: its folder. meta: its meta.json. want: ``tags`` it must record.

    Raises:
        one of ``LOAD_ERRORS``: the files are not this pair's caches of meta's tokens.
    """
    fresh = model.make_cache()
    target, info = load_prompt_cache(str(entry / "target.safetensors"), True)
    n = len(meta["tokens"])
    if any(info.get(k) != v for k, v in want.items()):
        raise ValueError("another prompt's or pair's caches")
    if not all(_same_kind(a, b) for a, b in zip(target, fresh.target, strict=True)):
        raise ValueError("other cache layers")
    if any(getattr(c, "offset", n) != n for c in target):
        raise ValueError("caches of another length")
    arrays, info = mx.load(str(entry / "drafter.safetensors"), return_metadata=True)
    if any(info.get(k) != v for k, v in want.items()):
        raise ValueError("another prompt's or pair's caches")
    layers = json.loads(info["layers"])
    if len(layers) != len(fresh.drafter):
        raise ValueError("another drafter")
    drafter = []
    for i, (c, m) in enumerate(zip(fresh.drafter, layers)):
        own = {k.split("/", 1)[1]: a for k, a in arrays.items() if k.startswith(f"c{i}/")}
        drafter.append(_context_load(c, own, m))
    if any(c.position != n for c in drafter):
        raise ValueError("a drafter context of another length")
    cache = PromptCache(target, drafter, list(meta["tokens"]), owner=fresh.owner)
    ck = meta.get("checkpoint")
    if ck is not None:
        shape = json.loads(info["checkpoint"])
        snap = [
            None if s is None else [arrays.get(f"k{i}/{j}") for j in range(s)]
            for i, s in enumerate(shape)
        ]
        cache.checkpoint = (int(ck), snap)
    mx.eval(cache.state)
    return cache


def write(folder: Path, cache: PromptCache, versions: dict, pair: str) -> str:
    """Write cache's entry whole in a fresh folder, seal it, rename it into place; returns
    its name.

    Args:
        folder: the pair's folder. cache: the entry's caches (drafter rows flushed).
        versions: ``identity`` (sealed in the manifest). pair: its hash.

    Raises:
        OSError, RuntimeError, ValueError: it could not be written.
    """
    name = entry_name(cache.tokens)
    tmp = folder / f".tmp{os.getpid()}-{next(_serial)}-{name}"
    os.mkdir(tmp)  # a fresh folder of ours: nothing planted can be in it
    try:
        mine = tags(cache.tokens, pair)
        save_prompt_cache(str(tmp / "target.safetensors"), cache.target, mine)
        arrays, info = _drafter_arrays(cache)
        mx.save_safetensors(str(tmp / "drafter.safetensors"), arrays, {**info, **mine})
        ck = None if cache.checkpoint is None else cache.checkpoint[0]
        meta = {"tokens": cache.tokens, "checkpoint": ck, "trimmable": cache.trimmable()}
        (tmp / "meta.json").write_text(json.dumps(meta))
        if not cachedir.seal(tmp, FILES, versions):
            raise OSError(errno.EIO, "the entry could not be sealed")
        entry = folder / name
        cachedir.discard(entry)  # an older entry for the same tokens (a link is left alone)
        try:
            os.rename(tmp, entry)  # onto a link or another writer's entry: refused
        except OSError:
            if not (entry.is_dir() and not entry.is_symlink()):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return name


def _drafter_arrays(cache: PromptCache) -> tuple[dict, dict]:
    """The drafter context caches and a hybrid's checkpoint as arrays and metadata."""
    arrays, layers = {}, []
    for i, c in enumerate(cache.drafter):
        own, m = c.save_state()
        arrays.update({f"c{i}/{k}": a for k, a in own.items()})
        layers.append(m)
    info = {"layers": json.dumps(layers), "checkpoint": "null"}
    if cache.checkpoint is not None:
        snap = cache.checkpoint[1]
        info["checkpoint"] = json.dumps([None if s is None else len(s) for s in snap])
        for i, s in enumerate(snap):
            for j, a in enumerate(s or ()):
                if a is not None:
                    arrays[f"k{i}/{j}"] = a
    return arrays, info
