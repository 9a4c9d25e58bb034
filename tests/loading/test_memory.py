"""The memory plan (loading/memory.py, loading/footprint.py): the device budget, the sizes
read from headers against what MLX holds once loaded, the check and its fixes."""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from dflash_mlx.errors import DFlashError
from dflash_mlx.loading import footprint, memory

DENSE = {
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_size": 512,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
}


def _nbytes(module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def test_device_budget_override_and_meminfo(tmp_path):
    assert memory.device_budget(2.5) == (2_500_000_000, "--max-memory 2.5 GB")
    size, where = memory.device_budget()
    assert size > 0 and where
    info = tmp_path / "meminfo"
    info.write_text("MemTotal: 100 kB\nMemAvailable:    2048 kB\n")
    assert memory._meminfo_available(str(info)) == 2048 * 1024
    assert memory._meminfo_available(str(tmp_path / "none")) is None


def test_kv_cache_dense_quantized_and_hybrid():
    bf16 = footprint.kv_cache_bytes(DENSE, 1000, 2)
    assert bf16 == 4 * 2 * 2 * 64 * 1000 * 2
    q8 = footprint.kv_cache_bytes(DENSE, 1000, 2, kv_bits=8, group=64)
    assert q8 == int(bf16 / 2 * (1 + 4 / 64))  # 8 bits, plus a bf16 scale and bias per 64
    hybrid = dict(DENSE, num_hidden_layers=8, full_attention_interval=4)
    hybrid |= {"linear_num_value_heads": 4, "linear_num_key_heads": 2}
    hybrid |= {"linear_key_head_dim": 16, "linear_value_head_dim": 16}
    kv_only = 2 * 2 * 2 * 64 * 1000 * 2  # 2 of the 8 layers hold a KV cache
    states = footprint.kv_cache_bytes(hybrid, 1000, 2) - kv_only
    assert 0 < states < kv_only  # the recurrent states do not grow with the context


def test_context_choice():
    assert memory.choose_context(DENSE, None) == (4096, "the model's context")
    big = dict(DENSE, max_position_embeddings=262144)
    assert memory.choose_context(big, None)[0] == memory.DEFAULT_CONTEXT_CAP
    assert memory.choose_context(big, 8192) == (8192, "--max-context")
    assert memory.choose_context(DENSE, 8192)[0] == 4096  # never beyond the model's


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_plan_matches_a_loaded_safetensors_pair(tiny_dir, pairs, kind):
    m, _ = pairs(kind, "d2")
    plan = memory.make_plan(tiny_dir / kind, tiny_dir / f"d2_{kind}", max_context=256)
    assert plan.target == pytest.approx(_nbytes(m.target), rel=0.1)
    drafter = _nbytes(m.drafter)
    if memory._cpu_backend():  # the few-row kernel's exact 16-bit copies (numpy, not MLX)
        drafter += drafter // 2
    assert plan.drafter == pytest.approx(drafter, rel=0.1)


def test_kv_estimate_matches_a_prefilled_cache(tiny_dir, pairs):
    from mlx_lm.models.cache import make_prompt_cache

    m, _ = pairs("qwen3", "d2")
    cache = make_prompt_cache(m.target)
    m.target(mx.zeros((1, 256), dtype=mx.int32), cache=cache)
    held = sum(c.keys.nbytes + c.values.nbytes for c in cache)
    plan = memory.make_plan(tiny_dir / "qwen3", tiny_dir / "d2_qwen3", max_context=256)
    assert plan.kv == pytest.approx(held, rel=0.1)
    smaller = memory.make_plan(tiny_dir / "qwen3", tiny_dir / "d2_qwen3", 256, kv=(8, 64, 0))
    assert smaller.kv < plan.kv / 2 + 1
    # below quantized_kv_start the cache stays whole; past it both are held while converting
    later = memory.make_plan(tiny_dir / "qwen3", tiny_dir / "d2_qwen3", 256, kv=(8, 64, 5000))
    assert later.kv == plan.kv
    mid = memory.make_plan(tiny_dir / "qwen3", tiny_dir / "d2_qwen3", 256, kv=(8, 64, 128))
    assert plan.kv / 2 < mid.kv < plan.kv


def test_plan_matches_a_loaded_gguf(tmp_path):
    from tiny_gguf import write_tiny_gguf

    from dflash_mlx.loading.gguf import load_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tmp_path)
    cpu = memory._cpu_backend()
    size, cfg = footprint._gguf(path, cpu)
    model, _, config = load_gguf(path)
    assert size == pytest.approx(_nbytes(model), rel=0.1)
    assert cfg["num_hidden_layers"] == config["num_hidden_layers"] == 2


