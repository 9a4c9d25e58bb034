"""Load a target and its drafter from local directories or Hugging Face Hub ids, and check
that they fit each other before any decoding (SPEC §2)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Tuple

from .errors import DFlashError, IncompatibleDrafterError

if TYPE_CHECKING:
    from .state import DFlashModel

# Files a model directory needs; weights are safetensors only.
ALLOW_PATTERNS = [
    "*.json", "*.safetensors", "*.py", "*.txt", "*.jinja", "*.model", "*.tiktoken",
]


def is_hub_id(name: str) -> bool:
    """True for strings shaped like 'owner/name' that are not local paths."""
    parts = str(name).split("/")
    return (
        len(parts) == 2
        and all(parts)
        and not str(name).startswith((".", "/", "~"))
        and not Path(name).exists()
    )


def hub_cache_dir() -> Optional[str]:
    """The Hub cache, read from the environment at call time (HF_HUB_CACHE, then HF_HOME)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return None


def resolve_path(name: str, what: str = "model", offline: Optional[bool] = None) -> Path:
    """A local directory for a local path or a Hub id (downloaded or taken from the cache).

    Args:
        name: local directory or 'owner/name' Hub id. what: 'model' or 'drafter' for errors.
        offline: never touch the network (default: HF_HUB_OFFLINE).

    Raises:
        DFlashError: the path does not exist, or the id cannot be fetched.
    """
    p = Path(os.path.expanduser(str(name)))
    if p.is_dir():
        return p
    if p.exists():
        raise DFlashError(f"{what} path {p} is a file; pass the checkpoint's directory")
    if not is_hub_id(str(name)):
        raise DFlashError(
            f"{what} '{name}' is neither a local directory nor a Hub id (owner/name); check the path"
        )
    if offline is None:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(
            snapshot_download(
                str(name), allow_patterns=ALLOW_PATTERNS, local_files_only=offline,
                cache_dir=hub_cache_dir(),
            )
        )
    except LocalEntryNotFoundError:
        if offline:
            raise DFlashError(
                f"{what} '{name}' is not in the local Hugging Face cache and offline mode is on; "
                "download it once online or unset HF_HUB_OFFLINE"
            ) from None
        raise DFlashError(
            f"cannot download {what} '{name}' (no network?); check your connection or pass a local path"
        ) from None
    except RepositoryNotFoundError:
        raise DFlashError(f"{what} '{name}' does not exist on the Hugging Face Hub; check the id") from None
    except OSError as e:
        raise DFlashError(f"cannot fetch {what} '{name}' ({str(e).splitlines()[0]})") from None


def check_compatible(adapter, drafter, drafter_name: str = "drafter") -> None:
    """Fail with one line when the drafter does not fit the target.

    Args:
        adapter: TargetAdapter of the target. drafter: DFlashDrafter.
    """
    a = drafter.args
    n = adapter.num_layers
    bad = [i for i in a.target_layer_ids if not 0 <= i < n]
    if bad:
        raise IncompatibleDrafterError(
            f"{drafter_name} reads target layers {bad}, but the target has {n} layers; "
            "use the drafter made for this target"
        )
    if a.num_target_layers is not None and a.num_target_layers != n:
        raise IncompatibleDrafterError(
            f"{drafter_name} was made for a {a.num_target_layers}-layer target, this target has "
            f"{n}; use the drafter made for this target"
        )
    H = adapter.hidden_size
    if a.hidden_size != H:
        raise IncompatibleDrafterError(
            f"{drafter_name} hidden size {a.hidden_size} does not match the target's {H}; "
            "use the drafter made for this target"
        )
    V = adapter.vocab_size
    if a.vocab_size != V:
        raise IncompatibleDrafterError(
            f"{drafter_name} vocabulary {a.vocab_size} does not match the target's {V}; "
            "use the drafter made for this target"
        )


def _target_dtype(model):
    """The dtype the target computes in (its embedding output)."""
    import mlx.core as mx

    emb = getattr(model, "language_model", model).model.embed_tokens
    return emb(mx.array([[0]])).dtype


def load(
    path_or_hf_repo: str,
    drafter: Optional[str] = None,
    *,
    offline: Optional[bool] = None,
    tokenizer_config: Optional[dict] = None,
) -> Tuple["DFlashModel", object]:
    """Load a target model and its DFlash drafter.

    Args:
        path_or_hf_repo: target directory or Hub id (any model mlx-lm loads).
        drafter: drafter directory or Hub id; required unless the target directory holds
            a ``dflash_drafter`` entry in a ``dflash.json`` next to its config.
        offline: never touch the network (default: HF_HUB_OFFLINE).
        tokenizer_config: extra options for mlx-lm's tokenizer loader.

    Returns:
        (DFlashModel, tokenizer) where model.target is the mlx-lm model and model.drafter
        the drafter.
    """
    from mlx_lm.utils import load as mlx_load

    from .checkpoint import load_drafter
    from .state import DFlashModel
    from .target import TargetAdapter

    tpath = resolve_path(path_or_hf_repo, "model", offline)
    if not (tpath / "config.json").is_file():
        raise DFlashError(f"model directory {tpath} has no config.json; point to an mlx-lm model")
    if drafter is None:
        hint = tpath / "dflash.json"
        if hint.is_file():
            drafter = str(tpath / json.loads(hint.read_text())["dflash_drafter"])
        else:
            raise DFlashError(
                f"no drafter given for {path_or_hf_repo}; pass drafter=<dir or Hub id>"
            )
    dpath = resolve_path(drafter, "drafter", offline)
    try:
        target, tokenizer = mlx_load(str(tpath), tokenizer_config=tokenizer_config or {})
    except (ValueError, FileNotFoundError, json.JSONDecodeError) as e:
        raise DFlashError(f"cannot load model {tpath} ({str(e).splitlines()[0]})") from None
    draft = load_drafter(dpath, dtype=_target_dtype(target))
    adapter = TargetAdapter(target, [])
    check_compatible(adapter, draft, f"drafter {drafter}")
    adapter.tap(draft.args.target_layer_ids)
    return DFlashModel(target, draft, adapter, str(tpath), str(dpath)), tokenizer
