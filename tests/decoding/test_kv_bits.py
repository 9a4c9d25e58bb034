"""KV-cache quantization (``kv_bits``): lossless against mlx-lm decoding the target alone with
the same quantization, greedy token for token and sampled in law."""

import mlx.core as mx
import pytest
from laws import assert_law
from mlx_lm.generate import generate_step, maybe_quantize_kv_cache
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache
from scripted import Scripted
from tiny_models import build_drafter, build_target

from dflash_mlx.decoding.acceptance import SamplingParams, target_probs
from dflash_mlx.decoding.loop import DecodeOptions, decode
from dflash_mlx.decoding.state import convert_at
from dflash_mlx.errors import DFlashError
from dflash_mlx.settings import GenerationConfig, SettingError

# head_dim 32 (hidden 128): the tiny pairs' 16 is below every group size mlx-lm quantizes by
PROMPTS = ["def parse_args(", "import os\nfor i in", "The quick brown fox. " * 4, "a b"]
GROUP = 32


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """(model, tokenizer) per kind: the tiny targets with head_dim 32, and their drafters."""
    from dflash_mlx import load

    root, out = tmp_path_factory.mktemp("kv"), {}
    for kind in ("qwen3", "qwen3_5"):
        build_target(root / kind, kind, hidden=128)
        build_drafter(root / f"d_{kind}", root / kind, block_size=16)
        out[kind] = load(str(root / kind), drafter=str(root / f"d_{kind}"))
    return out


def _ours(model, ids, n, kv, block=8, tree=True, step=2048, policy=None, cache=None):
    opts = DecodeOptions(
        max_tokens=n, block_size=block, tree=tree, kv=kv, prefill_step_size=step, policy=policy
    )
    out = []
    for c in decode(model, ids, cache or model.make_cache(), SamplingParams(), opts):
        out += c.tokens
    return out[:n]


def _mlx_lm(model, ids, n, bits, start, step=2048):
    gen = generate_step(
        mx.array(ids),
        model.target,
        max_tokens=n,
        kv_bits=bits,
        kv_group_size=GROUP,
        quantized_kv_start=start,
        prefill_step_size=step,
    )
    return [t for t, _ in gen]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_quantized_attention_of_m_rows_has_each_rows_bits_alone(dtype):
    """Why greedy parity holds bit for bit on MLX's CPU backend: mlx-lm's quantized attention
    over M verify rows (causal mask, keys up to the last row) gives each row exactly the bits
    of that row decoded alone on its prefix (mask None), as mlx-lm's generate_step runs it.
    (Its ``queries *= scale`` scales the caller's array in place: each call gets a copy.)"""
    from mlx_lm.models.base import quantized_scaled_dot_product_attention as qsdpa

    mx.random.seed(0)
    h, kh, d, s, m, bits = 8, 2, 64, 300, 9, 4
    k, v = (mx.random.normal((1, kh, s, d)).astype(dtype) for _ in range(2))
    qk, qv = (mx.quantize(x, group_size=GROUP, bits=bits) for x in (k, v))
    q = mx.random.normal((1, h, m, d)).astype(dtype)
    mx.eval(q)
    kw = {"scale": d**-0.5, "group_size": GROUP, "bits": bits}
    rows = qsdpa(mx.array(q), qk, qv, mask="causal", **kw)
    for i in range(m):
        n = s - m + i + 1
        pre = [x[..., :n, :] for x in qk], [x[..., :n, :] for x in qv]
        alone = qsdpa(mx.array(q[:, :, i : i + 1]), *pre, mask=None, **kw)
        assert mx.array_equal(alone[:, :, 0], rows[:, :, i]).item(), i


def test_the_conversion_point_is_mlx_lms():
    assert convert_at(0, 10, 2048) == 9  # the first prefill chunk: all but the last token
    assert convert_at(0, 10, 4) == 4
    assert convert_at(5, 10, 4) == 8
    assert convert_at(9, 10, 4) == 9
    assert convert_at(10, 10, 4) == 10  # after the last prompt token's step
    assert convert_at(0, 1, 4) == 1  # no prefill chunk at all
    assert convert_at(30, 10, 4) == 30  # during generation: every token is a boundary


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("bits", [8, 4])
def test_greedy_matches_mlx_lm_with_the_same_kv_quantization(wide, kind, bits):
    """On every prompt, the conversion in the first prefill chunk, later in the prefill and
    during generation (where the cycle before it is shortened to end there), blocks 4 and
    16, with and without trees (hybrids: attention layers quantized, recurrent state not)."""
    model, tok = wide[kind]
    differs = False
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        for start, step in ((0, 2048), (5, 4), (len(ids) + 7, 2048)):
            ref = _mlx_lm(model, ids, 40, bits, start, step)
            differs |= ref != _mlx_lm(model, ids, 40, None, start, step)
            for block, tree in ((4, True), (16, True), (16, False)):
                got = _ours(model, ids, 40, (bits, GROUP, start), block, tree, step)
                assert got == ref, (prompt, start, step, block, tree)
        cache = model.make_cache()
        _ours(model, ids, 8, (bits, GROUP, 0), cache=cache)
        kinds = {type(c).__name__ for c in cache.target}
        assert "QuantizedKVCache" in kinds and "KVCache" not in kinds
    if kind == "qwen3_5" and bits == 4:
        assert differs  # the quantization changes the tokens here: the parity means something


