"""Tape rollback of Gated DeltaNet mixers (model/tape.py): the taped forward gives the
mixer's own bits, and a rollback from the tape gives the states of feeding the kept steps
one at a time; unknown mixers are replayed."""

from dataclasses import replace

import mlx.core as mx
import pytest
from mlx_lm.models import qwen3_5, qwen3_next
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.gated_delta import compute_g, gated_delta_ops
from tiny_models import target_config

from dflash_mlx.model import tape
from dflash_mlx.model.target import TargetAdapter

IDS = mx.array([[5, 17, 3, 99, 42, 7, 11, 64, 2, 8, 9, 10, 33, 44]])
PROMPT, FED = 6, 8  # a prefill of 6 tokens, then a verify of 8


def _mixer(kind: str):
    """A tiny random mixer of mlx-lm's qwen3_5 or qwen3_next class."""
    cfg = target_config(kind, 64)
    mx.random.seed(3)
    if kind == "qwen3_5":
        return qwen3_5.GatedDeltaNet(qwen3_5.TextModelArgs.from_dict(cfg))
    return qwen3_next.Qwen3NextGatedDeltaNet(qwen3_next.ModelArgs.from_dict(cfg))


def _equal(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and mx.array_equal(a, b).item()


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_taped_forward_gives_the_mixers_own_outputs_and_states(kind):
    m = _mixer(kind)
    assert tape.known(m)
    x = mx.random.normal((1, 9, 64), key=mx.random.key(0))
    mine, theirs = ArraysCache(2), ArraysCache(2)
    for rows in (x[:, :5], x[:, 5:6], x[:, 6:]):  # prefill, one step, a verify of 3
        out, t = tape.forward(m, rows, None, mine)
        assert _equal(out, m(rows, None, theirs))
        assert all(_equal(a, b) for a, b in zip(mine.cache, theirs.cache))
    assert t.q.shape[1] == 3 and t.conv_input.shape[1] == 3 + m.conv_kernel_size - 1


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("heads", [(2, 4), (2, 2)])
def test_own_recurrence_gives_mlx_lms_state_bit_for_bit(dtype, heads):
    """``_steps`` (the rollback's recurrence off the Metal kernel) against mlx-lm's
    op-by-op ``gated_delta_ops`` fed one step at a time, GQA-style heads included."""
    hk, hv = heads
    ks = mx.random.split(mx.random.key(4), 6)
    q = mx.random.normal((1, 7, hk, 16), key=ks[0]).astype(dtype)
    k = (0.3 * mx.random.normal((1, 7, hk, 16), key=ks[1])).astype(dtype)
    v = mx.random.normal((1, 7, hv, 16), key=ks[2]).astype(dtype)
    g = compute_g(mx.zeros(hv), mx.random.normal((1, 7, hv), key=ks[3]).astype(dtype), 1.0)
    beta = mx.sigmoid(mx.random.normal((1, 7, hv), key=ks[4]).astype(dtype))
    state = want = mx.random.normal((1, hv, 16, 16), key=ks[5])
    for t in range(7):
        s = slice(t, t + 1)
        want = gated_delta_ops(q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s], want)[1]
    assert _equal(tape._compiled_steps(k, v, g, beta, state), want)
    assert _equal(tape._steps(k, v, g, beta, state), want)


def test_a_recurrence_that_differs_on_the_probe_is_not_used(monkeypatch):
    """If ``_steps`` stopped giving mlx-lm's bits, the probe sees it and the rollback calls
    mlx-lm's ``gated_delta_update`` instead (a wrong gate stands in for the change)."""
    monkeypatch.setattr(
        tape, "_compiled_steps", lambda k, v, g, b, s: tape._steps(k, v, g, b, s * 1.5)
    )
    monkeypatch.setattr(tape, "_checked", {})
    m = _mixer("qwen3_5")
    assert tape.known(m) and not tape.own_steps(m)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("keep", [0, 1, 3, 4])
