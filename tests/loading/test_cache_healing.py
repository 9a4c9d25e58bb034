"""Nothing a user leaves behind breaks the next run (issue 34): the start-up caches heal.

Every file of a GGUF weights entry and of a warm-up costs entry is damaged in every way the
hostile probe did (cut short, emptied, random bytes, one byte flipped, JSON of the wrong
shape, ``{}``, missing keys, 1e999 / NaN / -Infinity, strings where numbers go, 100k-deep
nesting), with its mtime put back. The next load, in a subprocess where a crash shows as a
signal, must give the same model, say at most one note, and leave an entry the load after
reads silently. Property tests then throw arbitrary bytes and JSON at the readers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
from corruption import BYTES, JSON, damage, reseal
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_gguf import write_tiny_gguf

from dflash_mlx.loading import cachedir, diskcache

HERE = Path(__file__).parent
GGUF_FILES = (*diskcache.GGUF_FILES, cachedir.MANIFEST)
COSTS_FILES = (diskcache.COSTS_FILE, cachedir.MANIFEST)
KEYS = {
    "info.json": ("config", "tokenizer"),
    "manifest.json": ("versions", "files"),
    "costs.json": ("version", "max_block", "measured", "seconds", "lookup_seconds"),
}
FIELD_VALUES = ("a string", "null", "1e999", "NaN", "a list", "an object", "true", "a huge int")
BAD_TABLES = {  # a costs table's widths and seconds of every wrong kind
    "width x": {"x": 0.1},
    "width 0": {"0": 0.1},
    "width 99": {"99": 0.1},
    "width -1": {"-1": 0.1},
    "width 1e3": {"1e3": 0.1},
    "seconds as a string": {"2": "0.05"},
    "seconds 1e999": {"2": 1e999},
    "seconds -1": {"2": -1.0},
    "seconds 0": {"2": 0.0},
    "seconds 5e-324": {"2": 5e-324},
    "seconds true": {"2": True},
}


def _cases(target: str, files, forge_fields: set) -> list[dict]:
    """Every damage to every file of an entry; fields of a forged file (its manifest
    rewritten to match) must be caught by the reader's own checks."""
    out = []
    for f in files:
        kinds = list(BYTES) + (list(JSON) if f.endswith(".json") else [])
        out += [
            {"target": target, "file": f, "kind": k, "name": f"{target} {f} {k}"} for k in kinds
        ]
        for key in KEYS.get(f, ()):
            for v in ("without", *FIELD_VALUES):
                variant = f"without {key}" if v == "without" else f"{key} is {v}"
                out.append(
                    {
                        "target": target,
                        "file": f,
                        "kind": f"field:{variant}",
                        "forge": f in forge_fields,
                        "name": f"{target} {f} {variant}",
                    }
                )
    return out


def _special(target: str, data_file: str) -> list[dict]:
    """A file deleted, an entry never sealed, and temporary files of a killed writer
    (pid dead) and of a live one (this test's pid: kept)."""
    base = {"target": target}
    return [
        {**base, "file": data_file, "kind": "delete", "name": f"{target} {data_file} deleted"},
        {**base, "file": cachedir.MANIFEST, "kind": "delete", "name": f"{target} never sealed"},
        {
            **base,
            "file": data_file,
            "kind": "temp",
            "pid": 4194304 + 7,
            "name": f"{target} dead tmp",
        },
        {
            **base,
            "file": data_file,
            "kind": "temp",
            "pid": os.getpid(),
            "name": f"{target} live tmp",
        },
        {**base, "file": data_file, "kind": "random", "forge": True, "name": f"{target} forged"},
    ]


FORGED_TOKENIZER = [
    {
        "target": "gguf",
        "file": "tokenizer.json",
        "kind": k,
        "forge": True,
        "name": f"gguf tokenizer.json forged {k}",
    }
    for k in ("{}", "deep-list", "truncated", "flipped-byte")
]


def _table_cases() -> list[dict]:
    good = {"1": 0.05, "2": 0.06}
    return [
        {
            "target": "costs",
            "file": "costs.json",
            "kind": "text",
            "forge": True,
            "name": f"costs {name}",
            "text": json.dumps(
                {
                    "version": diskcache.COSTS_VERSION,
                    "max_block": 8,
                    "measured": time.time(),
                    "seconds": {**good, **bad},
                    "lookup_seconds": good,
                }
            ),
        }
        for name, bad in BAD_TABLES.items()
    ]


CASES = (
    _cases("gguf", GGUF_FILES, {"info.json"})
    + _special("gguf", "weights.safetensors")
    + FORGED_TOKENIZER
    + _cases("costs", COSTS_FILES, {"costs.json"})
    + _special("costs", "costs.json")
    + _table_cases()
)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("heal")
    write_tiny_gguf(root / "tiny.gguf", root)
    spec = {"gguf": str(root / "tiny.gguf"), "pristine": str(root / "pristine"), "cases": CASES}
    (root / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "DFLASH_CACHE_DIR": str(root / "cache"), "PYTHONPATH": str(HERE)}
    env["PYTHONPATH"] += os.pathsep + str(HERE.parent)
    p = subprocess.run(
        [sys.executable, str(HERE / "heal_worker.py"), str(root / "spec.json")],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=900,
    )
    last = [ln for ln in p.stdout.splitlines() if ln.startswith("CASE")][-1:]
    assert p.returncode == 0, f"exit {p.returncode} during {last}: {p.stderr[-3000:]}"
    out = {}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT ") :])
            out[r.pop("name")] = r
    return out


