"""The selector's CPU twin (select_host.py) against its MLX definition (selector.py)."""

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import ops
from dflash_mlx.cpu import select_host
from dflash_mlx.model import selector
from dflash_mlx.model.selector import PathSelector

pytestmark = pytest.mark.skipif(
    not select_host.enabled(), reason="the selector's C twin is built with the few-row kernel"
)


@pytest.mark.parametrize("V", [50, 96, 8192, 49152])
def test_top_candidates_equal_a_full_sort_and_ties_go_to_the_lower_id(V):
    """With zero codebooks S = U, so the candidates are the top-K alone: those of a stable
    full sort (the MLX definition's, without ties), and with ties the lower ids first."""
    sel = make_selector(V, R=8)
    sel.predecessor_codebook = mx.zeros((V, 8))
    sel.successor_codebook = mx.zeros((V, 8))
    rng = np.random.default_rng(V)
    for x in (rng.standard_normal((2, 7, V)), np.round(rng.standard_normal((2, 7, V)))):
        x = x.astype(np.float32)
        _, cand, _, path = sel(mx.array(x), mx.zeros((2, 7, 32)), mx.array([1, 2]), 16)
        order = np.argsort(-x, axis=-1, kind="stable")[..., :16]
        assert np.array_equal(np.array(cand), order)
        assert not np.array(path).any()  # S = U: the best candidate
    x = rng.standard_normal((1, 7, V)).astype(np.float32)
    _, ref = selector.top_candidates(mx.array(x), 16)  # the MLX definition
    _, cand, _, _ = sel(mx.array(x), mx.zeros((1, 7, 32)), mx.array([1]), 16)
    assert np.array_equal(np.array(cand), np.array(ref))


def make_selector(V=300, H=32, R=24, seed=5):
    mx.random.seed(seed)
    sel = PathSelector(H, rank=R, vocab_size=V)
    sel.predecessor_codebook = 0.5 * mx.random.normal((V, R))
    sel.successor_codebook = 0.5 * mx.random.normal((V, R))
    return sel


def _host(codebook) -> bool:
    """Whether the selector runs on the host for this codebook (``ops.host_selector``)."""
    return ops.host_selector(16, codebook.shape[-1], codebook.dtype) is not None


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
@pytest.mark.parametrize("subset", [False, True])
def test_host_selector_equals_the_mlx_ops(monkeypatch, temperature, subset):
    """Tokens, candidates, path and proposal rows of the host twin equal the MLX ops'
    (greedy and sampled, with and without a draft vocabulary's id map)."""
    V, L, B = 300, 7, 2
    sel = make_selector(V)
    n = 96 if subset else V
    ids = mx.array(np.sort(np.random.default_rng(1).choice(V, n, replace=False)).astype(np.int32))
    logits, hidden = 2 * mx.random.normal((B, L, n)), mx.random.normal((B, L, 32))
    anchor = mx.array([3, 250])
    u = None if temperature == 0 else mx.random.uniform(shape=(B, L), key=mx.random.key(2))
    to_target = ids if subset else None
    assert _host(sel.predecessor_codebook)
    host = sel(logits, hidden, anchor, 16, temperature, u, to_target)
    monkeypatch.setenv(select_host.ENV, "0")
    assert not _host(sel.predecessor_codebook)
    ops = sel(logits, hidden, anchor, 16, temperature, u, to_target)
    for name, a, b in zip(("tokens", "cand", "q", "path"), host, ops):
        if b is None:
            assert a is None
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, name
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6, err_msg=name)
    if subset:
        assert np.isin(np.array(host[0]), np.array(ids)).all()


def test_host_samples_are_the_inverse_cdf_of_their_own_proposal_rows():
    """Lossless sampling needs the draw to follow the q returned: each chosen index is
    the first whose cumulative q exceeds the row's uniform."""
    sel = make_selector()
    logits, hidden = 2 * mx.random.normal((1, 7, 300)), mx.random.normal((1, 7, 32))
    u = mx.random.uniform(shape=(1, 7), key=mx.random.key(8))
    _, _, q, path = sel(logits, hidden, mx.array([4]), 16, 0.9, u)
    cdf = np.cumsum(np.array(q)[0], axis=-1)
    expect = np.minimum((cdf <= np.array(u)[0][:, None]).sum(-1), 15)
    assert np.array_equal(np.array(path)[0], expect)
    assert np.allclose(np.array(q).sum(-1), 1, atol=1e-5)


def test_host_path_needs_float32_codebooks_and_can_be_turned_off(monkeypatch):
    assert _host(mx.zeros((4, 2)))
    assert not _host(mx.zeros((4, 2), mx.bfloat16))
    monkeypatch.setenv(select_host.ENV, "0")
    assert not _host(mx.zeros((4, 2)))
