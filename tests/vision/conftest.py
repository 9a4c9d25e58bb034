"""The vision suite's fixtures: the tiny qwen3_5 VLM and its drafter, built once.

Every test here needs mlx-vlm (the ``[vision]`` extra): without it the folder is skipped.
"""

from __future__ import annotations

import pytest

pytest.importorskip("mlx_vlm", reason="mlx-vlm is not installed (pip install 'dflash-mlx[vision]')")

from tiny_vlm import tiny_image, tiny_vlm


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory):
    """(target dir, drafter dir) of the tiny VLM pair (``tiny_vlm.tiny_vlm``)."""
    return tiny_vlm(tmp_path_factory.mktemp("vlm"))


@pytest.fixture(scope="session")
def dense_vlm_dir(tmp_path_factory):
    """(target dir, drafter dir) of the tiny qwen2_5_vl pair (dense attention, mRoPE)."""
    return tiny_vlm(tmp_path_factory.mktemp("vlm"), kind="qwen2_5_vl")


@pytest.fixture(scope="session")
def images():
    """Three different tiny PNG images' bytes (64x64: 4 image tokens each)."""
    return [tiny_image(seed) for seed in range(3)]
