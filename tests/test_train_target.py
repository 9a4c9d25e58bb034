"""Smoke test of the demo-target trainer: tiny model, tiny corpus, seconds on a CPU."""

import json

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("tokenizers")

from dflash_mlx import corpus
from dflash_mlx.train_target import SMOKE_CONFIG, train


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    return corpus.build_corpus(tmp_path_factory.mktemp("corpus"), limit=12)


def test_corpus_split_is_deterministic(corpus_dir):
    meta = corpus.load_meta(corpus_dir)
    assert meta["n_heldout_files"] >= 1 and meta["n_train_files"] >= 1
    assert corpus.is_heldout("os.py") == corpus.is_heldout("os.py")
    files = corpus.collect_files()
    assert not any(f.startswith("test/") or "/idle_test/" in f for f in files)
    held = corpus.load_split(corpus_dir, "heldout")
    assert held.main.dtype == np.uint16 and held.main[-1] == meta["eos_id"]


def test_train_loss_drops_saves_and_resumes(tmp_path, corpus_dir):
    import mlx_lm

    pattern = np.arange(40, 72, dtype=np.uint16)
    data = np.tile(pattern, 300)
    out = tmp_path / "tgt"
    kw = {
        "config": SMOKE_CONFIG,
        "batch": 4,
        "seq": 32,
        "lr": 1e-2,
        "warmup": 5,
        "minutes": 5.0,
        "eval_windows": 2,
        "corpus_dir": corpus_dir,
        "train_tokens": data,
        "quiet": True,
    }
    first = train(out, steps=30, **kw)
    losses = first["losses"]
    assert len(losses) == 30 and first["step"] == 30
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])

    model, tok = mlx_lm.load(str(out))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["tie_word_embeddings"]
    assert tok.eos_token_id == 0
    x = mx.array(pattern[None, :16].astype(np.int32))
    pred = mx.argmax(model(x), axis=-1)[0].tolist()
    assert sum(p == t for p, t in zip(pred[:-1], pattern[1:16].tolist())) >= 12

    again = train(out, steps=40, resume=True, **kw)
    assert again["step"] == 40 and len(again["losses"]) == 10
    assert np.mean(again["losses"]) < np.mean(losses[:5])
