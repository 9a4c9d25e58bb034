"""The prompt caches' disk tier (``dflash serve --prompt-cache-dir``): entries evicted from
memory are kept as safetensors and restored when a request can reuse them.

One folder per pair (a hash of the target's and drafter's paths, their weights' sizes and
times, and the versions), one sealed entry per prefix in it: ``target.safetensors``
(mlx-lm's ``save_prompt_cache``), ``drafter.safetensors`` (the drafter's context caches and
a hybrid's checkpoint) and ``meta.json`` (the tokens). Entries are written atomically and
sealed with a manifest (``loading/cachedir.py``); an entry that fails its manifest, was made
for another pair or version, or does not load as this pair's caches is removed, never used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache, load_prompt_cache, save_prompt_cache

from ..decoding.state import PromptCache, common_prefix
from ..errors import DFlashError
from ..loading import cachedir

logger = logging.getLogger("dflash_mlx.server")

FORMAT = "dflash_mlx.PromptCache/1"
FILES = ("target.safetensors", "drafter.safetensors", "meta.json")
# what reading a file of another pair, format or version raises (MLX raises RuntimeError
# and ValueError on a bad safetensors file; mlx-lm KeyError on an unknown cache class)
LOAD_ERRORS = (OSError, RuntimeError, ValueError, KeyError, TypeError, IndexError, AttributeError)
MAX_ENTRIES = 64  # per pair; the least recently used go first


def check_dir(path: str | None) -> None:
    """Refuse a ``--prompt-cache-dir`` that cannot be a folder, before anything loads.

    Raises:
        DFlashError: it is a file, or it cannot be created.
    """
    if path is None:
        return
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise DFlashError(f"--prompt-cache-dir {path} is a file; name a folder")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DFlashError(
            f"--prompt-cache-dir {path} cannot be created ({e.strerror or e}); name a "
            "writable folder"
        ) from None


def identity(model) -> dict[str, str]:
    """What an entry must have been made for: the pair (paths, weights' sizes and times)
    and the versions of the format, dflash-mlx, MLX and mlx-lm."""
    import mlx_lm

    from .. import __version__

    out = {"format": FORMAT, "dflash_mlx": __version__, "mlx": mx.__version__}
    out["mlx_lm"] = mlx_lm.__version__
    for part in ("target", "drafter"):
        path = Path(str(getattr(model, f"{part}_path", "") or ""))
        stamps = []
        if path.is_dir():
            for f in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.gguf")):
                st = f.stat()
                stamps.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
        elif path.is_file():
            st = path.stat()
            stamps.append(f"{path.name}:{st.st_size}:{st.st_mtime_ns}")
        out[part] = f"{path.resolve() if str(path) else ''}|{','.join(stamps)}"
    return out


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


class DiskTier:
    """Prompt caches on disk for one pair.

    Args:
        folder: this pair's folder (``open`` picks it). model: the loaded pair.
        versions: ``identity(model)``.
    """

    def __init__(self, folder: Path, model, versions: dict[str, str]):
        self.folder, self.model, self.versions = folder, model, versions
        self.lock = threading.Lock()
        self.index: dict[str, dict] = {}  # entry name -> meta.json (tokens, checkpoint)
        self.restored = self.saved = self.dropped = 0
        cachedir.sweep_temps(folder)
        for entry in sorted(folder.glob("e-*")):
            meta = cachedir.read_json(entry / "meta.json") if cachedir.sealed(entry) else None
            if meta is None or not isinstance(meta.get("tokens"), list):
                self._drop(entry.name, "it is incomplete or damaged")
                continue
            self.index[entry.name] = meta

    @classmethod
    def open(cls, root: str, model) -> DiskTier:
        """The tier for this pair under ``root`` (``--prompt-cache-dir``)."""
        versions = identity(model)
        digest = hashlib.sha256(json.dumps(versions, sort_keys=True).encode()).hexdigest()
        name = Path(str(getattr(model, "target_path", "") or "model")).name or "model"
        folder = Path(root).expanduser() / f"{name[:40]}-{digest[:16]}"
        folder.mkdir(parents=True, exist_ok=True)
        return cls(folder, model, versions)

    def _drop(self, name: str, why: str | None = None) -> None:
        if why:
            logger.warning("prompt cache %s removed: %s", name, why)
        self.index.pop(name, None)
        cachedir.discard(self.folder / name)
        self.dropped += why is not None

    @staticmethod
    def _usable(meta: dict, prompt: list[int]) -> int:
        tokens = meta["tokens"]
        n = common_prefix(tokens, prompt, len(prompt) - 1)
        if n == len(tokens) or meta.get("trimmable"):
            return n
        ck = meta.get("checkpoint")
        return ck if isinstance(ck, int) and 0 < ck <= n else 0

    def take(self, model, prompt: list[int], better_than: int) -> PromptCache | None:
        """The entry reusing more than ``better_than`` tokens of prompt, loaded (the file
        stays); None when there is none. A damaged or foreign entry is removed and the next
        best tried."""
        with self.lock:
            ranked = sorted(
                ((self._usable(m, prompt), name) for name, m in self.index.items()), reverse=True
            )
            for n, name in ranked:
                if n <= better_than:
                    return None
                cache = self._load(name)
                if cache is not None:
                    self.restored += 1
                    os.utime(self.folder / name / "meta.json")  # recently used
                    return cache
        return None

    def _load(self, name: str) -> PromptCache | None:
        entry = self.folder / name
        why = cachedir.check(entry, FILES, self.versions)
        if why is not None:
            self._drop(name, why)
            return None
        try:
            return self._read(entry, self.index[name])
        except LOAD_ERRORS as e:  # a file of another pair or format: never a crash
            self._drop(name, f"it does not load as this pair's caches ({type(e).__name__})")
            return None

    def _read(self, entry: Path, meta: dict) -> PromptCache:
        fresh = self.model.make_cache()
        target = load_prompt_cache(str(entry / "target.safetensors"))
        n = len(meta["tokens"])
        if not all(_same_kind(a, b) for a, b in zip(target, fresh.target, strict=True)):
            raise ValueError("other cache layers")
        if any(getattr(c, "offset", n) != n for c in target):
            raise ValueError("caches of another length")
        arrays, info = mx.load(str(entry / "drafter.safetensors"), return_metadata=True)
        layers = json.loads(info["layers"])
        if len(layers) != len(fresh.drafter):
            raise ValueError("another drafter")
        drafter = []
        for i, (c, m) in enumerate(zip(fresh.drafter, layers)):
            own = {k.split("/", 1)[1]: a for k, a in arrays.items() if k.startswith(f"c{i}/")}
            drafter.append(_context_load(c, own, m))
        if any(c.position != n for c in drafter):
            raise ValueError("a drafter context of another length")
        cache = PromptCache(target, drafter, list(meta["tokens"]))
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

    def put(self, cache: PromptCache) -> None:
        """Save an entry evicted from memory (failures are logged, never raised)."""
        if not cache.tokens or cache.busy:
            return
        self.model.drafter.flush_context(cache.drafter)  # save projected rows only
        name = "e-" + hashlib.sha256(json.dumps(cache.tokens).encode()).hexdigest()[:24]
        with self.lock:
            entry = self.folder / name
            try:
                self._write(entry, cache)
            except (OSError, RuntimeError, ValueError) as e:  # a full disk, a read-only folder
                logger.warning("prompt cache not saved: %s: %s", type(e).__name__, e)
                cachedir.discard(entry)
                return
            self.saved += 1
            self.index[name] = cachedir.read_json(entry / "meta.json") or {}
            if cache.trimmable():  # entries holding a prefix of this one add nothing
                for other, m in list(self.index.items()):
                    t = m.get("tokens") or []
                    if other != name and cache.tokens[: len(t)] == t:
                        self._drop(other)
            self._limit()

    def _write(self, entry: Path, cache: PromptCache) -> None:
        cachedir.unseal(entry)
        entry.mkdir(parents=True, exist_ok=True)
        ok = cachedir.write_atomic(
            entry / "target.safetensors", lambda t: save_prompt_cache(str(t), cache.target)
        )
        arrays, layers = {}, []
        for i, c in enumerate(cache.drafter):
            own, m = c.save_state()
            arrays.update({f"c{i}/{k}": a for k, a in own.items()})
            layers.append(m)
        info = {"layers": json.dumps(layers), "checkpoint": "null"}
        ck = None
        if cache.checkpoint is not None:
            ck, snap = cache.checkpoint
            info["checkpoint"] = json.dumps([None if s is None else len(s) for s in snap])
            for i, s in enumerate(snap):
                for j, a in enumerate(s or ()):
                    if a is not None:
                        arrays[f"k{i}/{j}"] = a
        ok = ok and cachedir.write_atomic(
            entry / "drafter.safetensors",
            lambda t: mx.save_safetensors(str(t), arrays, metadata=info),
        )
        meta = {"tokens": cache.tokens, "checkpoint": ck, "trimmable": cache.trimmable()}
        ok = ok and cachedir.write_json(entry / "meta.json", meta)
        if not (ok and cachedir.seal(entry, FILES, self.versions)):
            raise OSError("the entry could not be written")

    def _limit(self) -> None:
        def used(name: str) -> int:
            try:
                return (self.folder / name / "meta.json").stat().st_mtime_ns
            except OSError:
                return 0

        for name in sorted(self.index, key=used)[: max(0, len(self.index) - MAX_ENTRIES)]:
            self._drop(name)

    def stats(self) -> dict:
        """Entries, bytes on disk, restores, saves and damaged entries removed."""
        with self.lock:
            size = 0
            for name in self.index:
                for f in FILES:
                    try:
                        size += (self.folder / name / f).stat().st_size
                    except OSError:
                        pass
            return {
                "entries": len(self.index),
                "bytes": size,
                "restored": self.restored,
                "saved": self.saved,
                "removed_damaged": self.dropped,
            }
