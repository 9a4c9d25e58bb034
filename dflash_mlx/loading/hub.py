"""Hugging Face Hub access: the cache location, offline mode, a size preview before a
download, progress, resume, and one-line errors.

The only module that reads the Hub's environment: ``HF_HUB_OFFLINE`` (with
huggingface_hub's own notion of a true value), ``HF_HUB_CACHE`` and ``HF_HOME``. They are
read at call time, so a process (or a test) can change them after huggingface_hub was
imported, which fixes its own constants at import. Interrupted downloads resume:
huggingface_hub keeps ``.incomplete`` blobs and continues them on the next call. Nothing
heavy is imported at module level (the command line imports this module for its help).
"""

from __future__ import annotations

import fnmatch
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DFlashError

OFFLINE_ENV = "HF_HUB_OFFLINE"
OFFLINE_HELP = f"Use the local Hugging Face cache only (also {OFFLINE_ENV}=1)."

# Files a model directory needs; weights are safetensors only.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.py", "*.txt", "*.jinja", "*.model", "*.tiktoken"]


def offline_mode(offline: bool | None = None) -> bool:
    """Whether to stay off the network.

    Args:
        offline: the caller's choice (``--offline``, ``offline=``); None defers to the
            environment: ``HF_HUB_OFFLINE`` (or transformers' ``TRANSFORMERS_OFFLINE``), read
            as huggingface_hub reads it, so 1, ON, YES or TRUE (any case) mean offline.
    """
    if offline is not None:
        return bool(offline)
    from huggingface_hub.constants import ENV_VARS_TRUE_VALUES

    value = os.environ.get(OFFLINE_ENV) or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ENV_VARS_TRUE_VALUES


def cache_dir() -> Path:
    """The Hub cache directory, resolved from the environment as huggingface_hub does."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.path.expandvars(os.path.expanduser(os.environ[var])))
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    home = os.environ.get("HF_HOME") or os.path.join(xdg, "huggingface")
    return Path(os.path.expandvars(os.path.expanduser(home))) / "hub"


def is_hub_id(name: str) -> bool:
    """True for strings shaped like 'owner/name' that are not local paths."""
    parts = str(name).split("/")
    return (
        len(parts) == 2
        and all(parts)
        and not str(name).startswith((".", "/", "~"))
        and not Path(name).exists()
    )


def repo_folder(repo_id: str) -> Path:
    """The cache folder of a model repo (models--owner--name)."""
    return cache_dir() / ("models--" + repo_id.replace("/", "--"))


def cached_size(repo_id: str) -> int | None:
    """Bytes of a repo in the local cache (its blobs), or None when it has no snapshot."""
    folder = repo_folder(repo_id)
    snaps = folder / "snapshots"
    if not snaps.is_dir() or not any(snaps.iterdir()):
        return None
    blobs = folder / "blobs"
    root = blobs if blobs.is_dir() else snaps
    return sum(
        f.stat().st_size
        for f in root.rglob("*")
        if f.is_file() and not f.name.endswith(".incomplete")
    )


def dir_size(path: Path) -> int:
    """Bytes of a local file, or of the files under a local directory."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def human_size(n: float | None) -> str:
    """1234567 -> '1.2 MB' (decimal units, like the Hub)."""
    if n is None:
        return "?"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000.0
    return f"{n:.1f} TB"


def _wanted(name: str) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in ALLOW_PATTERNS)


def _network_errors() -> tuple:
    """What huggingface_hub raises when the Hub cannot be reached or answers with an error:
    its HTTP client's base error (httpx, or requests in older releases) and OSError."""
    from huggingface_hub.errors import HTTPError

    return (HTTPError, OSError)


def _reason(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:120]


@dataclass
class Plan:
    """What a download would fetch: (filename, size) per missing file."""

    repo_id: str
    missing: list[tuple[str, int | None]] = field(default_factory=list)
    total_files: int = 0

    @property
    def bytes(self) -> int:
        return sum(s or 0 for _, s in self.missing)


