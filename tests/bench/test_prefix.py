"""dflash bench prefills each prompt once and decodes every method from a copy of it."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from dflash_mlx.bench import runner
from dflash_mlx.bench.prefix import copied, prefilled
from dflash_mlx.bench.runner import PromptResult, run_bench
from dflash_mlx.decoding.acceptance import SamplingParams
from dflash_mlx.decoding.loop import DecodeOptions, decode
from dflash_mlx.decoding.warmup import ensure
from dflash_mlx.model.wrapper import Wrapper as _Wrapper


class _Rows(_Wrapper):
    """Counts the rows a target layer runs (an instance wrapper, as ``target._Tap``)."""

    def __init__(self, inner):
        super().__init__(inner)
        object.__setattr__(self, "rows", 0)

    def __call__(self, x, *args, **kwargs):
        object.__setattr__(self, "rows", self.rows + x.shape[1])
        return self.inner(x, *args, **kwargs)


def _long_prompt(tok, n):
    ids = tok.encode("def parse_args(argv):\n    return argv\n" * 40)
    return tok.decode(ids[:n])


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_each_prompt_runs_through_the_target_once_and_methods_keep_parity(pairs, kind):
    model, tok = pairs(kind, "d2")
    text = _long_prompt(tok, 300)
    n_prompt = len(tok.encode(text))
    ensure(model)  # the warm-up's own forwards (once per pair) are not the bench's
    layers = model.adapter.inner.layers
    counter = layers[-1] = _Rows(layers[-1])
    try:
        rep = run_bench(model, tok, [text], max_tokens=8, block_size=4, raw=True)
    finally:
        layers[-1] = counter.inner
    # five methods and the recall pass prefilling their own prompt would run ~6 x 300 rows
    assert n_prompt - 1 <= counter.rows < 2 * n_prompt, (counter.rows, n_prompt)
    for method, row in rep["parity"]["prompts"][0].items():
        assert row["identical"], (method, row)


def test_a_copy_is_independent_of_the_prefix_it_came_from(pairs):
    model, tok = pairs("qwen3_5", "d2")  # a hybrid: recurrent states are lists of arrays
    ids = tok.encode(_long_prompt(tok, 120))
    prefix = prefilled(model, ids)
    before = [np.array(a) for a in _arrays(prefix)]

    def run():
        opts = DecodeOptions(max_tokens=12, block_size=4, key=mx.random.key(0))
        out = []
        for c in decode(model, ids, copied(prefix), SamplingParams(0.0), opts):
            out += c.tokens
        return out

    first, second = run(), run()
    assert first == second
    assert len(prefix.tokens) == len(ids) - 1
    for a, b in zip(before, _arrays(prefix), strict=True):
        assert np.array_equal(a, np.array(b))
    fresh = []
    opts = DecodeOptions(max_tokens=12, block_size=4, key=mx.random.key(0))
    for c in decode(model, ids, model.make_cache(), SamplingParams(0.0), opts):
        fresh += c.tokens
    assert first == fresh  # from the shared prefix, as from a prefill of its own


def _arrays(cache):
    out = []
    for c in cache.target:
        out += [a for _, a in tree_flatten(c.state) if isinstance(a, mx.array)]
    for c in cache.drafter:
        out += [a for a in c.held() if a is not None]
    return out


def test_recall_from_the_prefix_equals_running_the_whole_sequence(pairs, monkeypatch):
    model, tok = pairs("qwen3", "d2")
    ids = tok.encode(_long_prompt(tok, 200))
    model.drafter.args.selector_top_k = 128  # wide enough that hits are not all zero
    try:
        whole, shared = PromptResult(), PromptResult()
        runner._autoregressive(model, ids, 16, 0.0, 0, whole)
        shared.continuation = whole.continuation
        runner._recall(model, ids, 4, 128, whole)
        runner._recall(model, ids, 4, 128, shared, prefix=prefilled(model, ids))
    finally:
        model.drafter.args.selector_top_k = 16
    assert whole.anchors == shared.anchors > 0
    for k in ("1", "128"):
        assert shared.recall[k].tolist() == whole.recall[k].tolist()
    assert whole.recall["128"].sum() > 0


def test_the_forecast_grows_with_the_prompts_and_the_methods():
    from dflash_mlx.bench.prefix import forecast

    timed = ((0.5, 0.01), (0.9, 0.02))  # fixed timings: the arithmetic, not the clock
    one = forecast(timed, [300], 8, 3)
    assert 0 < one < forecast(timed, [300, 300], 8, 3)
    assert one < forecast(timed, [300], 8, 6)
    assert forecast(timed, [100, 300], 8, 3) < forecast(timed, [300, 300], 8, 3)


def test_the_timed_forecast_is_positive(pairs):
    from dflash_mlx.bench.prefix import expected_seconds

    model, _ = pairs("qwen3", "d2")
    assert expected_seconds(model, [300], 8, 3) > 0


def test_a_long_bench_says_its_size_and_expected_time_first(tiny_dir):
    from typer.testing import CliRunner

    from dflash_mlx.cli import app

    model = ["--model", str(tiny_dir / "qwen3"), "--drafter", str(tiny_dir / "d2_qwen3")]
    args = ["-n", "2", "-m", "8", "--block-size", "4", "--context", "1100", "--no-lookup"]
    res = CliRunner().invoke(app, ["bench", *model, *args])
    assert res.exit_code == 0, res.output
    notes = [line for line in res.stderr.splitlines() if line.startswith("note: 2 prompts")]
    assert len(notes) == 1 and "2,200 tokens in all" in notes[0] and "expected about" in notes[0]
