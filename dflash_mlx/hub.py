"""Hugging Face Hub access for the command line: cache location, size preview before a
download, progress, resume, and offline mode, with one-line errors.

Respects ``HF_HUB_OFFLINE``, ``HF_HOME``, ``HF_HUB_CACHE`` (read at call time, so tests and
users can change them without re-importing huggingface_hub). Interrupted downloads resume:
huggingface_hub keeps ``.incomplete`` blobs and continues them on the next call.
"""

from __future__ import annotations

import fnmatch
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from .errors import DFlashError

_TRUE = {"1", "ON", "YES", "TRUE"}


def env_offline() -> bool:
    """True when HF_HUB_OFFLINE asks for offline mode."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in _TRUE


def cache_dir() -> Path:
    """The Hub cache directory, as huggingface_hub computes it from the environment."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.path.expanduser(os.environ[var]))
    if os.environ.get("HF_HOME"):
        return Path(os.path.expanduser(os.environ["HF_HOME"])) / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "huggingface" / "hub"


def repo_folder(repo_id: str) -> Path:
    """The cache folder of a model repo (models--owner--name)."""
    return cache_dir() / ("models--" + repo_id.replace("/", "--"))


def cached_size(repo_id: str) -> Optional[int]:
    """Bytes of a repo in the local cache (its blobs), or None when it has no snapshot."""
    folder = repo_folder(repo_id)
    snaps = folder / "snapshots"
    if not snaps.is_dir() or not any(snaps.iterdir()):
        return None
    blobs = folder / "blobs"
    total = 0
    root = blobs if blobs.is_dir() else snaps
    for f in root.rglob("*"):
        if f.is_file() and not f.name.endswith(".incomplete"):
            total += f.stat().st_size
    return total


def dir_size(path: Path) -> int:
    """Bytes of the files under a local directory."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def human_size(n: Optional[float]) -> str:
    """1234567 -> '1.2 MB' (decimal units, like the Hub)."""
    if n is None:
        return "?"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000.0
    return f"{n:.1f} TB"


def _patterns() -> List[str]:
    from .loading import ALLOW_PATTERNS

    return list(ALLOW_PATTERNS)


def _wanted(name: str) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in _patterns())


@dataclass
class Plan:
    """What a download would fetch: (filename, size) per missing file."""

    repo_id: str
    missing: List[Tuple[str, Optional[int]]] = field(default_factory=list)
    total_files: int = 0

    @property
    def bytes(self) -> int:
        return sum(s or 0 for _, s in self.missing)


def plan(repo_id: str) -> Plan:
    """Ask the Hub for the repo's files and sizes, and list those not yet cached.

    Raises whatever huggingface_hub raises (the caller maps it to a one-line error).
    """
    from huggingface_hub import HfApi

    info = HfApi().model_info(repo_id, files_metadata=True)
    sha = getattr(info, "sha", None)
    snap = repo_folder(repo_id) / "snapshots" / sha if sha else None
    out = Plan(repo_id)
    for s in info.siblings or []:
        if not _wanted(s.rfilename):
            continue
        out.total_files += 1
        if snap is not None and (snap / s.rfilename).is_file():
            continue
        out.missing.append((s.rfilename, getattr(s, "size", None)))
    return out


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _cached(repo_id: str) -> Optional[Path]:
    """The cached snapshot of a repo, or None (no network)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(
            snapshot_download(
                repo_id, allow_patterns=_patterns(), local_files_only=True, cache_dir=cache_dir()
            )
        )
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        return None
    except Exception:
        return None


def fetch(
    name: str,
    what: str = "model",
    offline: Optional[bool] = None,
    quiet: bool = False,
    log: Optional[Callable[[str], None]] = None,
) -> Path:
    """A local directory for a local path or Hub id, downloading what is missing.

    Before downloading, says what will be fetched and how big it is; shows huggingface_hub's
    progress bars unless quiet. Offline (``--offline`` or HF_HUB_OFFLINE) uses the cache only.

    Raises:
        DFlashError: missing path, unknown repo, gated repo, not cached while offline,
            no network.
    """
    from .loading import is_hub_id

    log = log or _stderr
    p = Path(os.path.expanduser(str(name)))
    if p.is_dir():
        return p
    if p.exists():
        raise DFlashError(f"{what} path {name} is a file; pass the checkpoint's directory")
    if not is_hub_id(str(name)):
        raise DFlashError(
            f"{what} '{name}' is neither a local directory nor a Hub id (owner/name); "
            "check the path"
        )
    if offline is None:
        offline = env_offline()
    if offline:
        got = _cached(name)
        if got is None:
            raise DFlashError(
                f"{what} {name} is not in the local Hugging Face cache ({cache_dir()}) and "
                "offline mode is on; download it once online, or drop --offline / HF_HUB_OFFLINE"
            )
        return got

    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
    )

    try:
        todo = plan(name)
    except GatedRepoError:
        raise DFlashError(
            f"{what} {name} is gated on the Hub; accept its terms on huggingface.co and log in "
            "with `hf auth login`"
        ) from None
    except RepositoryNotFoundError:
        raise DFlashError(
            f"{what} {name} does not exist on the Hugging Face Hub (or is private); check the id"
        ) from None
    except (HfHubHTTPError, OSError, Exception) as e:
        got = _cached(name)
        if got is not None:
            if not quiet:
                log(f"Hub not reachable; using the cached {what} {name}")
            return got
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DFlashError(
            f"cannot reach the Hugging Face Hub to fetch {what} {name} ({reason[:120]}); check "
            "your connection, or pass a local directory"
        ) from None
    if not todo.missing:
        got = _cached(name)
        if got is not None:
            return got
    elif not quiet:
        size = human_size(todo.bytes) if todo.bytes else "size unknown"
        log(
            f"Downloading {what} {name}: {len(todo.missing)} of {todo.total_files} files, "
            f"{size}, into {cache_dir()} (interrupt and rerun to resume)"
        )
    return _download(name, what, quiet)


def _download(name: str, what: str, quiet: bool) -> Path:
    """snapshot_download with the allow-list, into the current cache, bars unless quiet."""
    import huggingface_hub
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    was_disabled = are_progress_bars_disabled()
    if quiet:
        disable_progress_bars()
    try:
        return Path(
            huggingface_hub.snapshot_download(
                name, allow_patterns=_patterns(), cache_dir=cache_dir()
            )
        )
    except KeyboardInterrupt:
        raise DFlashError(
            f"download of {what} {name} interrupted; run the same command again to resume"
        ) from None
    except Exception as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DFlashError(
            f"download of {what} {name} failed ({reason[:120]}); run the same command again to "
            "resume"
        ) from None
    finally:
        if quiet and not was_disabled:
            enable_progress_bars()