@pytest.mark.parametrize("script", [[1, 5, 3], [6, 1]])
def test_plain_runs_and_cycles_around_the_conversion_match_mlx_lm(wide, script):
    model, tok = wide["qwen3_5"]
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        for start in (len(ids) + 2, len(ids) + 6):
            policy = Scripted(script, plain=3)
            got = _ours(model, ids, 30, (4, GROUP, start), None, policy=policy)
            assert got == _mlx_lm(model, ids, 30, 4, start), (prompt, start, policy.used)


def test_the_api_with_auto_blocks_matches_mlx_lm(wide):
    from dflash_mlx import stream_generate

    model, tok = wide["qwen3"]
    ids = tok.encode(PROMPTS[1])
    kw = {"kv_bits": 4, "kv_group_size": GROUP, "quantized_kv_start": len(ids) + 3}
    rs = stream_generate(model, tok, PROMPTS[1], raw=True, max_tokens=30, **kw)
    got = [t for r in rs for t in r.tokens]
    assert got == _mlx_lm(model, ids, 30, 4, kw["quantized_kv_start"])[: len(got)]
    assert len(got) > 5


def test_a_prompt_cache_quantized_otherwise_starts_over(wide):
    model, tok = wide["qwen3"]
    ids = tok.encode(PROMPTS[2])
    cache = model.make_cache()
    _ours(model, ids, 6, (8, GROUP, 0), cache=cache)
    assert all(c.bits == 8 for c in cache.target)
    _ours(model, ids, 6, (4, GROUP, 0), cache=cache)
    assert all(c.bits == 4 for c in cache.target)
    got = _ours(model, ids, 20, None, cache=cache)
    assert all(type(c).__name__ == "KVCache" for c in cache.target)
    assert got == _mlx_lm(model, ids, 20, None, 0)


def test_a_group_size_the_head_does_not_fit_is_refused(pairs):
    model, tok = pairs("qwen3", "d2")  # head_dim 16
    with pytest.raises(DFlashError, match="kv_group_size 32"):
        _ours(model, tok.encode(PROMPTS[0]), 4, (8, GROUP, 0))


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"kv_bits": 3}, "--kv-bits must be 4 or 8 (got 3)"),
        ({"kv_bits": "8"}, "--kv-bits must be an integer"),
        ({"kv_group_size": 16}, "--kv-group-size must be 32, 64 or 128 (got 16)"),
        ({"quantized_kv_start": -1}, "--quantized-kv-start must be >= 0 (got -1)"),
    ],
)
def test_settings_are_checked_by_their_flags(kw, message):
    with pytest.raises(SettingError, match=message.replace("(", r"\(").replace(")", r"\)")):
        GenerationConfig(**kw).validate(flags=True)
    assert GenerationConfig(kv_bits=4, kv_group_size=128, quantized_kv_start=0).validate()
    assert GenerationConfig().kv_group_size == 64 and GenerationConfig().quantized_kv_start == 5000


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    """An 8-token qwen3 target with head_dim 32 and its DFlash 2 drafter (block 4)."""
    from mlx_lm.utils import load_model

    from dflash_mlx.decoding.state import DFlashModel
    from dflash_mlx.model.checkpoint import load_drafter
    from dflash_mlx.model.target import TargetAdapter

    root = tmp_path_factory.mktemp("kv8")
    build_target(root / "t", "qwen3", tokenizer=False, vocab_size=8, seed=5, hidden=128)
    build_drafter(root / "d", root / "t", dflash2=True, block_size=4, seed=7)
    target = load_model(root / "t")[0]
    drafter = load_drafter(root / "d", mx.float32)
    return DFlashModel(target, drafter, TargetAdapter(target, drafter.args.target_layer_ids))


def _quantized_law(model, prompt, n, params):
    """The joint law of the first n tokens of mlx-lm's ``generate_step`` with kv_bits 8 and
    quantized_kv_start 0: all but the last prompt token, the conversion, then one by one."""
    law = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for prefix, pr in law.items():
            cache = make_prompt_cache(model.target)
            model.target(mx.array(prompt[:-1])[None], cache=cache)
            maybe_quantize_kv_cache(cache, 0, GROUP, 8)
            for t in [prompt[-1], *prefix]:
                logits = model.target(mx.array([[t]]), cache=cache)[:, -1]
            assert isinstance(cache[0], QuantizedKVCache)
            p = target_probs(logits.astype(mx.float32), params)[0].tolist()
            nxt.update({prefix + (t,): pr * q for t, q in enumerate(p) if q > 0})
        law = nxt
    return law