@pytest.mark.parametrize("own", [True, False, "recorded"])
def test_rewind_equals_feeding_the_kept_steps_one_at_a_time(kind, keep, own):
    """From the states the verify kept (``recorded``), or by running the recurrence again
    (``_steps``, or mlx-lm's as on the Metal kernel path)."""
    m = _mixer(kind)
    x = mx.random.normal((1, 9, 64), key=mx.random.key(1))
    taped, single = ArraysCache(2), ArraysCache(2)
    tape.forward(m, x[:, :4], None, taped)
    m(x[:, :4], None, single)
    snap = list(taped.cache)
    _, t = tape.forward(m, x[:, 4:], None, taped)  # a verify of 5 steps
    assert t.states is not None and len(t.states) == 5  # off the Metal kernel: recorded
    if own != "recorded":
        t = replace(t, states=None)
    tape.rewind(m, t, taped, snap, keep, own is not False)
    for i in range(keep):
        m(x[:, 4 + i : 5 + i], None, single)
    assert all(_equal(a, b) for a, b in zip(taped.cache, single.cache))


def _verify_and_roll_back(adapter, keep, taped=True):
    """Prefill PROMPT tokens, verify FED more, roll back to keep: the recurrent states, and
    each recurrent layer's inputs of the verify and its snapshot."""
    recs = [r for r in adapter.recorders if r is not None]
    for r in recs:
        object.__setattr__(r, "_taped", taped)
    cache = adapter.make_cache()
    adapter(IDS[:, :PROMPT], cache)
    snap = adapter.snapshot(cache)
    adapter(IDS[:, PROMPT : PROMPT + FED], cache)
    inputs = [r._last[0] if isinstance(r._last, tuple) else None for r in recs]
    adapter.rollback(cache, FED, keep, snap)
    snaps = [s for s in snap if s is not None]
    states = [list(c.cache) for c in cache if isinstance(c, ArraysCache)]
    mx.eval(states)
    for r in recs:
        object.__setattr__(r, "_taped", tape.known(r.inner))
    return states, inputs, snaps


@pytest.mark.parametrize("keep", [1, 3, 7])
def test_adapter_rollback_from_the_tape_equals_the_layers_fed_one_step_at_a_time(pairs, keep):
    """Per recurrent layer of a tiny qwen3_5 target: the tape's rollback state is, bit for
    bit, the mixer's own state after its kept inputs fed one at a time from the snapshot,
    and the whole model's states are the replay's bits."""
    adapter = pairs("qwen3_5", "d2")[0].adapter
    assert all(r._taped for r in adapter.recorders if r is not None)
    replayed, inputs, snaps = _verify_and_roll_back(adapter, keep, taped=False)
    taped, none, _ = _verify_and_roll_back(adapter, keep)
    assert none == [None] * len(none)  # a taped verify keeps no layer inputs
    recs = [r for r in adapter.recorders if r is not None]
    for rec, x, snap, got, again in zip(recs, inputs, snaps, taped, replayed):
        single = ArraysCache(2)
        single.cache = list(snap)
        for i in range(keep):
            rec.inner(x[:, i : i + 1], None, single)
        assert all(_equal(a, b) for a, b in zip(got, single.cache))
        assert all(_equal(a, b) for a, b in zip(got, again))


def test_first_recurrent_layer_after_rollback_equals_feeding_the_tokens_one_at_a_time(pairs):
    """Layer 0 reads the embeddings, so its state after a rollback to 3 of 8 steps is that
    of the unwrapped target fed those 3 tokens one at a time, bit for bit."""
    model = pairs("qwen3_5", "d2")[0]
    adapter = model.adapter
    states = _verify_and_roll_back(adapter, 3)[0]
    cache = adapter.make_cache()
    adapter(IDS[:, :PROMPT], cache)
    for i in range(3):
        adapter(IDS[:, PROMPT + i : PROMPT + i + 1], cache)
    assert all(_equal(a, b) for a, b in zip(states[0], cache[0].cache))


class _Unknown(qwen3_5.GatedDeltaNet):
    """A mixer class the tape does not know (another module, another name)."""


