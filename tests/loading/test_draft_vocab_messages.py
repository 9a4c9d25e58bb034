"""``load(draft_vocab=N)``'s errors name the API's parameter, not the CLI's flag, and say
what is true: too small a size, or one the tokenizer's special tokens alone exceed."""

from __future__ import annotations

from types import SimpleNamespace

from refusals import refused


def test_draft_vocab_errors_name_the_parameter(pairs):
    from dflash_mlx.loading.loader import set_draft_vocab

    model, tok = pairs("qwen3", "d2")
    try:
        for n in (2, 5, 15):
            msg = refused(
                lambda n=n: set_draft_vocab(model, tok, n), f"draft_vocab={n} is too small"
            )
            assert "--draft-vocab" not in msg and "16 or more" in msg
        refused(lambda: set_draft_vocab(model, tok, -3), "draft_vocab must be None, 0")
        many = SimpleNamespace(all_special_ids=list(range(40)), eos_token_ids=[])
        refused(
            lambda: set_draft_vocab(model, many, 16),
            "draft_vocab=16 is fewer than the tokenizer's 40 special tokens",
            "use more than 40",
        )
        assert model.draft_head is None  # nothing changed
    finally:
        model.draft_head = None


def test_load_names_draft_vocab(tiny_dir):
    from dflash_mlx import load

    kw = {"drafter": str(tiny_dir / "d2_qwen3"), "warmup": False}
    refused(
        lambda: load(str(tiny_dir / "qwen3"), draft_vocab=5, **kw), "draft_vocab=5 is too small"
    )
    model, _ = load(str(tiny_dir / "qwen3"), draft_vocab=16, **kw)
    assert model.draft_head.size == 16