def test_check_refuses_with_fixes_and_warns_when_close(tiny_dir):
    plan = memory.make_plan(tiny_dir / "qwen3", tiny_dir / "d2_qwen3")
    with pytest.raises(DFlashError, match=r"needs ~.* GB \(estimated"):
        memory.check(plan, plan.peak // 100, "test")
    tight = plan.peak_with(kv=0, draft_kv=0) + (plan.kv + plan.draft_kv) // 3
    with pytest.raises(DFlashError, match="--max-context"):
        memory.check(plan, tight, "test")
    assert memory.check(plan, int(plan.peak / 0.9), "test").startswith("warning:")
    assert memory.check(plan, plan.peak * 2, "test") is None


@pytest.mark.parametrize(
    "mem, ctx, bad",
    [(-1, None, "max_memory"), (0, None, "max_memory"), (float("nan"), None, "max_memory")]
    + [(None, 0, "max_context"), (None, 1.5, "max_context"), (True, None, "max_memory")],
)
def test_limits_are_checked(mem, ctx, bad):
    with pytest.raises(DFlashError, match=rf"^{bad} must be a positive number"):
        memory.check_limits(mem, ctx)


def test_load_refuses_before_loading_and_caps_the_context(tiny_dir):
    from dflash_mlx import load
    from dflash_mlx.decoding.prompt import context_length

    with pytest.raises(DFlashError, match="estimated"):
        load(str(tiny_dir / "qwen3"), drafter=str(tiny_dir / "d2_qwen3"), max_memory=1e-6)
    m, _ = load(
        str(tiny_dir / "qwen3"), drafter=str(tiny_dir / "d2_qwen3"), max_context=64, warmup=False
    )
    assert context_length(m) == 64


def test_decoding_wrapper_keeps_the_items_and_closes():
    closed = []

    def steps():
        try:
            yield from range(3)
        finally:
            closed.append(True)

    class Pair:
        target = None

    assert list(memory.decoding(Pair(), steps())) == [0, 1, 2]
    gen = memory.decoding(Pair(), steps())
    next(gen)
    gen.close()
    assert closed == [True, True] and memory._WIRED["depth"] == 0


def test_a_half_downloaded_target_is_not_planned(tiny_dir, tmp_path):
    import json
    import shutil

    target = tmp_path / "half"
    shutil.copytree(tiny_dir / "qwen3", target)
    index = {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="00002"):
        memory.make_plan(target, tiny_dir / "d2_qwen3")
    shutil.rmtree(target)
    target.mkdir()
    (target / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError):
        memory.make_plan(target, tiny_dir / "d2_qwen3")


def test_fit_warns_once_when_close(tiny_dir):
    from dflash_mlx.loading.loader import resolve

    res = resolve(str(tiny_dir / "qwen3"), str(tiny_dir / "d2_qwen3"))
    peak = memory.make_plan(tiny_dir / "qwen3", tiny_dir / "d2_qwen3").peak
    fit = memory.Fit(res, None, max_memory=peak / 0.9 / 1e9)
    said = []
    fit.check(res.target, res.drafters[0], said.append)
    fit.check(res.target, res.drafters[0], said.append)
    assert len(said) == 1 and said[0].startswith("warning: this pair needs ~")
    assert "expect swapping" in said[0]


@pytest.mark.parametrize("data", [b"", b"abc", b"not a safetensors file", b"\xff" * 8 + b"{}"])
def test_a_damaged_safetensors_header_is_a_value_error_not_a_huge_read(tmp_path, data):
    """The plan reads only headers; a file whose first 8 bytes are no length (the loader
    then says it is corrupt) must not make it read gigabytes."""
    from dflash_mlx.loading import footprint

    f = tmp_path / "model.safetensors"
    f.write_bytes(data)
    with pytest.raises(ValueError, match="no safetensors header"):
        footprint._safetensors([f])


class _Downloaded(Exception):
    """Raised by the fake download: the load got that far."""


def _fake_hub(monkeypatch, tmp_path, tiny_dir, total: int | None) -> dict:
    """An uncached Hub repo acme/big: the tiny qwen3's config.json, safetensors files
    listed as ``total`` bytes (None: no sizes); every Hub call is counted, none leaves."""
    import types

    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    calls = {"listing": 0, "config": 0, "download": 0}
    half = None if total is None else total // 2
    files = ["config.json", "model-1.safetensors", "model-2.safetensors"]

    def listing(self, repo_id, **kw):
        calls["listing"] += 1
        sizes = [600, half, half]
        siblings = [types.SimpleNamespace(rfilename=f, size=n) for f, n in zip(files, sizes)]
        return types.SimpleNamespace(sha="b" * 40, siblings=siblings)

    def config(repo_id, filename, **kw):
        calls["config"] += 1
        return str(tiny_dir / "qwen3" / filename)

    def download(*a, local_files_only=False, **kw):
        if local_files_only:  # hub.cached: nothing is in the cache
            raise LocalEntryNotFoundError("not cached")
        calls["download"] += 1
        raise _Downloaded

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", listing)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", config)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    return calls


