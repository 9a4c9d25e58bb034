"""Shared fixtures: tiny targets and drafters built once per test session."""

import atexit
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# A test run started in the background inherits SIGINT ignored, and so would every CLI it
# spawns: the Ctrl-C tests would hang or run to the end. Children get the default back.
signal.signal(signal.SIGINT, signal.default_int_handler)

# The on-disk caches (GGUF weights, warm-up costs) go to a folder of this run, never the
# user's; set before anything loads, so every spawned CLI and server inherits it.
_CACHE = tempfile.mkdtemp(prefix="dflash-test-cache-")
os.environ["DFLASH_CACHE_DIR"] = _CACHE
# One pair timed by two tests on a busy machine can differ by more than the spot check's
# tolerance, and its note would be noise in their output; the check's own tests (marked
# ``spot_check``) turn it back on.
os.environ["DFLASH_COSTS_CHECK"] = "0"
atexit.register(shutil.rmtree, _CACHE, True)

from tiny_models import build_drafter, build_target, eight_token_pair

from dflash_mlx import cpu

# Models built by hand take the backend's ops too, as a loaded pair does (Linux: the CPU twins).
cpu.install()


# The files whose tests take longest (the sampling laws, the demo target, training runs, the
# GGUF cache) start first, so that parallel workers (``pytest -n``) share them out early and
# none is left running one of them alone at the end of the run.
SLOW_FIRST = (
    # launches of two ranks: mostly waiting on their processes, best started first
    "distributed/test_pipeline.py",
    "distributed/test_sharded.py",
    "distributed/test_serve.py",
    "vision/test_ranks.py",
    "distributed/test_refusals.py",
    "vision/test_images_api.py",
    "vision/test_engine.py",
    "decoding/test_batch_sampling.py",
    "model/test_moe.py",
    "train/test_entry_points.py",
    "test_batching.py",
    "loading/test_diskcache.py",
    "loading/test_loading.py",
    "model/test_draft_vocab.py",
    "decoding/test_kv_bits.py",
    "decoding/test_tree.py",
    "loading/test_gguf.py",
    "decoding/test_grammar.py",
    "decoding/test_lookup.py",
    "test_demo.py",
    "decoding/test_acceptance.py",
)


def pytest_collection_modifyitems(config, items):
    """Order the run: ``SLOW_FIRST`` files in that order, then the rest as collected."""
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}

    def key(item):
        path = item.nodeid.split("::")[0].removeprefix("tests/")
        return rank.get(path, len(rank))

    items.sort(key=key)  # stable: each file keeps its own order


@pytest.fixture(autouse=True)
def stored_costs_checked(request, monkeypatch):
    """The spot check of stored warm-up costs is on only in the tests marked ``spot_check``."""
    if request.node.get_closest_marker("spot_check") is not None:
        monkeypatch.setenv("DFLASH_COSTS_CHECK", "1")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """Directory with targets qwen3/, qwen3_5/ and drafters d2_<kind>/, d1_<kind>/."""
    root = tmp_path_factory.mktemp("tiny")
    for kind in ("qwen3", "qwen3_5"):
        build_target(root / kind, kind)
        build_drafter(root / f"d2_{kind}", root / kind, dflash2=True, block_size=16)
        build_drafter(root / f"d1_{kind}", root / kind, dflash2=False, block_size=16, seed=2)
    return root


@pytest.fixture(scope="session")
def pairs(tiny_dir):
    """Loaded (model, tokenizer) per (target kind, drafter kind)."""
    from dflash_mlx import load

    cache = {}

    def get(kind="qwen3", drafter="d2"):
        if (kind, drafter) not in cache:
            cache[kind, drafter] = load(
                str(tiny_dir / kind), drafter=str(tiny_dir / f"{drafter}_{kind}")
            )
        return cache[kind, drafter]

    return get


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    return eight_token_pair(tmp_path_factory.mktemp("v8"))
