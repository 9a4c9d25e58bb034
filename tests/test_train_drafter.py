"""Smoke tests of the drafter trainer: tiny target, tiny drafter, seconds on a CPU."""

import json

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("tokenizers")

from dflash_mlx import corpus
from dflash_mlx.checkpoint import drafter_config, load_drafter, random_drafter
from dflash_mlx.train_common import make_blocks, target_pass
from dflash_mlx.train_drafter import selector_scores, train
from dflash_mlx.train_target import SMOKE_CONFIG
from dflash_mlx.train_target import train as train_target

TINY = {
    "num_hidden_layers": 1,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "selector_rank": 8,
    "block_size": 4,
}
PATTERN = np.arange(40, 72, dtype=np.uint16)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    cdir = corpus.build_corpus(tmp_path_factory.mktemp("corpus"), limit=12)
    out = tmp_path_factory.mktemp("target")
    train_target(
        out,
        steps=40,
        config=SMOKE_CONFIG,
        batch=4,
        seq=32,
        lr=1e-2,
        warmup=5,
        eval_windows=1,
        corpus_dir=cdir,
        train_tokens=np.tile(PATTERN, 100),
        quiet=True,
    )
    return out


def _load(path):
    import mlx_lm

    return mlx_lm.load(str(path))[0]


def test_batched_blocks_match_inference_path(tiny_target):
    target = _load(tiny_target)
    cfg = drafter_config(
        hidden_size=32,
        vocab_size=4096,
        num_target_layers=2,
        target_layer_ids=[0, 1],
        mask_token_id=1,
        sliding_window=8,
        **{k: v for k, v in TINY.items() if k != "block_size"},
    )
    d = random_drafter(cfg, seed=3)
    x = np.random.default_rng(0).integers(3, 4000, (2, 24)).astype(np.int32)
    feats, greedy = target_pass(target, mx.array(x), [0, 1])
    blk = make_blocks(x, np.array(greedy), 3, 8, 1, np.random.default_rng(1), 8)
    ids = mx.array(blk["ids"])
    kv = [
        (mx.repeat(k, 3, 0), mx.repeat(v, 3, 0))
        for k, v in d.context_kv(d.project_context(feats), 0)
    ]
    emb = target.model.embed_tokens(ids)
    h = d(emb, kv, mx.array(blk["offsets"]), 8, mx.array(blk["mask"]))
    for n in range(6):
        a = int(blk["offsets"][n])
        cache = d.make_cache()
        d.append_context(feats[n // 3 : n // 3 + 1, :a], cache)
        ref = d.step(emb[n : n + 1], cache)[0]
        assert mx.allclose(ref, h[n], atol=1e-5).item()
        assert blk["labels"][n].tolist() == np.array(greedy)[n // 3, a : a + 7].tolist()


def test_selector_scores_insert_gold():
    cfg = drafter_config(
        hidden_size=32,
        vocab_size=64,
        num_target_layers=2,
        target_layer_ids=[0, 1],
        mask_token_id=1,
        selector_top_k=4,
        **{k: v for k, v in TINY.items() if k != "block_size"},
    )
    d = random_drafter(cfg, seed=0, scale=0.0)  # zero codebooks: S = U
    logits = mx.random.normal((2, 3, 64))
    labels = mx.argmin(logits, axis=-1).astype(mx.int32)  # never in the top-4
    scores, idx = selector_scores(
        d, logits, mx.random.normal((2, 3, 32)), mx.array([5, 6], dtype=mx.int32), labels
    )
    assert (idx == 3).all().item()
    gold = mx.take_along_axis(logits, labels[..., None], -1)[..., 0]
    assert mx.allclose(scores[..., 3], gold).item()
    top = mx.sort(logits, axis=-1)[..., ::-1][..., :3]
    assert mx.allclose(scores[..., :3], top).item()


def test_train_drafter_learns_saves_and_resumes(tmp_path, tiny_target):
    data = np.tile(PATTERN, 300)
    out = tmp_path / "drafter"
    kw = {
        "drafter_kw": TINY,
        "batch": 4,
        "seq": 64,
        "n_blocks": 4,
        "lr": 1e-2,
        "warmup": 5,
        "minutes": 5.0,
        "eval_windows": 4,
        "train_tokens": data,
        "heldout_tokens": data[:1000],
        "quiet": True,
    }
    first = train(tiny_target, out, steps=60, **kw)
    losses = np.array(first["losses"])
    assert len(losses) == 60
    assert losses[-5:, 1].mean() < 0.5 * losses[:5, 1].mean()
    ev = first["final"]
    assert ev["tau_argmax"] > 1.5 and ev["tau_oracle"] >= ev["tau_selector"] > 1.5

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    assert cfg["dflash_config"]["mask_token_id"] == 1
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 1]
    drafter = load_drafter(out)
    assert drafter.args.block_size == 4
    stored = mx.load(str(out / "model.safetensors"))
    assert all(v.dtype == mx.bfloat16 for v in stored.values())
    assert "candidate_selector.successor_codebook" in stored

    again = train(tiny_target, out, steps=70, resume=True, **kw)
    assert again["step"] == 70 and len(again["losses"]) == 10