def _expected_notes(case: dict) -> set[int]:
    if case["kind"] == "temp":
        return {0}
    if case["name"].endswith("never sealed"):  # incomplete: rebuilt as on a first run
        return {1} if case["target"] == "gguf" else {0}
    if case.get("forge") and case["target"] == "costs":
        return {0, 1}  # a forged file that reads as stale costs is measured again silently
    return {1}


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_a_damaged_cache_file_is_rebuilt_with_at_most_one_note(results, case):
    r = results[case["name"]]
    assert len(r["notes"]) in _expected_notes(case), r["notes"]
    assert all(n.startswith("note: ") and "\n" not in n for n in r["notes"]), r["notes"]
    assert r["same_again"], "the rebuilt entry did not load as the original"
    if r["notes"] and not case["name"].endswith("never sealed"):
        assert "cannot be used" in r["notes"][0], r["notes"]
    if case["target"] == "gguf":
        assert r["same"] and r["again"] == [], r
    else:  # a leftover temporary file damages nothing
        assert r["refused"] != (case["kind"] == "temp"), r
    live = case.get("pid") == os.getpid()
    assert bool(r["temps"]) == live, r["temps"]  # a dead writer's file went, a live one's not


# ------------------------------------------------------------------ properties, in process

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
FAST = settings(max_examples=150, deadline=None)


@FAST
@given(st.binary(max_size=300) | st.sampled_from([b"[" * 50_000, b'{"a":' * 50_000]))
def test_read_json_never_raises(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("j") / "x.json"
    path.write_bytes(data)
    got = cachedir.read_json(path)
    assert got is None or isinstance(got, dict)


@pytest.fixture(scope="module")
def sealed_entry(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sealed")
    (folder / "data.bin").write_bytes(bytes(range(256)) * 64)
    assert cachedir.seal(folder, ["data.bin"], {"v": "1"})
    return folder


@FAST
@given(JSON_VALUES)
def test_any_manifest_but_the_real_one_is_refused_and_nothing_raises(sealed_entry, value):
    real = cachedir.read_json(sealed_entry / cachedir.MANIFEST)
    path = sealed_entry / "forged" / cachedir.MANIFEST
    path.parent.mkdir(exist_ok=True)
    (path.parent / "data.bin").write_bytes((sealed_entry / "data.bin").read_bytes())
    path.write_text(json.dumps({"versions": {"v": "1"}, "files": {"data.bin": value}}))
    why = cachedir.check(path.parent, ["data.bin"], {"v": "1"})
    assert why is not None or _crc_only(value, real)


def _crc_only(value, real) -> bool:
    """A stamp that differs while the CRC matches: the bytes are hashed and found right."""
    want = real["files"]["data.bin"]
    return isinstance(value, dict) and value.get("crc32") == want["crc32"]


@FAST
@given(st.integers(min_value=0, max_value=256 * 64 - 1), st.integers(min_value=1, max_value=255))
def test_any_flipped_byte_of_a_sealed_file_is_found(tmp_path_factory, at, xor):
    folder = tmp_path_factory.mktemp("flip")
    data = bytearray(bytes(range(256)) * 64)
    (folder / "data.bin").write_bytes(data)
    cachedir.seal(folder, ["data.bin"], {})
    st_ = (folder / "data.bin").stat()
    data[at] ^= xor
    (folder / "data.bin").write_bytes(data)
    os.utime(folder / "data.bin", ns=(st_.st_atime_ns, st_.st_mtime_ns))
    assert (
        zlib.crc32(data)
        != cachedir.read_json(folder / "manifest.json")["files"]["data.bin"]["crc32"]
    )
    assert "bytes changed" in cachedir.check(folder, ["data.bin"], {})


class _Pair:
    target_path = drafter_path = __file__
    block_size, draft_head = 8, None


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(KEYS["costs.json"]),
        JSON_VALUES | st.dictionaries(st.text(max_size=4), JSON_VALUES, max_size=4),
        max_size=5,
    )
)
def test_stored_costs_of_any_shape_are_tables_or_refused(
    tmp_path_factory, monkeypatch_session, data
):
    entry = tmp_path_factory.mktemp("costs")
    monkeypatch_session.setattr(diskcache, "_costs_path", lambda pair: entry / "costs.json")
    data = {"version": diskcache.COSTS_VERSION, "max_block": 8, "measured": time.time()} | data
    (entry / "costs.json").write_text(json.dumps(data))
    reseal(entry, ["costs.json"], {})
    got = diskcache.read_costs(_Pair())
    if got is not None:
        for table in got.values():
            assert table and all(1 <= b <= 8 and 0 < s < 1e5 for b, s in table.items())


@pytest.fixture(scope="module")
def monkeypatch_session():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_a_temp_file_of_a_live_writer_stays_and_an_old_one_goes(tmp_path):
    live = tmp_path / f".tmp{os.getpid()}-weights.safetensors"
    dead = tmp_path / ".tmp4194311-weights.safetensors"
    old = tmp_path / f".tmp{os.getppid()}-info.json"
    for p in (live, dead, old):
        p.write_bytes(b"x")
    os.utime(old, (1, 1))  # older than an hour: stale whatever its pid says
    assert cachedir.sweep_temps(tmp_path) == 2
    assert live.exists() and not dead.exists() and not old.exists()


def test_damage_keeps_the_mtime(tmp_path):
    p = tmp_path / "x.json"
    p.write_text('{"a": 1}')
    before = p.stat().st_mtime_ns
    damage(p, "deep-list")
    assert p.stat().st_mtime_ns == before and p.read_bytes().startswith(b"[[[")
