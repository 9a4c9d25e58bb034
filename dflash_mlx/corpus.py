"""Training corpus for the demo pair: the Python standard library's own ``.py`` sources.

The corpus is deterministic for a given interpreter: files are collected from
``sysconfig.get_paths()["stdlib"]`` (tests, ``site-packages`` and generated files left out)
and split into train / held-out by a hash of their relative path, so every run and every
machine with the same Python holds out the same files. Held-out figures should be reported
without ``encodings/*`` (codec tables: a quarter of the tokens and trivially predictable);
:func:`load_split` therefore keeps the ``encodings/*`` tokens in a separate stream.

A byte-level BPE tokenizer is trained on the train files with ``tokenizers`` and saved in the
Hugging Face layout (``tokenizer.json`` + ``tokenizer_config.json``), which ``mlx_lm.load`` and
``transformers.AutoTokenizer`` read. Token arrays are cached as ``.npy`` under a work folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [EOS_TOKEN, MASK_TOKEN, PAD_TOKEN]
DEFAULT_VOCAB = 4096
DEFAULT_WORK_DIR = Path(__file__).resolve().parent.parent / ".work"

# Path components that mark test suites, demos and generated files inside the stdlib.
_SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "turtledemo"}
_SKIP_PREFIXES = ("config-", "_sysconfigdata")


def stdlib_root() -> Path:
    """Return the folder of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel_path: str, heldout_percent: int = 5) -> bool:
    """Decide deterministically whether a file belongs to the held-out split.

    Args:
        rel_path: path relative to the stdlib root, with ``/`` separators.
        heldout_percent: share of files to hold out, in percent.
    """
    digest = hashlib.sha1(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % 100 < heldout_percent


def is_encodings(rel_path: str) -> bool:
    """True for the codec tables under ``encodings/`` (excluded from held-out figures)."""
    return rel_path.startswith("encodings/")


def collect_files(root: Path | None = None, limit: int | None = None) -> list[str]:
    """List the corpus files as sorted relative paths.

    Args:
        root: stdlib folder; the running interpreter's by default.
        limit: keep only the first ``limit`` files (after sorting), for smoke runs.
    """
    root = Path(root) if root is not None else stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        dirnames[:] = sorted(
            d for d in dirnames if d not in _SKIP_PARTS and not d.startswith(_SKIP_PREFIXES)
        )
        for name in sorted(filenames):
            if not name.endswith(".py") or name.startswith(_SKIP_PREFIXES):
                continue
            out.append((rel_dir / name).as_posix())
    out.sort()
    return out[:limit] if limit else out


def read_source(root: Path, rel_path: str) -> str:
    """Read one source file as text (undecodable bytes replaced)."""
    return (Path(root) / rel_path).read_text(encoding="utf-8", errors="replace")


def train_tokenizer(texts, vocab_size: int = DEFAULT_VOCAB, special_tokens=None):
    """Train a byte-level BPE tokenizer.

    Args:
        texts: iterable of training strings (one per file).
        vocab_size: total vocabulary size, special tokens included.
        special_tokens: ids 0.. in order (default: EOS, mask, pad).

    Returns:
        A ``tokenizers.Tokenizer``; ids 0..2 are EOS, mask and pad.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens or SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok, out_dir: Path) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` in the Hugging Face layout.

    Args:
        tok: a trained ``tokenizers.Tokenizer``.
        out_dir: destination folder (created if missing).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "mask_token": MASK_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps(
            {"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "mask_token": MASK_TOKEN}, indent=2
        )
        + "\n"
    )


@dataclass
class Split:
    """Token streams of one split: files joined with EOS, as uint16 arrays.

    ``main`` holds every file except ``encodings/*``; ``encodings`` holds those. For the
    train split the two are concatenated by :meth:`all`.
    """

    main: np.ndarray
    encodings: np.ndarray

    def all(self) -> np.ndarray:
        """Both streams, concatenated."""
        return np.concatenate([self.main, self.encodings])


def build_corpus(
    work_dir: Path | None = None,
    vocab_size: int = DEFAULT_VOCAB,
    limit: int | None = None,
    heldout_percent: int = 5,
    force: bool = False,
) -> Path:
    """Collect files, train the tokenizer and tokenize both splits, caching everything.

    Args:
        work_dir: cache folder; ``<repo>/.work/corpus-v<vocab>[-n<limit>]`` by default.
        vocab_size: BPE vocabulary size.
        limit: use only the first ``limit`` files (smoke runs).
        heldout_percent: share of files held out.
        force: rebuild even if the cache exists.

    Returns:
        The cache folder, holding ``tokenizer/`` and ``{train,heldout}_{main,encodings}.npy``.
    """
    name = f"corpus-v{vocab_size}" + (f"-n{limit}" if limit else "")
    cache = Path(work_dir) if work_dir is not None else DEFAULT_WORK_DIR / name
    done = cache / "meta.json"
    if done.exists() and not force:
        return cache
    cache.mkdir(parents=True, exist_ok=True)
    root = stdlib_root()
    files = collect_files(root, limit)
    if limit:  # make sure a smoke corpus has some held-out files too
        held = [f for f in files if is_heldout(f, heldout_percent)] or files[-1:]
    else:
        held = [f for f in files if is_heldout(f, heldout_percent)]
    held_set = set(held)
    train = [f for f in files if f not in held_set]
    texts = {f: read_source(root, f) for f in files}
    tok = train_tokenizer((texts[f] for f in train), vocab_size)
    save_tokenizer(tok, cache / "tokenizer")
    eos = tok.token_to_id(EOS_TOKEN)
    meta = {
        "vocab_size": vocab_size,
        "eos_id": eos,
        "mask_id": tok.token_to_id(MASK_TOKEN),
        "stdlib": str(root),
        "n_train_files": len(train),
        "n_heldout_files": len(held),
        "heldout_files": held,
        "tokens": {},
    }
    for split, names in (("train", train), ("heldout", held)):
        for part in ("main", "encodings"):
            sel = [f for f in names if is_encodings(f) == (part == "encodings")]
            encs = tok.encode_batch([texts[f] for f in sel]) if sel else []
            ids = []
            for e in encs:
                ids.extend(e.ids)
                ids.append(eos)
            arr = np.asarray(ids, dtype=np.uint16)
            np.save(cache / f"{split}_{part}.npy", arr)
            meta["tokens"][f"{split}_{part}"] = int(arr.size)
    done.write_text(json.dumps(meta, indent=1) + "\n")
    return cache


def load_split(cache: Path, split: str) -> Split:
    """Load one cached split.

    Args:
        cache: folder returned by :func:`build_corpus`.
        split: ``"train"`` or ``"heldout"``.
    """
    cache = Path(cache)
    return Split(np.load(cache / f"{split}_main.npy"), np.load(cache / f"{split}_encodings.npy"))


def load_meta(cache: Path) -> dict:
    """Read the cache's ``meta.json`` (token counts, special ids, held-out file list)."""
    return json.loads((Path(cache) / "meta.json").read_text())


if __name__ == "__main__":
    c = build_corpus()
    m = load_meta(c)
    print(c, m["n_train_files"], m["n_heldout_files"], m["tokens"])
