"""GenerationConfig: one check per setting, messages in the user's words, the defaults every
entry point takes from it."""

from __future__ import annotations

import math
from dataclasses import FrozenInstanceError, fields, replace

import pytest

from dflash_mlx.settings import (
    FLAGS,
    MAX_TOKENS,
    SEED_MAX,
    GenerationConfig,
    SettingError,
    check_block_size,
)

BAD = [  # (field, value, how the message goes on after the setting's name)
    ("max_tokens", 0, "must be at least 1 (got 0)"),
    ("max_tokens", 2.5, "must be an integer"),
    ("temperature", -0.1, "must be >= 0 (got -0.1); use 0 for greedy decoding"),
    ("temperature", math.nan, "must be a finite number (got nan)"),
    ("temperature", "hot", "must be a number (got 'hot')"),
    ("top_p", 0.0, "must be in (0, 1] (got 0.0)"),
    ("top_p", math.inf, "must be a finite number (got inf)"),
    ("top_k", -1, "must be >= 0 (got -1); use 0 to turn it off"),
    ("min_p", 1.5, "must be in [0, 1] (got 1.5)"),
    ("presence_penalty", -math.inf, "must be a finite number (got -inf)"),
    ("presence_penalty", 2.5, "must be in [-2, 2] (got 2.5)"),
    ("frequency_penalty", -3, "must be in [-2, 2] (got -3)"),
    ("repetition_penalty", 0.0, "must be > 0 (got 0.0)"),
    ("repetition_penalty", math.nan, "must be a finite number"),
    ("logit_bias", {1: 101}, "must be in [-100, 100] (got 101)"),
    ("logit_bias", {"a": 1}, "keys must be token ids"),
    ("use_selector", "yes", "must be true or false"),
    ("tree", "yes", "must be true or false"),
    ("seed", -1, f"must be in 0..{SEED_MAX} (got -1)"),
    ("seed", SEED_MAX + 1, f"must be in 0..{SEED_MAX}"),
    ("seed", True, "must be an integer"),
    ("stop", 5, "must be a string or a list of strings"),
]


@pytest.mark.parametrize("field,value,words", BAD, ids=[f"{b[0]}={b[1]!r}" for b in BAD])
def test_each_bad_value_is_one_line_naming_the_setting(field, value, words):
    cfg = replace(GenerationConfig(), **{field: value})
    with pytest.raises(SettingError) as api:
        cfg.validate(16)
    assert api.value.field == field and str(api.value).startswith(f"{field} {words}")
    assert "\n" not in str(api.value)
    with pytest.raises(SettingError) as cli:
        cfg.validate(16, flags=True)
    assert str(cli.value).startswith(f"{FLAGS.get(field, field)} {words}")


def test_good_values_pass():
    cfg = GenerationConfig(
        max_tokens=1,
        temperature=0.7,
        top_p=1,
        top_k=40,
        min_p=0.05,
        presence_penalty=-2,
        frequency_penalty=2,
        repetition_penalty=1.1,
        logit_bias={3: -100},
        block_size=2,
        use_selector=False,
        seed=SEED_MAX,
        stop=["\n\n"],
    )
    assert cfg.validate(8) is cfg and cfg.validate(flags=True) is cfg
    assert GenerationConfig(seed=0, stop="x").validate() is not None


def test_block_size_auto_is_the_default_and_parses_from_the_command_line():
    from dflash_mlx.settings import parse_block_size

    check_block_size("auto", 8)
    assert parse_block_size("AUTO") == "auto" and parse_block_size(" 4 ") == 4
    assert parse_block_size(None) is None
    with pytest.raises(SettingError, match="^--block-size must be an integer or 'auto'"):
        GenerationConfig(block_size=parse_block_size("fast")).validate(flags=True)


def test_block_size_is_checked_in_one_place():
    check_block_size(None, 8)
    check_block_size(8, 8)
    check_block_size(64, None)  # the checkpoint is not known yet: only the lower bound
    with pytest.raises(SettingError, match="^block size 9 is out of range; this drafter supports"):
        check_block_size(9, 8)
    with pytest.raises(SettingError, match="^--block-size 9 is larger than this drafter's block"):
        check_block_size(9, 8, flags=True)
    with pytest.raises(SettingError, match="^--block-size must be at least 2 \\(got 1\\)"):
        GenerationConfig(block_size=1).validate(flags=True)
    with pytest.raises(SettingError, match="must be an integer"):
        GenerationConfig(block_size=4.0).validate(8)


def test_defaults():
    cfg = GenerationConfig()
    assert cfg.max_tokens == MAX_TOKENS["api"] == MAX_TOKENS["run"] == 256
    assert (MAX_TOKENS["chat"], MAX_TOKENS["serve"], MAX_TOKENS["bench"]) == (1024, 512, 128)
    assert (cfg.temperature, cfg.top_p, cfg.top_k, cfg.min_p) == (0.0, 1.0, 0, 0.0)
    assert cfg.block_size == "auto" and cfg.use_selector and cfg.seed is None
    assert {f.name for f in fields(cfg)} >= set(FLAGS)
    with pytest.raises(FrozenInstanceError):  # a request changes a copy, never the defaults
        cfg.temperature = 1.0
