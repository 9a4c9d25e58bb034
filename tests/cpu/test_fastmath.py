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


@pytest.mark.parametrize("heads,kv_heads,rows", [(4, 2, 1), (9, 3, 300), (4, 4, 37)])
def test_cpu_attention_equals_the_fused_kernel(heads, kv_heads, rows):
    k0, k1, k2 = mx.random.split(mx.random.key(3), 3)
    q = mx.random.normal((1, heads, 8, 16), key=k0)
    k = mx.random.normal((1, kv_heads, rows + 8, 16), key=k1)
    v = mx.random.normal((1, kv_heads, rows + 8, 16), key=k2)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25)
    with mx.stream(mx.cpu):
        out = fastmath.attention(q, k, v, 0.25)
    assert mx.allclose(out, ref, atol=1e-5).item()