def test_an_uncached_repo_too_big_is_refused_before_its_download(tiny_dir, tmp_path, monkeypatch):
    from dflash_mlx import load

    calls = _fake_hub(monkeypatch, tmp_path, tiny_dir, 19 * 10**9)
    drafter = str(tiny_dir / "d2_qwen3")
    with pytest.raises(DFlashError, match=r"needs ~19\.\d GB \(estimated.* 16\.0 GB \(--max-m"):
        load("acme/big", drafter, offline=False, quiet=True, max_memory=16)
    assert calls == {"listing": 1, "config": 1, "download": 0}
    calls = _fake_hub(monkeypatch, tmp_path, tiny_dir, 10**9)  # fits: the download starts
    with pytest.raises(_Downloaded):
        load("acme/big", drafter, offline=False, quiet=True, max_memory=16)
    assert calls["config"] == 1 and calls["download"] == 1


@pytest.mark.parametrize("offline, total", [(True, 19 * 10**9), (False, None)])
def test_offline_or_no_sizes_waits_for_the_files(tiny_dir, tmp_path, monkeypatch, offline, total):
    from dflash_mlx import load

    calls = _fake_hub(monkeypatch, tmp_path, tiny_dir, total)
    drafter = str(tiny_dir / "d2_qwen3")
    with pytest.raises(DFlashError if offline else _Downloaded) as e:
        load("acme/big", drafter, offline=offline, quiet=True, max_memory=16)
    if offline:  # no Hub request at all: the cache's own one-line error
        assert "not in the local Hugging Face cache" in str(e.value)
        assert calls == {"listing": 0, "config": 0, "download": 0}
    else:
        assert calls["config"] == 0 and calls["download"] == 1


def test_a_hub_that_cannot_be_reached_skips_the_plan(tiny_dir, tmp_path, monkeypatch):
    import huggingface_hub

    _fake_hub(monkeypatch, tmp_path, tiny_dir, 19 * 10**9)

    def down(self, repo_id, **kw):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", down)
    assert memory._source("acme/big", offline=False) is None
    assert memory._source(str(tiny_dir / "qwen3"), offline=False) == tiny_dir / "qwen3"


def test_the_plan_counts_a_drafter_quantized_at_load(tiny_dir):
    dense = memory.make_plan(tiny_dir / "qwen3", tiny_dir / "d2_qwen3", 256)
    four = memory.make_plan(tiny_dir / "qwen3", tiny_dir / "d2_qwen3", 256, draft_bits=4)
    eight = memory.make_plan(tiny_dir / "qwen3", tiny_dir / "d2_qwen3", 256, draft_bits=8)
    assert four.drafter < eight.drafter < dense.drafter
    assert four.target == dense.target and four.kv == dense.kv
    # auto on the CPU backend keeps the drafter dense (model/quantize.py's default_bits)
    auto = memory.make_plan(tiny_dir / "qwen3", tiny_dir / "d2_qwen3", 256, draft_bits=None)
    assert auto.drafter == dense.drafter
