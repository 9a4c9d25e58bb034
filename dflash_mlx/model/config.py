"""Drafter checkpoint configuration (docs/format.md §2.1, §3)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from ..errors import DFlashError

DFLASH2 = "DFlash2DraftModel"
DFLASH1 = "DFlashDraftModel"


# --draft-quant / load(draft_quant=): the drafter's layers at load (model/quantize.py).
DRAFT_QUANT = ("auto", "none", "8", "4")


def parse_draft_quant(value, what: str = "draft_quant") -> int | None:
    """``draft_quant`` as bits: None (auto: 4 on a GPU beside a quantized target, else
    none), 0 (none: dense), 4 or 8.

    Args:
        value: None / "auto", 0 / "none", 4 / "4", 8 / "8". what: the name errors use.

    Raises:
        DFlashError: any other value, naming the choices.
    """
    text = "auto" if value is None else str(value).strip().lower()
    if isinstance(value, bool) or text not in DRAFT_QUANT + ("0",):
        raise DFlashError(
            f"{what} must be one of {', '.join(DRAFT_QUANT)} (got {value!r}); "
            "use 4 or 8 for a quantized drafter, none for its stored weights"
        )
    if text == "auto":
        return None
    return 0 if text in ("none", "0") else int(text)


@dataclass
class DrafterArgs:
    """Hyper-parameters of a DFlash 1 / DFlash 2 drafter, HF-named like its config.json."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    num_target_layers: int | None = None
    max_position_embeddings: int = 262144
    rope_theta: float | None = None
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    sliding_window: int | None = None
    use_sliding_window: bool = False
    layer_types: list[str] | None = None
    architectures: list[str] = field(default_factory=lambda: [DFLASH2])
    model_type: str = "qwen3"
    is_causal: bool = False
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"
    dflash_config: dict[str, Any] = field(default_factory=dict)
    # Flattened from dflash_config (or older top-level keys):
    block_size: int = 16
    mask_token_id: int = 0
    target_layer_ids: list[int] = field(default_factory=list)
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0
    draft_vocab_size: int | None = None  # rows of the optional draft_vocab tensor

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> DrafterArgs:
        """Build from a config.json dict; unknown keys are ignored.

        Args:
            params: the parsed config.json.
        """
        if not isinstance(params, dict):
            raise DFlashError(
                f"drafter config.json must be a JSON object, not {_json_kind(params)}; "
                "re-download the drafter or fix its config.json"
            )
        names = inspect.signature(cls).parameters
        flat = {k: v for k, v in params.items() if k in names}
        if not isinstance(params.get("dflash_config") or {}, dict):
            _bad("dflash_config", "must be an object", params["dflash_config"])
        for k, v in (params.get("dflash_config") or {}).items():
            if k in names:
                flat[k] = v
        if "torch_dtype" in params and "dtype" not in params:
            flat["dtype"] = params["torch_dtype"]
        missing = [
            n for n, p in names.items() if p.default is inspect.Parameter.empty and n not in flat
        ]
        if missing:
            raise DFlashError(
                f"drafter config.json lacks {', '.join(missing)}; "
                "re-download the drafter or fix its config.json"
            )
        for k, v in flat.items():
            _check_field(k, v)
        args = cls(**flat)
        args.validate()
        return args

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.rope_parameters:
            self.rope_theta = self.rope_theta or self.rope_parameters.get("rope_theta")
            kind = self.rope_parameters.get("rope_type", self.rope_parameters.get("type"))
            if kind not in (None, "default") and self.rope_scaling is None:
                self.rope_scaling = self.rope_parameters
        if self.rope_theta is None:
            self.rope_theta = 10000.0
        if self.layer_types is None:
            kind = "sliding_attention" if self.use_sliding_window else "full_attention"
            self.layer_types = [kind] * self.num_hidden_layers

    @property
    def is_dflash2(self) -> bool:
        """True for DFlash 2 checkpoints (conv + path selector tensors present)."""
        return DFLASH2 in self.architectures

    @property
    def conv_groups(self) -> int:
        """G: number of channel groups that share one dynamic conv coefficient."""
        return self.hidden_size // self.conv_group_size

    def window(self, layer: int) -> int | None:
        """Context rows a layer may see, or None when it sees them all."""
        if self.layer_types[layer] == "sliding_attention" and self.sliding_window:
            return self.sliding_window - 1
        return None

    def validate(self) -> None:
        """Raise DFlashError on values no drafter can have."""
        arch = set(self.architectures)
        if not arch & {DFLASH1, DFLASH2}:
            raise DFlashError(
                f"drafter architectures {sorted(arch)} are not DFlash; "
                f"expected {DFLASH2} or {DFLASH1} in config.json"
            )
        if not self.target_layer_ids:
            raise DFlashError(
                "drafter config has no dflash_config.target_layer_ids; "
                "this is not a DFlash drafter checkpoint"
            )
        if self.is_causal:  # format.md §2.1: the block's rows see each other
            raise DFlashError(
                "drafter config.json says is_causal: true, but this engine drafts a block with "
                "bidirectional attention (docs/format.md §2.1); set it to false if the drafter "
                "was trained bidirectionally (DFlash's own are), else it cannot be run here"
            )
        if self.block_size < 2:
            raise DFlashError(f"drafter block_size {self.block_size} must be at least 2")
        if len(self.layer_types) != self.num_hidden_layers:
            raise DFlashError(
                f"drafter layer_types has {len(self.layer_types)} entries for "
                f"{self.num_hidden_layers} layers; fix config.json"
            )
        if self.is_dflash2 and self.hidden_size % self.conv_group_size:
            raise DFlashError(
                f"hidden_size {self.hidden_size} is not a multiple of "
                f"conv_group_size {self.conv_group_size}; fix config.json"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise DFlashError(
                f"drafter num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}; fix config.json"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise DFlashError(
                f"mask_token_id {self.mask_token_id} is outside the vocabulary "
                f"(size {self.vocab_size}); fix config.json"
            )


# Each config.json field: (kind, smallest allowed value); None is allowed where the field's
# default is None. Checked once, at load, so a bad value is named before any array is built.
_INT = {
    "hidden_size": 1,
    "intermediate_size": 1,
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "vocab_size": 1,
    "head_dim": 1,
    "num_target_layers": 1,
    "max_position_embeddings": 1,
    "sliding_window": 1,
    "block_size": 2,
    "mask_token_id": 0,
    "conv_kernel_size": 1,
    "conv_group_size": 1,
    "selector_rank": 1,
    "selector_top_k": 1,
    "draft_vocab_size": 1,
}
_POSITIVE = {"rms_norm_eps", "rope_theta", "final_logit_softcapping"}
_FLOAT = {"output_multiplier", "input_embedding_scale"} | _POSITIVE
_BOOL = {"use_sliding_window", "is_causal", "tie_word_embeddings"}
_STR = {"model_type", "dtype"}
_DICT = {"rope_scaling", "rope_parameters", "dflash_config"}
_NULLABLE = {
    "head_dim",
    "num_target_layers",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "sliding_window",
    "layer_types",
    "final_logit_softcapping",
    "draft_vocab_size",
}
LAYER_TYPES = ("full_attention", "sliding_attention")
# The list fields: what each item must pass, and the rule an error names when one fails.
_LISTS = {
    "architectures": (lambda a: isinstance(a, str), "must be a list of strings"),
    "layer_types": (lambda t: t in LAYER_TYPES, f"must be a list of {' / '.join(LAYER_TYPES)}"),
    "target_layer_ids": (lambda i: _is_int(i) and i >= 0, "must be a list of layer indices >= 0"),
}


def _json_kind(v) -> str:
    names = {bool: "a boolean", str: "a string", list: "an array", dict: "an object"}
    if v is None:
        return "null"
    return names.get(type(v), "a number" if isinstance(v, (int, float)) else type(v).__name__)


def _bad(name: str, rule: str, v, what: str = "drafter config.json") -> None:
    got = f"{v!r}" if isinstance(v, (int, float, str)) else _json_kind(v)
    raise DFlashError(f"{what} field '{name}' {rule} (got {got}); fix config.json")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_field(name: str, v) -> None:
    """Raise DFlashError naming ``name`` when its value has the wrong type or range."""
    import math

    if v is None and name in _NULLABLE:
        return
    if name in _INT:
        if not _is_int(v) or v < _INT[name]:
            _bad(name, f"must be an integer >= {_INT[name]}", v)
    elif name in _FLOAT:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if not ok or (name in _POSITIVE and v <= 0):
            _bad(name, "must be a positive number" if name in _POSITIVE else "must be a number", v)
    elif name in _BOOL and not isinstance(v, bool):
        _bad(name, "must be true or false", v)
    elif name in _STR and not isinstance(v, str):
        _bad(name, "must be a string", v)
    elif name in _DICT and not isinstance(v, dict):
        _bad(name, "must be an object", v)
    elif name in _LISTS:
        item_ok, rule = _LISTS[name]
        if not isinstance(v, list) or not all(item_ok(x) for x in v):
            _bad(name, rule, v)
    if name == "rope_parameters" and "rope_theta" in v:
        _check_field("rope_theta", v["rope_theta"])


# The target's config.json fields every architecture reads (checked where present).
_TARGET_INT = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "head_dim",
    "max_position_embeddings",
)


def check_target_config(params, path) -> None:
    """Refuse a target config.json that mlx-lm would fail on with a traceback: not an
    object, no string ``model_type``, or a common size field of the wrong type or range.

    Args:
        params: the parsed config.json. path: the file, for the message.

    Raises:
        DFlashError: naming the file and the field.
    """
    what = f"model config {path}"
    if not isinstance(params, dict):
        raise DFlashError(f"{what} must be a JSON object, not {_json_kind(params)}; fix it")
    archs = params.get("architectures")
    if isinstance(archs, list) and {DFLASH1, DFLASH2} & {a for a in archs if isinstance(a, str)}:
        raise DFlashError(
            f"{path} is a DFlash drafter, not a target model; pass it as --drafter and the "
            "model it was made for as --model"
        )
    if not isinstance(params.get("model_type"), str):
        _bad("model_type", "must name the architecture (a string)", params.get("model_type"), what)
    for cfg in (params, params.get("text_config")):
        if not isinstance(cfg, dict):
            continue
        for name in _TARGET_INT:
            v = cfg.get(name)
            vals = v if isinstance(v, list) and v else [v]  # some architectures: one per layer
            if v is not None and not all(_is_int(x) and x >= 1 for x in vals):
                _bad(name, "must be an integer >= 1", v, what)
        for name in ("rms_norm_eps", "rope_theta"):
            v = cfg.get(name)
            if v is not None and (
                isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0
            ):
                _bad(name, "must be a positive number", v, what)
