"""The CPU backend's softmax and log-sum-exp (powers of 2) equal MLX's own."""

import mlx.core as mx
import pytest

from dflash_mlx.cpu import fastmath


@pytest.mark.parametrize("shape,scale", [((9, 4099), 3.0), ((2, 3, 17), 30.0), ((5,), 1e-3)])
def test_softmax_and_logsumexp_equal_mlx(shape, scale):
    x = mx.random.normal(shape, key=mx.random.key(1)) * scale
    x = mx.where(mx.random.uniform(shape=shape, key=mx.random.key(2)) < 0.2, -mx.inf, x)
    x = mx.concatenate([mx.zeros(shape[:-1] + (1,)), x], axis=-1)  # every row has a finite entry
    with mx.stream(mx.cpu):
        p, lse = fastmath.softmax(x), fastmath.logsumexp(x)
    ref = mx.softmax(x, axis=-1, precise=True)
    assert mx.allclose(p, ref, rtol=1e-5, atol=1e-7).item()
    assert (mx.where(x == -mx.inf, p, 0.0) == 0).all().item()  # masked entries get 0
    assert mx.allclose(p.sum(-1), mx.ones(shape[:-1]), atol=1e-5).item()
    assert mx.allclose(lse, mx.logsumexp(x, axis=-1, keepdims=True), rtol=1e-6).item()
