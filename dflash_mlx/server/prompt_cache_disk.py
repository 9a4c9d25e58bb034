"""The prompt caches' disk tier (``dflash serve --prompt-cache-dir``): entries evicted from
memory are kept as safetensors and restored when a request can reuse them.

One folder per pair (a hash of the target's and drafter's paths, their weights' sizes and
times, and the versions), one sealed entry per prefix in it: ``target.safetensors``
(mlx-lm's ``save_prompt_cache``), ``drafter.safetensors`` (the drafter's context caches and
a hybrid's checkpoint) and ``meta.json`` (the tokens). An entry is written whole in a
temporary folder, sealed with a manifest (``loading/cachedir.py``) and renamed into place.
Both safetensors files record a hash of the entry's tokens and of the pair; an entry that
fails its manifest, was made for another pair or version, holds other tokens than its name
and the index say, or does not load as this pair's caches is removed, never used.

Nothing outside the root is read, written or removed: a symbolic link, or a path resolving
outside the root, at the pair, entry or file level is refused with one warning. A folder
that cannot be written (read-only, vanished) turns the tier's writes off with one warning:
the pool keeps its entries in memory and requests never fail for it.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

import mlx.core as mx

from ..decoding.state import PromptCache, common_prefix
from ..errors import DFlashError
from ..loading import cachedir
from . import prompt_cache_entry as files
from .prompt_cache_entry import FILES, LOAD_ERRORS, entry_name, escapes

logger = logging.getLogger("dflash_mlx.server")

FORMAT = "dflash_mlx.PromptCache/2"
MAX_ENTRIES = 64  # per pair; the least recently used go first
# a write failing so means the folder cannot take entries at all: stop writing
UNWRITABLE = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOTDIR}


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


class DiskTier:
    """Prompt caches on disk for one pair.

    Args:
        folder: this pair's folder (``open`` picks it; its parent is the root, resolved).
        model: the loaded pair. versions: ``identity(model)``.
    """

    def __init__(self, folder: Path, model, versions: dict[str, str]):
        self.folder, self.model, self.versions = folder, model, versions
        self.root, self.pair = folder.parent, files.digest(versions)
        self.lock = threading.Lock()
        self.index: dict[str, dict] = {}  # entry name -> meta.json (tokens, checkpoint)
        self.restored = self.saved = self.dropped = 0
        self.writable, self.refused = True, set()
        why = escapes(folder, self.root)
        if why is None:
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                self._unwritable(e)
        else:
            self._refuse(folder, why)
        if why is None and folder.is_dir():
            cachedir.sweep_temps(folder)
            self._scan()

    @classmethod
    def open(cls, root: str, model) -> DiskTier:
        """The tier for this pair under ``root`` (``--prompt-cache-dir``; a link the user
        named is resolved once, links inside it are never followed)."""
        versions = identity(model)
        name = Path(str(getattr(model, "target_path", "") or "model")).name or "model"
        base = Path(root).expanduser()
        try:
            base = base.resolve(strict=True)
        except (OSError, RuntimeError):
            base = base.absolute()
        return cls(base / f"{name[:40]}-{files.digest(versions)[:16]}", model, versions)

    def _scan(self) -> None:
        for entry in sorted(self.folder.glob("e-*")):
            why = escapes(entry, self.root) or files.irregular(entry)
            if why is not None:
                self._refuse(entry, why)
                continue
            meta = cachedir.read_json(entry / "meta.json") if cachedir.sealed(entry) else None
            if meta is None or not isinstance(meta.get("tokens"), list):
                self._drop(entry.name, "it is incomplete or damaged")
                continue
            self.index[entry.name] = meta

    def _refuse(self, path: Path, why: str) -> None:
        """Leave path alone (never read, written or removed), with one warning."""
        self.index.pop(path.name, None)
        if str(path) not in self.refused:
            self.refused.add(str(path))
            logger.warning("prompt cache %s left alone: %s", path, why)

    def _unwritable(self, e: OSError) -> None:
        if self.writable:
            self.writable = False
            logger.warning(
                "prompt cache folder %s cannot be written (%s): prompt caches are kept in "
                "memory only; name a writable --prompt-cache-dir to keep them on disk",
                self.folder,
                e.strerror or e,
            )

    def _drop(self, name: str, why: str | None = None) -> None:
        if why:
            logger.warning("prompt cache %s removed: %s", name, why)
        self.index.pop(name, None)
        self.dropped += why is not None
        entry = self.folder / name
        if self.writable and escapes(entry, self.root) is None:
            cachedir.discard(entry)

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
            why = escapes(self.folder, self.root)
            if why is not None:
                self._refuse(self.folder, why)
                return None
            ranked = sorted(
                ((self._usable(m, prompt), name) for name, m in self.index.items()), reverse=True
            )
            for n, name in ranked:
                if n <= better_than:
                    return None
                cache = self._load(name)
                if cache is not None:
                    self.restored += 1
                    self._touch(name)
                    return cache
        return None

    def _touch(self, name: str) -> None:
        """Mark an entry recently used (its meta.json's time orders ``_limit``)."""
        if not self.writable:
            return
        try:
            os.utime(self.folder / name / "meta.json")
        except OSError as e:
            if e.errno in UNWRITABLE:
                self._unwritable(e)

    def _load(self, name: str) -> PromptCache | None:
        entry = self.folder / name
        why = escapes(entry, self.root) or files.irregular(entry)
        if why is not None:
            self._refuse(entry, why)
            return None
        why = cachedir.check(entry, FILES, self.versions)
        meta = None if why else cachedir.read_json(entry / "meta.json")
        if why is None and (
            meta is None
            or meta.get("tokens") != self.index[name].get("tokens")
            or entry_name(meta["tokens"]) != name
        ):  # the index chose it for these tokens: an entry moved here holds others
            why = "it holds other tokens than its name says (moved or renamed)"
        if why is not None:
            self._drop(name, why)
            return None
        try:
            return files.read(self.model, entry, meta, files.tags(meta["tokens"], self.pair))
        except LOAD_ERRORS as e:  # a file of another pair or format: never a crash
            self._drop(name, f"it does not load as this pair's caches ({type(e).__name__})")
            return None

    def put(self, cache: PromptCache) -> None:
        """Save an entry evicted from memory (failures are logged, never raised)."""
        if not cache.tokens or cache.busy or not self.writable:
            return
        self.model.drafter.flush_context(cache.drafter)  # save projected rows only
        name = entry_name(cache.tokens)
        with self.lock:
            for path in (self.folder, self.folder / name):
                why = escapes(path, self.root)
                if why is not None:
                    self._refuse(path, why)
                    return
            try:
                files.write(self.folder, cache, self.versions, self.pair)
            except OSError as e:
                if e.errno in UNWRITABLE:
                    self._unwritable(e)
                else:  # a full disk: later entries may fit
                    logger.warning("prompt cache not saved: %s", e.strerror or e)
                return
            except (RuntimeError, ValueError) as e:  # MLX's write errors
                logger.warning("prompt cache not saved: %s: %s", type(e).__name__, e)
                return
            self.saved += 1
            ck = None if cache.checkpoint is None else cache.checkpoint[0]
            trimmable = cache.trimmable()
            self.index[name] = {"tokens": list(cache.tokens), "checkpoint": ck}
            self.index[name]["trimmable"] = trimmable
            if trimmable:  # entries holding a prefix of this one add nothing
                for other, m in list(self.index.items()):
                    t = m.get("tokens") or []
                    if other != name and cache.tokens[: len(t)] == t:
                        self._drop(other)
            self._limit()

    def _limit(self) -> None:
        def used(name: str) -> int:
            try:
                return (self.folder / name / "meta.json").lstat().st_mtime_ns
            except OSError:
                return 0

        for name in sorted(self.index, key=used)[: max(0, len(self.index) - MAX_ENTRIES)]:
            self._drop(name)

    def stats(self) -> dict:
        """Entries, bytes on disk, restores, saves, damaged entries removed, and whether
        the folder takes new entries."""
        with self.lock:
            size = 0
            for name in self.index:
                for f in FILES:
                    try:
                        size += (self.folder / name / f).lstat().st_size
                    except OSError:
                        pass
            return {
                "entries": len(self.index),
                "bytes": size,
                "restored": self.restored,
                "saved": self.saved,
                "removed_damaged": self.dropped,
                "writable": self.writable,
            }