def test_unknown_mixer_is_replayed_with_the_same_result(tiny_dir):
    """A mixer class outside the tape's table keeps the replay; its rollback state equals
    the taped mixer's bit for bit."""
    from mlx_lm.utils import load_model

    results = []
    for unknown in (False, True):
        target = load_model(tiny_dir / "qwen3_5")[0]
        if unknown:
            for layer in target.model.layers:
                if getattr(layer, "linear_attn", None) is not None:
                    layer.linear_attn.__class__ = _Unknown
        adapter = TargetAdapter(target, [0, 2])
        assert [r._taped for r in adapter.recorders if r is not None] == [not unknown] * 2
        cache = adapter.make_cache()
        adapter(IDS[:, :PROMPT], cache)
        snap = adapter.snapshot(cache)
        adapter(IDS[:, PROMPT : PROMPT + FED], cache)
        kinds = {type(r._last).__name__ for r in adapter.recorders if r is not None}
        assert kinds == ({"tuple"} if unknown else {"Tape"})
        adapter.rollback(cache, FED, 2, snap)
        results.append([x for c in cache if isinstance(c, ArraysCache) for x in c.cache])
    assert all(_equal(a, b) for a, b in zip(*results))


def test_a_mixer_whose_taped_forward_differs_on_the_probe_is_not_taped(monkeypatch):
    """If mlx-lm's mixer changed so the taped forward no longer gives its bits, the probe
    sees it and the mixer is replayed (a gate and beta swapped stand in for the change)."""

    def swapped(m, x):
        qkv, z, b, a = tape._front_qwen3_5(m, x)
        return qkv, z, a, b

    key = ("mlx_lm.models.qwen3_5", "GatedDeltaNet")
    monkeypatch.setitem(tape._FRONTS, key, swapped)
    monkeypatch.setattr(tape, "_checked", {})
    assert not tape.known(_mixer("qwen3_5"))
    monkeypatch.setitem(tape._FRONTS, key, tape._front_qwen3_5)
    monkeypatch.setattr(tape, "_checked", {})
    assert tape.known(_mixer("qwen3_5"))


def test_only_the_forward_after_a_snapshot_records(pairs):
    """A prefill or plain step keeps nothing for a rollback (a prefill chunk's tape would
    hold megabytes per layer); the forward right after ``snapshot`` does, once."""
    adapter = pairs("qwen3_5", "d2")[0].adapter
    recs = [r for r in adapter.recorders if r is not None]
    cache = adapter.make_cache()
    adapter(IDS[:, :PROMPT], cache)
    assert all(r._last is None for r in recs)
    adapter.snapshot(cache, arm=False)  # the prefill's checkpoint
    adapter(IDS[:, PROMPT : PROMPT + 1], cache)
    assert all(r._last is None for r in recs)
    adapter.snapshot(cache)
    adapter(IDS[:, PROMPT + 1 : PROMPT + 4], cache)
    assert all(isinstance(r._last, tape.Tape) for r in recs)
    adapter(IDS[:, PROMPT + 4 : PROMPT + 5], cache)
    assert all(r._last is None for r in recs)


def test_sampled_decoding_draws_the_same_tokens_with_the_tape_as_with_the_replay(pairs):
    """The rolled-back states are the replay's bits, so a sampled decode with the same seed
    draws the same tokens and accepts the same drafts either way."""
    from dflash_mlx import generate

    model, tok = pairs("qwen3_5", "d2")
    recs = [r for r in model.adapter.recorders if r is not None]
    texts = []
    try:
        for taped in (True, False):
            for r in recs:
                object.__setattr__(r, "_taped", taped)
            kw = {"max_tokens": 40, "temperature": 0.8, "seed": 3, "block_size": 8}
            texts.append(generate(model, tok, "import os\nfor i in", **kw))
    finally:
        for r in recs:
            object.__setattr__(r, "_taped", tape.known(r.inner))
    assert texts[0] == texts[1] and len(texts[0]) > 0


def test_qwen3_next_target_decodes_greedily_as_mlx_lm_with_the_tape(tmp_path):
    """A tiny qwen3_next target (fused projections): its mixers are taped, and greedy
    decoding with partial acceptances gives mlx-lm's tokens."""
    from references import reference, run
    from tiny_models import build_drafter, build_target

    from dflash_mlx import load

    build_target(tmp_path / "t", "qwen3_next")
    build_drafter(tmp_path / "d", tmp_path / "t", block_size=8)
    model, tok = load(str(tmp_path / "t"), drafter=str(tmp_path / "d"))
    assert [r._taped for r in model.adapter.recorders if r is not None] == [True, True]
    ids = tok.encode("import os\nfor i in")
    out = run(model, ids, 24, 8)[0]
    assert out == reference(model, ids, len(out))
