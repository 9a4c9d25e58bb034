"""The link test hook (``distributed/link.py``): it counts every collective a sharded
forward issues (two all-reduces a layer under tensor parallelism, as the roofline counts
them) and puts its delay in series with the compute; off, MLX's own collectives are back."""

import time

import mlx.core as mx
import pytest

from dflash_mlx.distributed import link


@pytest.fixture
def hook():
    link.counts.clear()
    yield link
    link.uninstall()
    link.counts.clear()


def test_a_tensor_sharded_forward_issues_two_all_reduces_a_layer(hook, tiny_dir):
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    target, _ = load_model(tiny_dir / "qwen3")  # as mlx-lm loads it, before our wrappers
    one = mx.distributed.init()  # a group of one: mlx-lm's sharded layers still all_sum
    target.shard(one)
    hook.install()
    mx.eval(target(mx.array([[1, 2, 3]]), cache=make_prompt_cache(target)))
    assert hook.counts == {"all_sum": 2 * len(target.layers)}


def test_the_delay_is_paid_once_per_collective_and_the_hook_comes_off(hook, monkeypatch):
    original = mx.distributed.all_sum
    monkeypatch.setenv(link.ENV_DELAY, "20")
    assert hook.delay_from_env() == pytest.approx(0.02)
    hook.install(hook.delay_from_env())
    x, t = mx.ones((4,)), time.perf_counter()
    for _ in range(5):
        x = mx.distributed.all_sum(x * 2)
    mx.eval(x)
    assert time.perf_counter() - t >= 5 * 0.02 and hook.counts["all_sum"] == 5
    assert x.tolist() == [32.0] * 4  # the collectives themselves unchanged
    hook.uninstall()
    assert mx.distributed.all_sum is original
    monkeypatch.setenv(link.ENV_DELAY, "-1")
    with pytest.raises(ValueError, match="milliseconds >= 0"):
        hook.delay_from_env()