def test_sampling_follows_the_quantized_target_law(eight):
    model, prompt, n, trials = eight, [2, 5, 1, 7], 4, 1000
    params = SamplingParams(1.0, 1.0, 0.0, 0)
    law = _quantized_law(model, prompt, n, params)
    key, samples, accepted = mx.random.key(11), [], 0
    for _ in range(trials):
        key, sub = mx.random.split(key)
        out = []
        opts = DecodeOptions(max_tokens=n, block_size=4, key=sub, kv=(8, GROUP, 0))
        for c in decode(model, prompt, model.make_cache(), params, opts):
            out += c.tokens
            accepted += c.accepted
        samples.append(tuple(out[:n]))
    assert accepted > trials // 4
    assert_law(samples, law, n)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["run", "--kv-bits", "3"], "--kv-bits must be 4 or 8 (got 3)"),
        (["chat", "--kv-group-size", "48"], "--kv-group-size must be 32, 64 or 128 (got 48)"),
        (["run", "--quantized-kv-start", "-2"], "--quantized-kv-start must be >= 0"),
        (["serve", "--kv-bits", "8"], "--kv-bits needs --max-batch 1"),
        (["bench", "-p", "x", "--kv-bits", "6"], "--kv-bits must be 4 or 8 (got 6)"),
    ],
)
def test_the_commands_take_the_flags_one_error_line_exit_2(tmp_path, args, needle):
    from typer.testing import CliRunner

    from dflash_mlx.cli import app

    argv = [*args, "--model", str(tmp_path / "none")] + (["hi"] if args[0] == "run" else [])
    r = CliRunner().invoke(app, argv, input="")
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1, (r.exit_code, r.stderr, r.exception)
    assert lines[0].startswith("error: ") and needle in lines[0], lines[0]
    assert "Traceback" not in r.stderr + r.stdout


def test_the_http_fields_are_optional_and_checked_with_a_400():
    from dflash_mlx.server.schema import APIError, parse_body

    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_body(body, "chat").gen.kv_bits is None
    got = parse_body({**body, "kv_bits": 4, "kv_group_size": 32}, "chat").gen
    assert (got.kv_bits, got.kv_group_size, got.quantized_kv_start) == (4, 32, 5000)
    with pytest.raises(APIError) as e:
        parse_body({**body, "kv_bits": 3}, "chat")
    assert e.value.status == 400 and e.value.param == "kv_bits"
    assert e.value.body()["error"]["message"].startswith("kv_bits must be 4 or 8 (got 3)")


def test_batching_refuses_kv_bits_in_one_line(wide):
    from dflash_mlx import BatchGenerator

    model, tok = wide["qwen3"]
    gen = BatchGenerator(model, tok)
    with pytest.raises(DFlashError, match="kv_bits is not supported with batched decoding"):
        gen.insert("hi", kv_bits=8, raw=True)
    model, tok = wide["qwen3_5"]  # a hybrid batches as well: refused in a batch
    with pytest.raises(DFlashError, match="kv_bits is not supported with batched decoding"):
        BatchGenerator(model, tok).insert("hi", kv_bits=8, raw=True)
    gen = BatchGenerator(model, tok, solo=True)  # one request at a time: it can
    uid = gen.insert("def f(", kv_bits=8, kv_group_size=GROUP, quantized_kv_start=0, raw=True)
    out = []
    while len(gen):
        out += [t for u, r in gen.step() if u == uid for t in r.tokens]
    ids = tok.encode("def f(")
    assert out and out == _mlx_lm(model, ids, len(out), 8, 0)


def test_bench_quantizes_every_method_and_mlx_lms_alike(wide):
    from dflash_mlx.bench.runner import run_bench

    model, tok = wide["qwen3_5"]
    rep = run_bench(model, tok, PROMPTS[:2], max_tokens=24, block_size=8, kv=(4, GROUP, 3))
    summary = rep["parity"]["summary"]
    assert summary and all(s["identical"] == s["of"] == 2 for s in summary.values()), summary


@pytest.mark.parametrize("bits", [8, 4])
def test_trees_commit_siblings_on_quantized_caches_and_match_mlx_lm(wide, bits):
    """A sibling committed moves its row's data, scales and biases (``keep_rows``)."""
    from oracle import OracleDrafter

    model, tok = wide["qwen3"]
    real = model.drafter
    for prompt in PROMPTS[:2]:
        ids = tok.encode(prompt)
        ref = _mlx_lm(model, ids, 64, bits, 0)
        # the first draft is wrong, the target's token ranks second: the first sibling
        model.drafter = OracleDrafter(real, ids + ref + [0] * 20, second_at=(1,))
        try:
            out, taken = [], 0
            opts = DecodeOptions(max_tokens=40, block_size=8, kv=(bits, GROUP, 0))
            for c in decode(model, ids, model.make_cache(), SamplingParams(), opts):
                out += c.tokens
                taken += c.sibling > 0
        finally:
            model.drafter = real
        assert out[:40] == ref[:40] and taken > 5, (prompt, taken)
