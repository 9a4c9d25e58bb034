"""Drafter config.json validation: every field's type and range is checked once, at load,
and a bad value is one line that names the field."""

import json

import pytest

from dflash_mlx.errors import DFlashError
from dflash_mlx.model.checkpoint import drafter_config, load_drafter
from dflash_mlx.model.config import DrafterArgs


def good() -> dict:
    return drafter_config(
        hidden_size=64,
        vocab_size=300,
        num_target_layers=4,
        target_layer_ids=[1, 2],
        mask_token_id=5,
    )


def with_field(name, value):
    cfg = good()
    (cfg["dflash_config"] if name in cfg["dflash_config"] else cfg)[name] = value
    return cfg


BAD = [
    ("selector_top_k", 0, "'selector_top_k' must be an integer >= 1 (got 0)"),
    ("num_attention_heads", 0, "'num_attention_heads' must be an integer >= 1 (got 0)"),
    ("num_attention_heads", 3, "not a multiple of num_key_value_heads 2"),
    ("hidden_size", "576", "'hidden_size' must be an integer >= 1 (got '576')"),
    ("hidden_size", 64.0, "'hidden_size' must be an integer >= 1 (got 64.0)"),
    ("vocab_size", True, "'vocab_size' must be an integer >= 1 (got True)"),
    ("head_dim", -8, "'head_dim' must be an integer >= 1"),
    ("block_size", 1, "'block_size' must be an integer >= 2"),
    ("mask_token_id", -1, "'mask_token_id' must be an integer >= 0"),
    ("conv_group_size", 0, "'conv_group_size' must be an integer >= 1"),
    ("rms_norm_eps", 0, "'rms_norm_eps' must be a positive number"),
    ("rms_norm_eps", "1e-6", "'rms_norm_eps' must be a positive number"),
    ("output_multiplier", None, "'output_multiplier' must be a number (got null)"),
    ("tie_word_embeddings", "no", "'tie_word_embeddings' must be true or false"),
    ("architectures", "DFlash2DraftModel", "'architectures' must be a list of strings"),
    ("layer_types", ["window"], "'layer_types' must be a list of full_attention"),
    ("target_layer_ids", [1, "2"], "'target_layer_ids' must be a list of layer indices"),
    ("target_layer_ids", {"a": 1}, "layer indices >= 0 (got an object)"),
    ("rope_parameters", {"rope_theta": -1.0}, "'rope_theta' must be a positive number"),
    ("rope_parameters", [1], "'rope_parameters' must be an object (got an array)"),
    ("dflash_config", [], "'dflash_config' must be an object (got an array)"),
    ("dtype", 16, "'dtype' must be a string (got 16)"),
    ("is_causal", "yes", "'is_causal' must be true or false"),
    ("is_causal", True, "says is_causal: true, but this engine drafts a block with bidirectional"),
]


@pytest.mark.parametrize("name,value,needle", BAD, ids=[f"{n}={v!r}" for n, v, _ in BAD])
def test_a_bad_field_is_one_line_that_names_it(name, value, needle):
    with pytest.raises(DFlashError) as e:
        DrafterArgs.from_dict(with_field(name, value))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_config_that_is_not_an_object_names_what_it_is(tmp_path):
    for text, kind in (("[1, 2]", "an array"), ('"x"', "a string"), ("null", "null")):
        (tmp_path / "config.json").write_text(text)
        with pytest.raises(DFlashError, match=f"must be a JSON object, not {kind}"):
            load_drafter(tmp_path)


def test_the_released_configs_pass_unchanged():
    from pathlib import Path

    import dflash_mlx

    demo = Path(dflash_mlx.__file__).parent / "demo" / "drafter" / "config.json"
    args = DrafterArgs.from_dict(json.loads(demo.read_text()))
    assert args.selector_top_k == 16 and args.head_dim == 64
    assert DrafterArgs.from_dict(good()).block_size == 8


@pytest.mark.parametrize(
    "change,needle",
    [
        (lambda c: [c], "must be a JSON object, not an array"),
        (lambda c: {k: v for k, v in c.items() if k != "model_type"}, "'model_type' must name"),
        (lambda c: c | {"hidden_size": "64"}, "'hidden_size' must be an integer >= 1 (got '64')"),
        (lambda c: c | {"num_attention_heads": 0}, "'num_attention_heads' must be an integer"),
        (lambda c: c | {"rms_norm_eps": -1}, "'rms_norm_eps' must be a positive number"),
    ],
    ids=["array", "no-model-type", "hidden-str", "heads-0", "eps-negative"],
)
def test_a_bad_target_config_is_one_line_naming_the_field(tiny_dir, tmp_path, change, needle):
    import shutil

    from dflash_mlx import load

    target = tmp_path / "target"
    shutil.copytree(tiny_dir / "qwen3", target)
    cfg = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(change(cfg)))
    with pytest.raises(DFlashError) as e:
        load(str(target), drafter=str(tiny_dir / "d2_qwen3"))
    assert needle in str(e.value) and "config.json" in str(e.value) and "\n" not in str(e.value)


def test_a_drafter_given_as_the_target_says_which_flag_it_belongs_to(tiny_dir):
    from dflash_mlx import load

    d = str(tiny_dir / "d2_qwen3")
    with pytest.raises(DFlashError, match="is a DFlash drafter, not a target model; pass it as"):
        load(d, drafter=d)


def test_target_fields_given_per_layer_pass_and_bad_entries_do_not():
    from dflash_mlx.model.config import check_target_config

    cfg = {"model_type": "gemma3n", "intermediate_size": [64, 64], "num_key_value_heads": 2}
    check_target_config(cfg, "config.json")
    with pytest.raises(DFlashError, match="'intermediate_size' must be an integer >= 1"):
        check_target_config(cfg | {"intermediate_size": [64, 0]}, "config.json")
