"""The on-disk caches: a GGUF target's dequantized weights and tokenizer (built once, said
once, then loaded as they were) and the warm-up's step costs per pair and machine."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from tiny_gguf import write_tiny_gguf

from dflash_mlx.loading import diskcache, gguf

SESSION_CACHE = os.environ.get("DFLASH_CACHE_DIR", "")  # the run's (tests/conftest.py)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(root))
    monkeypatch.delenv("DFLASH_CACHE", raising=False)
    return root


def test_the_cache_folder_follows_the_override_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "mine"))
    assert diskcache.cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("DFLASH_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert diskcache.cache_dir() == tmp_path / "xdg" / "dflash-mlx"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert diskcache.cache_dir() == tmp_path / "home" / ".cache" / "dflash-mlx"


def test_a_gguf_is_dequantized_once_then_loaded_from_the_cache(cache, tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tmp_path)
    notes = []
    m1, tok1, cfg1 = gguf.load_gguf(path, dtype="float32", log=notes.append)
    assert len(notes) == 1 and "caching the dequantized weights" in notes[0]
    entry = diskcache.gguf_entry(path)
    assert entry.parent.parent == cache and (entry / "weights.safetensors").is_file()

    def no_read(p):
        raise AssertionError("the GGUF was read again")

    monkeypatch.setattr(gguf, "_read", no_read)
    m2, tok2, cfg2 = gguf.load_gguf(path, dtype="float32", log=notes.append)
    assert len(notes) == 1 and cfg2 == cfg1
    ids = mx.array([[1, 5, 9, 2]])
    assert mx.array_equal(m1(ids), m2(ids))
    text = "def parse_args(argv): <|im_start|> 2024"
    assert tok2.encode(text) == tok1.encode(text) and tok2.eos_token == tok1.eos_token
    assert tok2.chat_template == tok1.chat_template


def test_a_changed_gguf_gets_a_new_entry_and_a_damaged_one_is_rebuilt(cache, tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tmp_path)
    gguf.load_gguf(path, dtype="float32")
    first = diskcache.gguf_entry(path)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert diskcache.gguf_entry(path) != first
    second = diskcache.gguf_entry(path)
    (second / "weights.safetensors").parent.mkdir(parents=True)
    mx.save_safetensors(str(second / "weights.safetensors"), {"x": mx.zeros((2,))})
    (second / "info.json").write_text(json.dumps(json.loads((first / "info.json").read_text())))
    model, _, _ = gguf.load_gguf(path, dtype="float32")  # wrong tensors: rebuilt from the file
    assert model.model.layers[0].mlp.down_proj.weight.dtype == mx.float32
    assert len(mx.load(str(second / "weights.safetensors"))) > 1
    assert not first.exists()  # the entry of the file as it was is gone


def test_caching_off_or_unwritable_loads_all_the_same(cache, tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tmp_path)
    monkeypatch.setenv("DFLASH_CACHE", "0")
    gguf.load_gguf(path, dtype="float32")
    assert not cache.exists()
    monkeypatch.delenv("DFLASH_CACHE")
    cache.write_text("a file where the folder should be")
    _model, tok, _ = gguf.load_gguf(path, dtype="float32")
    assert tok.encode("hi") and cache.is_file()


def test_warm_up_costs_are_measured_once_per_pair_and_machine(cache, tiny_dir, monkeypatch):
    from dflash_mlx import generate, load
    from dflash_mlx.decoding import warmup

    target, drafter = str(tiny_dir / "qwen3"), str(tiny_dir / "d2_qwen3")
    calls = []
    real = warmup.warm_up
    monkeypatch.setattr(warmup, "warm_up", lambda m: calls.append(1) or real(m))
    # the spot check of a stored table agrees (timings on a shared CPU would make it a coin)
    monkeypatch.setattr(warmup, "disagreement", lambda *a: None)
    m1, tok = load(target, drafter=drafter, warmup=True)
    m2, _ = load(target, drafter=drafter, warmup=True)
    assert len(calls) == 1 and m2.tuning.measured.seconds == m1.tuning.measured.seconds
    assert [t.seconds for t in m2.tuning.long] == [t.seconds for t in m1.tuning.long]
    prompt = "def parse_args("
    assert generate(m2, tok, prompt, max_tokens=12) == generate(m1, tok, prompt, max_tokens=12)
    stored = next((cache / "costs").glob("*/costs.json"))
    data = json.loads(stored.read_text())
    data["measured"] -= diskcache.COSTS_MAX_AGE + 1  # a week old: measured afresh
    stored.write_text(json.dumps(data))
    load(target, drafter=drafter, warmup=True)
    stored.write_text("{ not json")
    load(target, drafter=drafter, warmup=True)
    assert len(calls) == 3 and json.loads(stored.read_text())["seconds"]


def test_the_cli_says_once_that_it_builds_the_cache(cache, tmp_path):
    import subprocess
    import sys

    from cli_helpers import REPO_ROOT, cli_env

    from dflash_mlx.model.checkpoint import drafter_config, random_drafter, save_drafter

    path = tmp_path / "tiny.gguf"
    arrays, _ = write_tiny_gguf(path, tmp_path)
    vocab = arrays["token_embd.weight"].shape[0]
    cfg = drafter_config(
        hidden_size=32,
        vocab_size=vocab,
        num_target_layers=2,
        target_layer_ids=[0, 1],
        mask_token_id=0,
        block_size=4,
        selector_rank=8,
    )
    drafter = save_drafter(tmp_path / "drafter", random_drafter(cfg), cfg)
    args = [sys.executable, "-m", "dflash_mlx.cli", "run", "--model", str(path)]
    args += ["--drafter", str(drafter), "-m", "2", "hi"]
    env = cli_env(DFLASH_CACHE_DIR=cache)
    built = Path(SESSION_CACHE) / "cpu"  # the CPU kernels: not what this test is about
    if SESSION_CACHE and built.is_dir():
        shutil.copytree(built, cache / "cpu", dirs_exist_ok=True)
    errs = []
    for _ in range(2):
        p = subprocess.run(
            args, capture_output=True, env=env, cwd=REPO_ROOT, text=True, check=False
        )
        assert p.returncode == 0, p.stderr
        errs.append(p.stderr)
    assert "note: caching the dequantized weights" in errs[0], errs[0]
    assert "caching" not in errs[1]