def plan(repo_id: str) -> Plan:
    """Ask the Hub for the repo's files and sizes, and list those not yet cached.

    Args:
        repo_id: 'owner/name'.

    Raises whatever huggingface_hub raises (``fetch`` maps it to a one-line error).
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


def remote_files(repo_id: str) -> dict[str, int | None]:
    """Every file of a Hub repo with its size in bytes (None where the Hub gives none).

    Args:
        repo_id: 'owner/name'.

    Raises whatever huggingface_hub raises (the caller decides what a failure means).
    """
    from huggingface_hub import HfApi

    info = HfApi().model_info(repo_id, files_metadata=True)
    return {s.rfilename: getattr(s, "size", None) for s in info.siblings or []}


def remote_config(repo_id: str) -> dict:
    """A Hub repo's ``config.json`` alone (a few kB, kept in the Hub cache), parsed.

    Args:
        repo_id: 'owner/name'.

    Raises whatever huggingface_hub raises, or ValueError for a file that is not JSON.
    """
    import json

    from huggingface_hub import hf_hub_download

    path = hf_hub_download(repo_id, "config.json", cache_dir=cache_dir())
    return json.loads(Path(path).read_text())


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cached(repo_id: str) -> Path | None:
    """The cached snapshot of a repo, or None; never touches the network.

    Args:
        repo_id: 'owner/name'.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(
            snapshot_download(
                repo_id, allow_patterns=ALLOW_PATTERNS, local_files_only=True, cache_dir=cache_dir()
            )
        )
    except (LocalEntryNotFoundError, FileNotFoundError):
        return None


def _not_cached(repo_id: str, what: str) -> DFlashError:
    return DFlashError(
        f"{what} {repo_id} is not in the local Hugging Face cache ({cache_dir()}) and offline "
        f"mode is on; download it once online, or drop --offline / {OFFLINE_ENV}"
    )


def _plan(repo_id: str, what: str) -> Plan:
    """``plan``, with the Hub's answers about the repo itself as one-line errors (network
    errors pass through: ``fetch`` may fall back to the cache)."""
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError

    try:
        return plan(repo_id)
    except GatedRepoError:
        raise DFlashError(
            f"{what} {repo_id} is gated on the Hub; accept its terms on huggingface.co and log "
            "in with `hf auth login`"
        ) from None
    except RepositoryNotFoundError:
        raise DFlashError(
            f"{what} {repo_id} does not exist on the Hugging Face Hub (or is private); check the id"
        ) from None
    except HFValidationError as e:
        raise DFlashError(f"{what} '{repo_id}' is not a valid Hub id ({_reason(e)})") from None


def _unreachable(
    repo_id: str, what: str, e: BaseException, quiet: bool, log: Callable[[str], None]
) -> Path:
    """The cached copy when the Hub cannot be reached (``e``), else a one-line error."""
    got = cached(repo_id)
    if got is None:
        raise DFlashError(
            f"cannot reach the Hugging Face Hub to fetch {what} {repo_id} ({_reason(e)}); "
            "check your connection, or pass a local directory"
        ) from None
    if not quiet:
        log(f"Hub not reachable; using the cached {what} {repo_id}")
    return got


def fetch(
    repo_id: str,
    what: str = "model",
    offline: bool | None = None,
    quiet: bool = False,
    log: Callable[[str], None] | None = None,
) -> Path:
    """The local snapshot of a Hub repo, downloading what is missing.

    Before downloading, says what will be fetched and how big it is; shows huggingface_hub's
    progress bars unless quiet. Offline (``offline`` or the environment) uses the cache only;
    when the Hub cannot be reached, a cached copy is used.

    Args:
        repo_id: 'owner/name'. what: 'model' or 'drafter', for messages.
        offline: never touch the network (default: ``offline_mode()``).
        quiet: no notices, no progress bars. log: callable(str) for notices (default stderr).

    Raises:
        DFlashError: unknown or gated repo, not cached while offline, no network.
    """
    log = log or _stderr
    if offline_mode(offline):
        got = cached(repo_id)
        if got is None:
            raise _not_cached(repo_id, what)
        return got
    try:
        todo = _plan(repo_id, what)
    except _network_errors() as e:
        return _unreachable(repo_id, what, e, quiet, log)
    got = None if todo.missing else cached(repo_id)
    if got is not None:
        return got
    if todo.missing and not quiet:
        size = human_size(todo.bytes) if todo.bytes else "size unknown"
        log(
            f"Downloading {what} {repo_id}: {len(todo.missing)} of {todo.total_files} files, "
            f"{size}, into {cache_dir()} (interrupt and rerun to resume)"
        )
    return _download(repo_id, what, quiet)


def _download(repo_id: str, what: str, quiet: bool) -> Path:
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
                repo_id, allow_patterns=ALLOW_PATTERNS, cache_dir=cache_dir()
            )
        )
    except KeyboardInterrupt:
        raise DFlashError(
            f"download of {what} {repo_id} interrupted; run the same command again to resume"
        ) from None
    except _network_errors() as e:
        raise DFlashError(
            f"download of {what} {repo_id} failed ({_reason(e)}); run the same command again "
            "to resume"
        ) from None
    finally:
        if quiet and not was_disabled:
            enable_progress_bars()
