"""Runs damaged-cache cases in one process, for test_cache_healing.py: a crash shows as a
signal in the return code and the last ``CASE`` line says which case caused it.

``python heal_worker.py SPEC.json``: SPEC holds the tiny GGUF's path and the cases. Each
case restores a pristine entry, damages one file, loads, and prints ``RESULT <json>``:
the notes said, whether the load gave the reference model, and whether the next load read
the rebuilt entry without a word.
"""

from __future__ import annotations

import io
import json
import shutil
import sys
from contextlib import redirect_stderr
from pathlib import Path

from corruption import damage, reseal

import dflash_mlx  # noqa: F401  (before MLX, as a user's run)
from dflash_mlx.loading import cachedir, diskcache, gguf

TEXT = "def parse_args(argv): <|im_start|> 2024"
TABLES = {
    "seconds": {1: 0.05, **{b: 0.05 + 0.01 * b for b in range(2, 9)}},
    "lookup_seconds": {1: 0.05, **{b: 0.05 + 0.005 * b for b in range(2, 9)}},
}


class Pair:
    """What ``read_costs`` / ``write_costs`` read of a loaded pair."""

    def __init__(self, path: str):
        self.target_path = self.drafter_path = path
        self.block_size, self.draft_head = 8, None


def _apply(folder: Path, case: dict, names) -> None:
    path = folder / case["file"]
    if case["kind"] == "delete":
        path.unlink()
    elif case["kind"] == "temp":  # what a writer killed mid-write left (pid in the name)
        (folder / f".tmp{case['pid']}-{case['file']}").write_bytes(b"\0" * (1 << 20))
    else:
        damage(path, case["kind"], case.get("text"))
        if case.get("forge"):
            reseal(folder, names)


def _temps(entry: Path) -> list[str]:
    found = entry.iterdir() if entry.exists() else []  # a damaged entry is gone
    return sorted(p.name for p in found if p.name.startswith(".tmp"))


def _load(path, ids):
    import mlx.core as mx

    notes = []
    err = io.StringIO()
    with redirect_stderr(err):
        model, tok, _ = gguf.load_gguf(path, dtype="float32", log=notes.append)
    return notes + err.getvalue().splitlines(), model(mx.array(ids)), tok.encode(TEXT)


def gguf_case(case: dict, ctx: dict) -> dict:
    import mlx.core as mx

    entry = ctx["entry"]
    shutil.rmtree(entry, ignore_errors=True)
    shutil.copytree(ctx["pristine"], entry)  # new inodes: the first check hashes them
    _apply(entry, case, diskcache.GGUF_FILES)
    notes, logits, ids = _load(ctx["path"], ctx["ids"])
    same = bool(mx.array_equal(logits, ctx["logits"]).item()) and ids == ctx["tokens"]
    again, logits2, _ = _load(ctx["path"], ctx["ids"])
    temps = sorted(p.name for p in entry.iterdir() if p.name.startswith(".tmp"))
    return {
        "notes": notes,
        "same": same,
        "again": again,
        "temps": temps,
        "same_again": bool(mx.array_equal(logits2, ctx["logits"]).item()),
    }


def costs_case(case: dict, ctx: dict) -> dict:
    pair = Pair(ctx["path"])
    diskcache.write_costs(pair, TABLES)
    entry = diskcache.costs_file(pair.target_path, pair.drafter_path).parent
    cachedir._state["swept"].clear()  # the load below is the next start
    _apply(entry, case, [diskcache.COSTS_FILE])
    err = io.StringIO()
    with redirect_stderr(err):
        got = diskcache.read_costs(pair)
        temps = _temps(entry)
        diskcache.write_costs(pair, TABLES)  # measured again
        again = diskcache.read_costs(pair)
    return {
        "notes": err.getvalue().splitlines(),
        "refused": got is None,
        "same_again": again == TABLES,
        "temps": temps,
    }


def main(spec_path: str) -> None:
    import mlx.core as mx

    spec = json.loads(Path(spec_path).read_text())
    path = spec["gguf"]
    model, tok, _ = gguf.load_gguf(path, dtype="float32")  # builds the entry
    entry = diskcache.gguf_entry(path)
    assert cachedir.sealed(entry)
    pristine = Path(spec["pristine"])
    shutil.copytree(entry, pristine)
    ids = [[1, 5, 9, 2, 7]]
    ctx = {"path": path, "entry": entry, "pristine": pristine, "ids": ids}
    ctx |= {"logits": model(mx.array(ids)), "tokens": tok.encode(TEXT)}
    for case in spec["cases"]:
        print("CASE", case["name"], flush=True)
        cachedir._state["swept"].clear()  # each case is the next start: leftovers are swept
        run = gguf_case if case["target"] == "gguf" else costs_case
        print("RESULT", json.dumps({"name": case["name"], **run(case, ctx)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
