"""The drafter-training pipeline on a tiny target: prompts, self-distillation shards, batches,
training, evaluation, checkpoints and resume."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from tiny_models import build_target

from dflash_mlx.bench.prompts import CHAT, CODE
from dflash_mlx.loading.loader import load_target
from dflash_mlx.model.checkpoint import load_drafter
from dflash_mlx.train import distill
from dflash_mlx.train.data import ShardSet, build_batch
from dflash_mlx.train.drafter import TrainConfig, train
from dflash_mlx.train.prompts import build_prompts, chat_prompts, is_heldout

PROMPTS = ["def parse_args(argv):", "Explain import os.", "class Foo:", "Hello world!"] * 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    build_target(root / "t", "qwen3")
    target, tok = load_target(str(root / "t"))
    data = root / "data"
    for split in ("train", "heldout"):
        distill.run(
            target,
            tok,
            data,
            [0, 2, 3],
            split,
            max_new=10,
            batch=3,
            shard_size=6,
            prompts=PROMPTS,
            log=lambda m: None,
        )
    return root, target, tok, data


# A one-layer drafter for the tiny target (block 4).
TINY_SHAPE = {
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 64,
    "block_size": 4,
    "selector_rank": 8,
    "mask_token_id": 1,
}


def test_training_prompts_are_split_deterministically_and_exclude_the_bench_prompts():
    chat = chat_prompts()
    assert len(chat) > 1000 and len(set(chat)) == len(chat)
    assert all(is_heldout(p) == is_heldout(p) for p in chat[:50])
    train_set = set(build_prompts("train"))
    held = set(build_prompts("heldout"))
    assert train_set and held and not train_set & held
    assert not (set(CODE) | set(CHAT)) & (train_set | held)


def test_distilled_shards_hold_the_targets_greedy_answers_and_their_features(tiny):
    _root, target, _tok, data = tiny
    shards = ShardSet(data / "train")
    assert len(shards.seqs) == len(PROMPTS)
    s = shards.seqs[0]
    tokens, teacher, feats = shards.rows(s)
    assert feats.shape == (s.n - 1, 3 * target.args.hidden_size)
    ref = [t for t, _ in generate_step(mx.array(tokens[: s.prompt]), target, max_tokens=10)]
    answer = tokens[s.prompt :].tolist()
    assert answer == ref[: len(answer)]  # batched, left-padded generation = plain greedy
    assert (teacher[s.prompt - 1 :] == tokens[s.prompt :]).all()  # labels: the next token


def test_batches_label_each_row_with_the_next_answer_token_and_mask_the_end(tiny):
    _, _, _, data = tiny
    shards = ShardSet(data / "train")
    anchors = np.array([[shards.seqs[0].n - 3, shards.seqs[0].prompt]])
    blk = build_batch(shards, [0], 2, 4, 1, None, None, anchors)
    tokens, teacher, _ = shards.rows(shards.seqs[0])
    a = anchors[0]
    assert (blk["ids"][:, 0] == tokens[a]).all() and (blk["ids"][:, 1:] == 1).all()
    assert blk["labels"][0, :2].tolist() == teacher[a[0] : a[0] + 2].tolist()
    assert blk["valid"][0].tolist() == [1, 1, 0]  # the third row would be past the answer
    assert blk["labels"][1].tolist() == teacher[a[1] : a[1] + 3].tolist()
    assert blk["mask"].shape == (2, 1, 4, blk["feats"].shape[1] + 4)


def test_soft_labels_are_the_targets_top_k_at_each_label_position(tiny):
    _root, _target, _tok, data = tiny
    shards = ShardSet(data / "train")
    assert shards.has_soft
    blk = build_batch(shards, [0, 1], 3, 4, 1, np.random.default_rng(0), None, soft_k=8)
    ok = blk["valid"] > 0
    assert blk["soft_ids"].shape == blk["labels"].shape + (8,)
    assert (blk["soft_ids"][..., 0][ok] == blk["labels"][ok]).all()  # greedy = top-1
    lp = blk["soft_logp"]
    assert np.all(np.diff(lp[ok], axis=-1) <= 1e-3)  # best first
    assert np.isinf(lp[~ok]).all() and np.exp(lp[ok]).sum(-1).max() <= 1.001


def test_warm_start_reproduces_a_released_drafter_on_standardized_features(tiny):
    from dflash_mlx.train.common import init_drafter, warm_start

    root, target, _tok, data = tiny
    out = root / "warm"
    train(
        target,
        data,
        out,
        TrainConfig(steps=2, seqs=2, n_blocks=2, eval_seqs=2, warmup=1),
        shape=dict(TINY_SHAPE),
        log=lambda m: None,
    )
    released = load_drafter(out, mx.float32)
    scale = np.linspace(0.5, 3.0, 3 * target.args.hidden_size).astype(np.float32)
    fresh = init_drafter(json.loads((out / "config.json").read_text()), seed=9)
    warm_start(fresh, out, scale)
    raw = mx.array(ShardSet(data / "train").rows(ShardSet(data / "train").seqs[0])[2])[None]
    got = fresh.project_context(raw / mx.array(scale))
    assert mx.allclose(got, released.project_context(raw), atol=1e-3, rtol=1e-3)


def test_training_learns_saves_the_released_format_and_resumes(tiny):
    root, target, _tok, data = tiny
    out = root / "drafter"
    logs = []
    cfg = TrainConfig(steps=40, seqs=4, n_blocks=4, eval_seqs=4, lr=3e-3, warmup=5)
    first = train(target, data, out, cfg, shape=dict(TINY_SHAPE), log=logs.append)
    rows = [line.split() for line in logs if line.startswith("step ")]
    loss, ce, kd = ([float(r[i]) for r in rows] for i in (3, 5, 9))
    assert ce[-1] < 0.8 * ce[0]  # it learns (steps 20 and 40 are logged)
    assert loss[-1] < loss[0] and kd[-1] < kd[0] and kd[0] > 0  # distillation is on, and falls
    assert {"tau_argmax", "tau_selector", "tau_oracle"} <= set(first["final"])
    d = load_drafter(out)
    assert d.args.block_size == 4 and d.has_selector
    assert d.draft_vocab is not None and d.draft_vocab.size >= 256  # its training shortlist
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    cfg.steps = 44
    again = train(target, data, out, cfg, shape=dict(TINY_SHAPE), resume=True, log=logs.append)
    assert again["step"] == 44  # continued from step 40


def test_released_drafter_reads_raw_features_the_scale_is_folded_into_fc(tiny):
    root, target, _tok, data = tiny
    out = root / "scaled"
    cfg = TrainConfig(steps=3, seqs=2, n_blocks=2, eval_seqs=2, warmup=1)
    train(target, data, out, cfg, shape=dict(TINY_SHAPE), log=lambda m: None)
    scale = np.load(out / "train_state" / "feature_scale.npy")
    assert scale.shape == (3 * target.args.hidden_size,) and (scale > 0).all()
    released = load_drafter(out, mx.float32)
    trained = load_drafter(out, mx.float32)
    trained.load_weights(str(out / "train_state" / "weights.safetensors"))
    raw = mx.array(ShardSet(data / "train").rows(ShardSet(data / "train").seqs[0])[2])[None]
    want = trained.project_context(raw / mx.array(scale))
    got = released.project_context(raw)  # bf16 on disk: close, not equal
    assert mx.allclose(got, want, atol=0.05, rtol=0.05)


def test_committed_token_ids_rebuild_the_same_shards_by_prefill(tiny, tmp_path):
    """A later round on a fresh machine rebuilds features, teacher and top-k from the
    committed token ids alone; they must match what generation recorded."""
    from dflash_mlx.model.target import TargetAdapter
    from dflash_mlx.train import rounds

    _root, target, _tok, data = tiny
    n = rounds.export(data / "train", tmp_path / "r01.npz")
    shards = ShardSet(data / "train")
    assert n == shards.tokens  # answer tokens
    z = np.load(tmp_path / "r01.npz")
    seqs = np.split(z["tokens"], np.cumsum(z["lengths"])[:-1])
    adapter = TargetAdapter(target, [0, 2, 3])
    rebuilt = distill.featurize(adapter, seqs, batch=3)
    for s, (tokens, teacher, feats, k_ids, k_lp) in zip(shards.seqs, rebuilt):
        t0, teach0, f0 = shards.rows(s)
        i0, lp0 = shards.soft_rows(s)
        assert np.array_equal(tokens, t0)
        ans = slice(s.prompt - 1, s.n - 1)  # answer labels: the greedy answer itself
        assert np.array_equal(teacher[ans], teach0[ans])
        assert np.allclose(feats.astype(np.float32), f0, atol=2e-2, rtol=2e-2)
        assert np.array_equal(k_ids[ans, :4], i0[ans, :4])
        assert np.allclose(k_lp.astype(np.float32), lp0, atol=2e-2)


def test_ledger_rows_render_into_the_model_card_table(tmp_path, monkeypatch):
    from dflash_mlx.train import ledger

    monkeypatch.setattr(ledger, "LEDGER", tmp_path / "ledger.json")
    ev = {"tau_argmax": 1.5, "tau_selector": 1.6, "tau_oracle": 2.9}
    ledger.append({"round": 1, "new_tokens": 1200, "total_tokens": 5000, "heldout": ev})
    rows = ledger.append({"round": 0, "new_tokens": 3800, "total_tokens": 3800, "shipped": True})
    assert [r["round"] for r in rows] == [0, 1]
    card = ledger.render(rows, 8192)
    table = [line for line in card.splitlines() if line.startswith("| ")]
    assert table[-1].startswith("| 1 | 1,200 | 5,000 |") and "1.50 / 1.60 / 2.90" in table[-1]
    assert "8,192 target ids" in card and card.index("| round |") < card.index("| 0 | 3,800")


def test_a_round_warm_starts_trains_its_draft_vocab_and_reports_its_baseline(tiny):
    root, target, _tok, data = tiny
    base = root / "base"
    cfg = TrainConfig(steps=4, seqs=2, n_blocks=2, eval_seqs=4, warmup=1)
    train(target, data, base, cfg, shape=dict(TINY_SHAPE), log=lambda m: None)
    vocab = np.arange(0, 200, dtype=np.int32)
    out = root / "round"
    cfg = TrainConfig(steps=6, seqs=2, n_blocks=2, eval_seqs=4, warmup=1, lr=1e-3)
    summary = train(
        target, data, out, cfg, shape=dict(TINY_SHAPE), log=lambda m: None, init=base, vocab=vocab
    )
    first = summary["first"]
    assert first["step"] == 0 and summary["vocab"] == 200 and summary["blocks_per_s"] > 0
    assert np.array_equal(load_drafter(out).draft_vocab, vocab)
    # the baseline is the released drafter itself, scored over the same vocabulary
    from dflash_mlx.model.target import TargetAdapter
    from dflash_mlx.train.data import eval_anchors
    from dflash_mlx.train.evaluate import evaluate

    held = ShardSet(data / "heldout")
    picks, anchors = eval_anchors(held, 4, 4)
    adapter = TargetAdapter(target, load_drafter(base).args.target_layer_ids)
    ev = evaluate(load_drafter(base, mx.float32), adapter, held, picks, anchors, vocab)
    assert ev["tau_selector"] == pytest.approx(first["tau_selector"], abs=0.05)


def test_the_best_evaluation_is_kept_with_its_drafter(tiny):
    root, target, _tok, data = tiny
    out = root / "best_run"
    cfg = TrainConfig(steps=6, seqs=2, n_blocks=2, eval_seqs=4, warmup=1, eval_every_s=0.0)
    summary = train(target, data, out, cfg, shape=dict(TINY_SHAPE), log=lambda m: None)
    hist = json.loads((out / "train_state" / "state.json").read_text())["history"]
    best = max(hist, key=lambda h: h["tau_selector"])  # the first of equals
    assert summary["best"]["step"] == best["step"] and len(hist) > 2
    from dflash_mlx.model.target import TargetAdapter
    from dflash_mlx.train.data import eval_anchors
    from dflash_mlx.train.evaluate import evaluate

    held = ShardSet(data / "heldout")
    picks, anchors = eval_anchors(held, 4, 4)
    kept = load_drafter(out / "best", mx.float32)
    adapter = TargetAdapter(target, kept.args.target_layer_ids)
    ev = evaluate(kept, adapter, held, picks, anchors, load_drafter(out).draft_vocab)
    assert ev["tau_selector"] == pytest.approx(best["tau_selector"], abs=0.05)
