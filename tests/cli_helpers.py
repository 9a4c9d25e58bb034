"""Helpers for the CLI, registry and chat tests: a tiny target + drafter pair on disk and a
fake Hugging Face cache laid out like the real one (models--owner--name/{blobs,refs,snapshots})."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

REPO_ROOT = Path(__file__).resolve().parents[1]


def build_pair(root: Path, block_size: int = 8, **target) -> Path:
    """root/target (tiny qwen3) and root/drafter (DFlash 2, fits it); returns root.

    target: options of ``tiny_models.build_target`` (``chat_template``, ``context``).
    """
    from tiny_models import build_drafter, build_target

    root = Path(root)
    if not (root / "drafter" / "config.json").is_file():
        build_target(root / "target", "qwen3", **target)
        build_drafter(root / "drafter", root / "target", dflash2=True, block_size=block_size)
    return root


def fake_cache_repo(cache: Path, repo_id: str, src: Path, sha: str = "a" * 40) -> Path:
    """Put the files of directory src into cache as repo_id at commit sha, the way
    huggingface_hub stores them (content-addressed blobs, snapshot symlinks, refs/main).
    Returns the snapshot directory."""
    folder = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    blobs, snap = folder / "blobs", folder / "snapshots" / sha
    blobs.mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / "main").write_text(sha)
    for f in sorted(Path(src).iterdir()):
        if not f.is_file():
            continue
        data = f.read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            shutil.copyfile(f, blob)
        link = snap / f.name
        if link.exists() or link.is_symlink():
            link.unlink()
        os.symlink(os.path.relpath(blob, snap), link)
    return snap


def cli_env(**extra) -> dict:
    """Environment for running ``python -m dflash_mlx.cli`` from the checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.update({k: str(v) for k, v in extra.items()})
    return env
