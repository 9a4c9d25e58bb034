"""The prompt caches' disk tier under hostile conditions (``server/prompt_cache_disk.py``):
entries swapped on disk are dropped, not served; planted symbolic links at the pair, entry
and file levels are never followed (nothing outside the root changes); a read-only or
vanished folder degrades to memory with one warning; two tiers share one folder. In each,
the answers equal plain decoding."""

from __future__ import annotations

import builtins
import errno
import io
import logging
import os
import shutil
from pathlib import Path

import pytest
from test_prompt_cache import filled, ids, run

from dflash_mlx.server.prompt_cache import PromptPool
from dflash_mlx.server.prompt_cache_disk import DiskTier
from dflash_mlx.server.prompt_cache_entry import entry_name


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under folder (links not followed) and its bytes."""
    out = {}
    for dirpath, _, names in os.walk(folder):
        for n in names:
            p = Path(dirpath) / n
            out[str(p.relative_to(folder))] = p.read_bytes()
    return out


def outside_folder(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """A folder outside the cache root that looks like an entry, and its files."""
    out = tmp_path / "outside"
    out.mkdir()
    (out / "manifest.json").write_text('{"files": {}}')
    (out / "meta.json").write_text('{"tokens": [1, 2, 3]}')
    (out / "precious.txt").write_text("keep me")
    return out, snapshot(out)


def exact(pool, model, tok, prompt) -> int:
    """Take a cache for prompt, check its answer equals plain decoding, give it back;
    returns the tokens reused."""
    cache = pool.take(prompt)
    n = cache.usable(prompt)
    assert cache.tokens[:n] == prompt[:n]  # never another prompt's state
    text, reused = run(model, tok, prompt, cache)
    assert text == run(model, tok, prompt)[0]
    pool.give(cache)
    return reused


def warnings(caplog, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def test_swapped_entries_of_equal_length_are_dropped_not_served(pairs, tmp_path, caplog):
    model, tok = pairs("qwen3", "d2")
    pool = PromptPool(model, 0, DiskTier.open(str(tmp_path / "pc"), model))  # all to disk
    a, b = ids(1, 40), ids(2, 40)
    filled(pool, model, tok, a)
    filled(pool, model, tok, b)
    ea, eb = sorted(pool.disk.folder.glob("e-*"))
    assert len(pool.disk.index[ea.name]["tokens"]) == len(pool.disk.index[eb.name]["tokens"])
    swap = ea.with_name("swap")
    ea.rename(swap), eb.rename(ea), swap.rename(eb)  # each name now holds the other's state
    caplog.clear()
    assert exact(pool, model, tok, a + ids(3, 5)) == 0
    assert exact(pool, model, tok, b + ids(4, 5)) == 0
    assert warnings(caplog, "holds other tokens") == 2
    assert pool.stats()["disk"]["removed_damaged"] == 2


def test_a_linked_entry_is_left_alone_and_nothing_outside_changes(pairs, tmp_path, caplog):
    model, tok = pairs("qwen3", "d2")
    out, before = outside_folder(tmp_path)
    tier = DiskTier.open(str(tmp_path / "pc"), model)
    (tier.folder / "e-evil").symlink_to(out)
    prompt = ids(1, 40)
    cache = model.make_cache()
    run(model, tok, prompt, cache)
    (tier.folder / entry_name(cache.tokens)).symlink_to(out)  # where this entry would go
    caplog.clear()
    pool = PromptPool(model, 0, DiskTier.open(str(tmp_path / "pc"), model))  # a restart
    pool.disk.put(cache)  # refused: the entry's name is a link
    assert pool.stats()["disk"]["saved"] == 0
    assert exact(pool, model, tok, prompt + ids(2, 5)) == 0
    assert snapshot(out) == before  # its manifest.json survives; nothing was written there
    assert warnings(caplog, "symbolic link") == 2


def test_a_linked_pair_folder_is_never_written_through(pairs, tmp_path, caplog):
    model, tok = pairs("qwen3", "d2")
    out, before = outside_folder(tmp_path)
    folder = DiskTier.open(str(tmp_path / "pc"), model).folder
    folder.rmdir()
    folder.symlink_to(out)
    caplog.clear()
    pool = PromptPool(model, 0, DiskTier.open(str(tmp_path / "pc"), model))
    prompt = ids(1, 40)
    exact(pool, model, tok, prompt)
    assert exact(pool, model, tok, prompt + ids(2, 5)) == 0
    assert snapshot(out) == before and warnings(caplog, "symbolic link") == 1


def test_a_linked_file_in_an_entry_is_not_read(pairs, tmp_path, caplog):
    model, tok = pairs("qwen3", "d2")
    pool = PromptPool(model, 0, DiskTier.open(str(tmp_path / "pc"), model))
    filled(pool, model, tok, ids(1, 40))
    (entry,) = pool.disk.folder.glob("e-*")
    out = tmp_path / "outside.safetensors"
    (entry / "target.safetensors").rename(out)
    (entry / "target.safetensors").symlink_to(out)
    before = out.read_bytes()
    caplog.clear()
    assert exact(pool, model, tok, ids(1, 40) + ids(2, 5)) == 0
    assert out.read_bytes() == before and warnings(caplog, "not a plain file") == 1


def test_a_root_named_through_a_link_is_used(pairs, tmp_path):
    model, tok = pairs("qwen3", "d2")
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    pool = PromptPool(model, 0, DiskTier.open(str(tmp_path / "link"), model))
    filled(pool, model, tok, ids(1, 40))
    assert exact(pool, model, tok, ids(1, 40) + ids(2, 5)) == 40
    assert any((tmp_path / "real").glob("*/e-*/meta.json"))


def _read_only(monkeypatch) -> None:
    """Writes in the file system fail as on a read-only mount (chmod does not stop root)."""

    def refuse(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    for name in ("utime", "mkdir", "rename", "replace", "unlink", "rmdir"):
        monkeypatch.setattr(os, name, refuse)
    real_open = io.open

    def open_(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+"):
            refuse()
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(io, "open", open_)
    monkeypatch.setattr(builtins, "open", open_)


def test_a_read_only_folder_degrades_to_memory_with_one_warning(pairs, tmp_path, caplog):
    model, tok = pairs("qwen3", "d2")
    pool = PromptPool(model, 0, DiskTier.open(str(tmp_path / "pc"), model))
    filled(pool, model, tok, ids(1, 40))
    before = snapshot(tmp_path / "pc")
    caplog.clear()
    with pytest.MonkeyPatch.context() as mp:
        _read_only(mp)
        again = PromptPool(model, 10**9, DiskTier.open(str(tmp_path / "pc"), model))  # restart
        assert exact(again, model, tok, ids(1, 40) + ids(2, 5)) == 40  # read, not touched
        again.max_bytes = 0  # evicted to a disk that cannot take it, twice
        assert exact(again, model, tok, ids(3, 40)) == 0
        assert exact(again, model, tok, ids(4, 40)) == 0
        again.close()
        fresh = PromptPool(model, 0, DiskTier.open(str(tmp_path / "other"), model))
        assert exact(fresh, model, tok, ids(5, 40)) == 0
    assert warnings(caplog, "cannot be written") == 2  # once per tier
    assert again.stats()["disk"]["writable"] is False
    assert snapshot(tmp_path / "pc") == before


def test_a_vanished_folder_degrades_to_memory(pairs, tmp_path, caplog):
    model, tok = pairs("qwen3", "d2")
    pool = PromptPool(model, 10**9, DiskTier.open(str(tmp_path / "pc"), model))
    filled(pool, model, tok, ids(1, 40))
    pool.max_bytes = 0
    filled(pool, model, tok, ids(2, 40))  # to disk
    shutil.rmtree(tmp_path / "pc")
    caplog.clear()
    assert exact(pool, model, tok, ids(2, 40) + ids(3, 5)) == 0
    assert exact(pool, model, tok, ids(4, 40)) == 0
    assert exact(pool, model, tok, ids(5, 40)) == 0
    assert warnings(caplog, "cannot be written") == 1 and not (tmp_path / "pc").exists()


def test_two_tiers_on_one_folder_never_serve_a_wrong_state(pairs, tmp_path):
    model, tok = pairs("qwen3", "d2")
    one = PromptPool(model, 0, DiskTier.open(str(tmp_path / "pc"), model))
    two = PromptPool(model, 0, DiskTier.open(str(tmp_path / "pc"), model))
    a, b = ids(1, 40), ids(2, 40)
    exact(one, model, tok, a)
    exact(two, model, tok, a)  # the same entry written again by the other server
    assert exact(one, model, tok, a + ids(3, 5)) == 40
    assert exact(two, model, tok, b) == 0
    follow = one.disk.index  # one extends a: its longer entry replaces the prefix entry
    assert exact(two, model, tok, a + ids(3, 5)) == 40
    assert exact(one, model, tok, b + ids(4, 5)) == 0  # one never saw b: a fresh start
    assert follow is one.disk.index
    three = PromptPool(model, 0, DiskTier.open(str(tmp_path / "pc"), model))
    assert exact(three, model, tok, b + ids(4, 5)) == 44  # one's entry for it
    for pool in (one, two, three):
        assert exact(pool, model, tok, a + ids(3, 5) + ids(6, 3)) >= 0
