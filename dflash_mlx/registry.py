"""The model registry: short aliases for target + drafter pairs, and model resolution.

An alias maps to a target repo (one per quantisation) and an ordered list of drafter repos
tried in turn. ``--model`` also takes any Hub id or local directory; the drafter then comes
from ``--drafter``, a ``dflash.json`` next to the target's config, or the registry entry whose
target has the same name. Nothing here imports MLX at module import time.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .errors import DFlashError

DEMO_ENV = "DFLASH_DEMO_DIR"


@dataclass(frozen=True)
class Entry:
    """One registry row.

    Attributes:
        alias: the short name (matched case-insensitively).
        targets: quantisation -> target Hub id (or local directory); the first is the default.
        drafters: drafter Hub ids (or directories), tried in order.
        block_size: the drafter checkpoint's block size.
        kind: "DFlash 2" or "DFlash 1".
        note: one short line shown by ``dflash models``.
    """

    alias: str
    targets: Dict[str, str]
    drafters: Tuple[str, ...]
    block_size: int
    kind: str = "DFlash 2"
    note: str = ""
    local: bool = False

    @property
    def default_quant(self) -> str:
        return next(iter(self.targets))

    def target(self, quant: Optional[str] = None) -> str:
        """The target for a quantisation (default: the first listed)."""
        if quant is None:
            return self.targets[self.default_quant]
        q = quant.lower()
        if q not in self.targets:
            raise DFlashError(
                f"--quant {quant} is not available for {self.alias}; choose one of "
                f"{', '.join(self.targets)}"
            )
        return self.targets[q]


def _mlx(name: str, quants=("4bit", "8bit", "bf16")) -> Dict[str, str]:
    return {q: f"mlx-community/{name}-{q}" for q in quants}


ENTRIES: List[Entry] = [
    Entry(
        "Qwen3.8-27B",
        _mlx("Qwen3.8-27B", ("4bit", "8bit", "bf16", "mxfp8")),
        ("incoai/Qwen3.8-27B-DFlash2", "z-lab/Qwen3.8-27B-DFlash2"),
        8,
        note="hybrid Gated DeltaNet target; blocks of 4-5 are often faster on 4-bit",
    ),
    Entry(
        "Muse-Glimmer-30B",
        _mlx("Muse-Glimmer-30B"),
        ("z-lab/Muse-Glimmer-30B-DFlash2", "incoai/Muse-Glimmer-30B-DFlash2"),
        16,
    ),
    Entry(
        "GLM-5.3-Flash",
        _mlx("GLM-5.3-Flash"),
        ("incoai/GLM-5.3-Flash-DFlash2", "z-lab/GLM-5.3-Flash-DFlash2"),
        16,
    ),
    Entry(
        "Qwen3-8B",
        _mlx("Qwen3-8B"),
        ("z-lab/Qwen3-8B-DFlash-b16",),
        16,
        kind="DFlash 1",
    ),
    Entry(
        "Qwen3-4B",
        _mlx("Qwen3-4B"),
        ("z-lab/Qwen3-4B-DFlash-b16",),
        16,
        kind="DFlash 1",
    ),
]


def demo_dir() -> Path:
    """Directory holding the shipped demo pair (``target/`` and ``drafter/``).

    ``DFLASH_DEMO_DIR`` overrides the package-data location.
    """
    env = os.environ.get(DEMO_ENV)
    return Path(env) if env else Path(__file__).parent / "demo"


def demo_entry() -> Entry:
    d = demo_dir()
    block = 8
    try:
        cfg = json.loads((d / "drafter" / "config.json").read_text())
        block = int(cfg.get("dflash_config", {}).get("block_size", cfg.get("block_size", block)))
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    return Entry(
        "demo",
        {"local": str(d / "target")},
        (str(d / "drafter"),),
        block,
        note="tiny stdlib-code pair shipped with the package; works offline",
        local=True,
    )


def entries() -> List[Entry]:
    """All registry entries, the demo pair first."""
    return [demo_entry()] + ENTRIES


def find(alias: str) -> Optional[Entry]:
    """The entry for an alias (case-insensitive), or None."""
    key = alias.strip().lower()
    for e in entries():
        if e.alias.lower() == key:
            return e
    return None


def suggest(name: str, n: int = 3) -> List[str]:
    """Aliases nearest to name (case-insensitive), best first."""
    aliases = {e.alias.lower(): e.alias for e in entries()}
    key = name.strip().lower().split("/")[-1]
    key = _strip_quant(key)
    hits = sorted((a for a in aliases if key and a.startswith(key)), key=len)
    hits += [h for h in difflib.get_close_matches(key, list(aliases), n=n, cutoff=0.5)
             if h not in hits]
    if not hits:
        hits = [a for a in aliases if key and (key in a or a in key)]
    return [aliases[h] for h in hits[:n]]


_QUANT_SUFFIX = re.compile(
    r"[-_](\d+bit|bf16|fp16|f16|f32|fp32|mxfp[48]|nvfp4|dwq|mlx|awq|gptq)(\b.*)?$", re.I
)


def _strip_quant(name: str) -> str:
    return _QUANT_SUFFIX.sub("", name)


def _repo_name(model: str) -> str:
    """A bare model name for a Hub id or a local directory (HF cache snapshots included)."""
    p = Path(os.path.expanduser(model))
    parts = p.parts
    for i, part in enumerate(parts):
        if part.startswith("models--") and i + 1 < len(parts) and parts[i + 1] == "snapshots":
            return part.split("--")[-1]
    return p.name or model


def entry_for_target(model: str) -> Optional[Entry]:
    """The registry entry whose target has the same name as model (quant suffix ignored)."""
    name = _strip_quant(_repo_name(model)).lower()
    for e in ENTRIES:
        if e.alias.lower() == name:
            return e
        if any(_strip_quant(_repo_name(t)).lower() == name for t in e.targets.values()):
            return e
    return None


def _looks_like_path(s: str) -> bool:
    return s.startswith((".", "/", "~")) or s.count("/") > 1 or os.sep in s and "/" != os.sep


@dataclass
class Resolved:
    """What ``resolve`` decided: where the target comes from and which drafters to try."""

    target: str
    drafters: List[str]
    display_name: str
    entry: Optional[Entry] = None
    block_size: Optional[int] = None
    notes: List[str] = field(default_factory=list)


def resolve(model: str, drafter: Optional[str] = None, quant: Optional[str] = None) -> Resolved:
    """Turn --model/--drafter/--quant into a target and an ordered drafter list (no I/O on
    the Hub).

    Raises:
        DFlashError: unknown alias (with suggestions), missing local path, bad --quant,
            no drafter known.
    """
    from .loading import is_hub_id

    if not model or not str(model).strip():
        raise DFlashError(
            "--model is empty; pass an alias (see `dflash models`), a Hub id or a directory"
        )
    model = str(model).strip()
    entry = find(model)
    if entry is not None:
        if entry.local:
            tdir = Path(entry.target())
            if quant is not None:
                raise DFlashError(f"--quant does not apply to the {entry.alias} model; drop it")
            missing = [d for d in [tdir] + ([] if drafter else [Path(entry.drafters[0])])
                       if not d.is_dir() or not any(d.glob("*.safetensors"))]
            if missing:
                raise DFlashError(
                    f"the {entry.alias} model is not installed ({missing[0]} is missing); "
                    f"reinstall dflash-mlx or set {DEMO_ENV} to a directory with target/ and "
                    "drafter/"
                )
        target = entry.target(quant)
        drafters = [drafter] if drafter else list(entry.drafters)
        return Resolved(target, drafters, entry.alias, entry, entry.block_size)

    p = Path(os.path.expanduser(model))
    if p.is_dir():
        target, display = str(p), _repo_name(model)
    elif p.exists():
        raise DFlashError(f"model path {model} is a file; pass the model's directory")
    elif is_hub_id(model):
        target, display = model, model
    elif _looks_like_path(model):
        raise DFlashError(f"model directory {model} does not exist; check the path")
    else:
        near = suggest(model)
        hint = f"did you mean {' or '.join(near)}? " if near else ""
        raise DFlashError(
            f"unknown model alias '{model}'; {hint}run `dflash models` for the list, or pass "
            "a Hub id (owner/name) or a local directory"
        )
    if quant is not None:
        raise DFlashError(
            f"--quant only applies to registry aliases; pass the exact Hub id of the "
            f"quantised model instead of {model}"
        )
    match = entry_for_target(target)
    if drafter:
        drafters = [drafter]
    elif p.is_dir() and (p / "dflash.json").is_file():
        try:
            drafters = [str(p / json.loads((p / "dflash.json").read_text())["dflash_drafter"])]
        except (ValueError, KeyError, TypeError):
            raise DFlashError(
                f"{p / 'dflash.json'} is not valid (needs a 'dflash_drafter' entry); fix it or "
                "pass --drafter"
            ) from None
    elif match is not None:
        drafters = list(match.drafters)
    else:
        raise DFlashError(
            f"no drafter known for {model}; pass --drafter <directory or Hub id> "
            "(`dflash models` lists the known pairs)"
        )
    return Resolved(target, drafters, display, match, match.block_size if match else None)


def load_model(
    model: str,
    drafter: Optional[str] = None,
    quant: Optional[str] = None,
    offline: Optional[bool] = None,
    quiet: bool = False,
    log=None,
):
    """Resolve an alias / Hub id / local directory, fetch what is missing, and load the pair.

    Drafters are tried in order: a drafter that cannot be found or fetched falls through to
    the next; one that loads but does not fit the target is an error.

    Args:
        model: registry alias (case-insensitive), Hub id or local directory.
        drafter: drafter Hub id or directory (default: from the registry).
        quant: quantisation of an alias's target (e.g. 4bit, 8bit, bf16, mxfp8).
        offline: never touch the network (default: HF_HUB_OFFLINE).
        quiet: no download notices or progress bars. log: callable(str) for notices
            (default: print to stderr).

    Returns:
        (DFlashModel, tokenizer, display_name).

    Raises:
        DFlashError: one line naming the problem and the fix.
    """
    from . import hub
    from .loading import load

    res = resolve(model, drafter, quant)
    if offline is None:
        offline = hub.env_offline()
    tpath = hub.fetch(res.target, "model", offline=offline, quiet=quiet, log=log)
    errors = []
    dpath = None
    for d in res.drafters:
        try:
            dpath = hub.fetch(d, "drafter", offline=offline, quiet=quiet, log=log)
            break
        except DFlashError as e:
            errors.append(str(e))
    if dpath is None:
        if len(errors) == 1:
            raise DFlashError(errors[0])
        raise DFlashError(f"{errors[0]} (also tried {', '.join(res.drafters[1:])})")
    try:
        m, tok = load(str(tpath), drafter=str(dpath), offline=True)
    except DFlashError:
        raise
    except (RuntimeError, KeyError, OSError, ValueError, TypeError, AttributeError) as e:
        # mlx / mlx-lm on a corrupt or unsupported checkpoint: one line, not a traceback.
        reason = (str(e).splitlines() or [type(e).__name__])[0][:160]
        raise DFlashError(
            f"cannot load {res.display_name} from {tpath} ({type(e).__name__}: {reason}); "
            "re-download it or check that mlx-lm supports this model"
        ) from None
    return m, tok, res.display_name
