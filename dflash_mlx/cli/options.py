"""The options ``dflash run`` / ``chat`` / ``serve`` / ``bench`` share, declared once.

A command names a group where its options go, as a parameter's default, and ``@expand()``
puts the group's options there in the signature typer reads; the command receives one
object: the decoding settings as a validated ``GenerationConfig`` (its options are
``settings.OPTIONS``), the model to load as a ``ModelOptions``. Only typer and light modules
are imported here.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import typer

from ..loading.hub import OFFLINE_HELP
from ..settings import MAX_TOKENS, OPTIONS, GenerationConfig


@dataclass(frozen=True)
class ModelOptions:
    """The model a command loads, as given on its command line.

    Attributes:
        model: ``--model``. drafter: ``--drafter`` (None: the registry's).
        draft_vocab: ``--draft-vocab`` (None: the drafter's own). quant: ``--quant``.
        draft_quant: ``--draft-quant`` as bits (None: auto, 0: none, 8, 4).
        offline: ``--offline``. max_memory: ``--max-memory`` in GB (None: the device's).
        max_context: ``--max-context`` in tokens (None: the model's, at most 32768).
        shard: ``--shard``: tensor or pipeline parallelism under ``mlx.launch`` (None: the
            family's default, ``distributed.shard``).
    """

    model: str
    drafter: str | None = None
    draft_vocab: int | None = None
    quant: str | None = None
    draft_quant: int | None = None
    offline: bool = False
    max_memory: float | None = None
    max_context: int | None = None
    shard: str | None = None


def _model_options(values: dict) -> ModelOptions:
    """The ``ModelOptions`` of the typed values, their limits checked (flags named)."""
    from ..distributed.pipeline import check_mode as check_shard
    from ..loading.memory import check_limits
    from ..model.config import parse_draft_quant

    check_limits(values.get("max_memory"), values.get("max_context"), flags=True)
    check_shard(values.get("shard"))
    values["draft_quant"] = parse_draft_quant(values.get("draft_quant"), "--draft-quant")
    return ModelOptions(**values)


class Group:
    """A parameter default that stands for several options, built into one object.

    Args:
        options: (parameter name, annotation, typer option) in help order.
        build: the object from the options' values (a dict by parameter name).
    """

    def __init__(self, options: Sequence[tuple[str, object, object]], build: Callable):
        self.options, self.build = list(options), build

    def names(self) -> list[str]:
        """The parameters the group stands for."""
        return [name for name, _, _ in self.options]


def _param(flag) -> str:
    """The parameter name of a flag, as the commands always named them (``--no-tree``:
    no_tree)."""
    return flag.name.lstrip("-").replace("-", "_")


def decoding(
    command: str,
    max_tokens_help: str = "Tokens to generate.",
    fields: Sequence[str] | None = None,
    **changes: dict,
) -> Group:
    """The decoding options of a command, which receives them as a validated
    ``GenerationConfig`` (errors name the flags as typed: ``--temp``).

    Args:
        command: the command, for its ``--max-tokens`` default (``settings.MAX_TOKENS``).
        max_tokens_help: the help of ``--max-tokens`` (what the tokens are for).
        fields: the ``GenerationConfig`` fields it offers (default: all of ``OPTIONS``).
        changes: field -> {"default": ..., "help": ...} where the command differs.
    """
    changes = {"max_tokens": {"default": MAX_TOKENS[command], "help": max_tokens_help}} | changes
    table = {f.field: f for f in OPTIONS}
    unknown = set(changes) - set(table) | set(fields or ()) - set(table)
    if unknown:
        raise ValueError(f"not decoding options: {sorted(unknown)}")
    flags = [f for f in OPTIONS if fields is None or f.field in fields]
    options = []
    for f in flags:
        change = changes.get(f.field, {})
        default = change.get("default", f.default)
        kind = f.kind if default is not None else f.kind | None
        names = (f.name, f.short) if f.short else (f.name,)
        options.append(
            (_param(f), kind, typer.Option(default, *names, help=change.get("help", f.help)))
        )

    def build(values: dict) -> GenerationConfig:
        cfg = GenerationConfig(**{f.field: f.value(values[_param(f)]) for f in flags})
        return cfg.validate(flags=True)

    return Group(options, build)


MODEL = Group(
    [
        (
            "model",
            str,
            typer.Option(
                ...,
                "--model",
                help="Registry alias (see `dflash models`; case-insensitive), Hub id, local "
                "directory or .gguf file.",
                show_default=False,
            ),
        ),
        (
            "drafter",
            str | None,
            typer.Option(
                None,
                "--drafter",
                help="Drafter Hub id or directory (default: the registry's drafters, tried in "
                "order).",
            ),
        ),
        (
            "draft_vocab",
            int | None,
            typer.Option(
                None,
                "--draft-vocab",
                help="Tokens the drafter scores: 0 = the full vocabulary, N = the N most "
                "frequent (merge ranks); default: the drafter's own draft vocabulary, if it "
                "ships one.",
            ),
        ),
        (
            "quant",
            str | None,
            typer.Option(
                None,
                "--quant",
                help="Target quantisation for a registry alias: 4bit (default), 8bit, bf16, mxfp8.",
            ),
        ),
        (
            "draft_quant",
            str,
            typer.Option(
                "auto",
                "--draft-quant",
                help="The drafter's layers at load: 4 or 8 bits (MLX's quantization, group 64), "
                "none (dense), auto (4 on a GPU beside a quantized target, else none). The "
                "output is unchanged: the drafter only proposes.",
            ),
        ),
        ("offline", bool, typer.Option(False, "--offline", help=OFFLINE_HELP)),
        (
            "max_memory",
            float | None,
            typer.Option(
                None,
                "--max-memory",
                help="Memory budget in GB (default: what the device reports). A pair whose "
                "estimated peak is beyond it is refused before anything loads.",
            ),
        ),
        (
            "max_context",
            int | None,
            typer.Option(
                None,
                "--max-context",
                help="Context in tokens the caches are sized for, prompt and answer "
                "(default: the model's, at most 32768).",
            ),
        ),
        (
            "shard",
            str | None,
            typer.Option(
                None,
                "--shard",
                help="Under mlx.launch: split the target over the processes with mlx-lm's "
                "tensor or pipeline parallelism (default: tensor where the family has it, "
                "else pipeline; docs/distributed.md). One process: no effect.",
            ),
        ),
    ],
    _model_options,
)


def expand(first: Callable[[dict], None] | None = None) -> Callable:
    """Decorate a command: each parameter whose default is a ``Group`` becomes the group's
    options in typer's signature, and the command gets the group's object in its place.

    Args:
        first: checks of the command's own arguments (a dict by parameter name) to run
            before the groups are built, so their errors come first.
    """

    def wrap(command: Callable) -> Callable:
        hints = typing.get_type_hints(command)
        params, groups = [], {}
        for p in inspect.signature(command).parameters.values():
            if isinstance(p.default, Group):
                groups[p.name] = p.default
                params += [
                    inspect.Parameter(name, p.POSITIONAL_OR_KEYWORD, default=opt, annotation=kind)
                    for name, kind, opt in p.default.options
                ]
            else:
                params.append(p.replace(annotation=hints.get(p.name, p.annotation)))
        names = [p.name for p in params]
        if len(set(names)) < len(names):
            raise TypeError(f"{command.__name__}: an option is declared twice")

        @functools.wraps(command)
        def wrapper(**kwargs):
            if first is not None:
                first(kwargs)
            for name, group in groups.items():
                kwargs[name] = group.build({n: kwargs.pop(n) for n in group.names()})
            return command(**kwargs)

        # typer reads the parameters from here (inspect.signature) and their types from
        # __annotations__ (typing.get_type_hints)
        wrapper.__signature__ = inspect.Signature(params)
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        return wrapper

    return wrap
