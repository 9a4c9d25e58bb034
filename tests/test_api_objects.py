"""Objects that know their model: a ``PromptCache`` filled by one pair and passed with
another is a ``DFlashError`` naming both, not a raw MLX error or silent garbage (another
model's tokenizer: tests/loading/test_own_tokenizer.py)."""

from __future__ import annotations

import pytest

from dflash_mlx import stream_generate
from dflash_mlx.batching import BatchGenerator
from dflash_mlx.errors import DFlashError

PROMPT = [10 + i for i in range(20)]


def run(model, tok, cache=None):
    return "".join(
        r.text for r in stream_generate(model, tok, PROMPT, prompt_cache=cache, max_tokens=4)
    )


def test_a_prompt_cache_of_another_pair_is_a_dflash_error_naming_both(pairs):
    (a, tok_a), (b, tok_b) = pairs("qwen3", "d2"), pairs("qwen3_5", "d2")
    cache = a.make_cache()
    run(a, tok_a, cache)  # filled by a
    with pytest.raises(DFlashError, match="prompt_cache was made by") as e:
        run(b, tok_b, cache)
    assert a.target_path in str(e.value) and b.target_path in str(e.value)
    with pytest.raises(DFlashError, match="prompt_cache was made by"):
        BatchGenerator(b, tok_b).insert(PROMPT, cache=cache, max_tokens=4)
    assert run(a, tok_a, cache) == run(a, tok_a)  # still good with its own pair


def test_a_cache_of_the_same_files_loaded_again_is_accepted(pairs, tiny_dir):
    from dflash_mlx import load

    a, tok = pairs("qwen3", "d2")
    again, _ = load(str(tiny_dir / "qwen3"), drafter=str(tiny_dir / "d2_qwen3"))
    cache = again.make_cache()
    assert run(a, tok, cache) == run(a, tok)
