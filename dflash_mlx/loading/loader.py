"""The one way to a loaded pair: ``load`` takes a registry alias, a Hub id, a local directory
or a ``.gguf`` file, finds the drafter, fetches what is missing, checks that the two fit
each other (docs/format.md §4), and returns ``(model, tokenizer)``.

``resolve`` decides where things come from without any I/O on the Hub; ``hub.fetch`` brings
Hub repos into the cache; ``read_dflash_json`` is the one reader of a target's drafter hint.
Heavy imports (MLX, mlx-lm) happen inside ``load``, so the command line can import this
module and stay fast.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .. import distributed
from ..distributed import handshake, link, policy
from ..errors import LOAD_ERRORS, DFlashError, IncompatibleDrafterError, load_failed
from ..model.config import check_target_config, parse_draft_quant
from . import backend, hub, memory, registry
from .vocab import set_draft_vocab

if TYPE_CHECKING:
    from ..decoding.state import DFlashModel

DFLASH_JSON = "dflash.json"


@dataclass
class Resolved:
    """What ``resolve`` decided: where the target comes from and which drafters to try.

    Attributes:
        target: a local directory, a ``.gguf`` file or a Hub id. drafters: directories or
            Hub ids, tried in order. display_name: what to call the pair. entry: the
            registry row, if any. block_size: the drafter's block when the registry knows it.
    """

    target: str
    drafters: list[str]
    display_name: str
    entry: registry.Entry | None = None
    block_size: int | None = None
    notes: list[str] = field(default_factory=list)


def _missing_path(name: str, what: str) -> DFlashError:
    return DFlashError(
        f"{what} '{name}' is neither a local directory nor a Hub id (owner/name): it does not "
        "exist; check the path"
    )


def _looks_like_path(s: str) -> bool:
    return s.startswith((".", "/", "~")) or s.count("/") > 1 or (os.sep in s and os.sep != "/")


def _is_gguf(p: Path) -> bool:
    return p.suffix.lower() == ".gguf" and not p.is_dir()


def read_dflash_json(directory: Path) -> str | None:
    """The drafter named by ``directory/dflash.json`` (``{"dflash_drafter": "<dir>"}``,
    relative to directory), or None when there is no such file.

    Args:
        directory: a target model's directory.

    Raises:
        DFlashError: the file is not valid JSON or lacks a string ``dflash_drafter``.
    """
    hint = Path(directory) / DFLASH_JSON
    if not hint.is_file():
        return None
    try:
        drafter = json.loads(hint.read_text()).get("dflash_drafter")
    except (ValueError, AttributeError):  # not JSON, or JSON that is not an object
        drafter = None
    if not isinstance(drafter, str) or not drafter:
        raise DFlashError(
            f"{hint} is not valid (needs a 'dflash_drafter' entry); fix it or pass --drafter"
        )
    return str(Path(directory) / drafter)


def _installed(path: Path) -> bool:
    if _is_gguf(path):
        return path.is_file()
    return path.is_dir() and any(path.glob("*.safetensors"))


def _resolve_alias(entry: registry.Entry, drafter: str | None, quant: str | None):
    if entry.local:
        if quant is not None:
            raise DFlashError(f"--quant does not apply to the {entry.alias} model; drop it")
        needed = [Path(entry.target())] + ([] if drafter else [Path(entry.drafters[0])])
        missing = [p for p in needed if not _installed(p)]
        if missing and missing[0] == needed[0] and entry.install:
            raise DFlashError(
                f"the {entry.alias} model's target is not installed ({needed[0].name}); "
                f"run `{entry.install}`"
            )
        if missing:
            raise DFlashError(
                f"the {entry.alias} model is not installed ({missing[0]} is missing); "
                f"reinstall dflash-mlx or set {registry.DEMO_ENV} to a directory with target/ "
                "and drafter/"
            )
    drafters = [drafter] if drafter else list(entry.drafters)
    return Resolved(entry.target(quant), drafters, entry.alias, entry, entry.block_size)


def _resolve_target(model: str) -> tuple[str, str]:
    """(target, display name) for a Hub id, a directory or a .gguf file."""
    p = Path(os.path.expanduser(model))
    if p.is_dir():
        return str(p), registry.repo_name(model)
    if p.is_file() and _is_gguf(p):
        return str(p), p.stem
    if p.exists():
        raise DFlashError(f"model path {model} is a file; pass the model's directory or a .gguf")
    if hub.is_hub_id(model):
        return model, model
    if _looks_like_path(model):
        raise _missing_path(model, "model")
    near = registry.suggest(model)
    hint = f"did you mean {' or '.join(near)}? " if near else ""
    raise DFlashError(
        f"unknown model alias '{model}'; {hint}run `dflash models` for the list, or pass "
        "a Hub id (owner/name) or a local directory"
    )


def resolve(model: str, drafter: str | None = None, quant: str | None = None) -> Resolved:
    """Turn a model name, a drafter and a quantisation into a target and an ordered list of
    drafters (no I/O on the Hub).

    The drafter is ``drafter`` when given, else the alias's, else the one a ``dflash.json``
    next to the target names, else that of the registry entry whose target has the same name.

    Args:
        model: a registry alias, a Hub id, a local directory or a ``.gguf`` file.
        drafter: a drafter directory or Hub id, or None. quant: an alias's quantisation.

    Raises:
        DFlashError: unknown alias (with suggestions), missing path, bad quant, no drafter.
    """
    if not model or not str(model).strip():
        raise DFlashError(
            "--model is empty; pass an alias (see `dflash models`), a Hub id or a directory"
        )
    model = str(model).strip()
    if drafter is not None and not str(drafter).strip():
        raise DFlashError("--drafter is empty; pass a drafter directory or Hub id, or drop it")
    entry = registry.find(model)
    if entry is not None:
        return _resolve_alias(entry, drafter, quant)
    target, display = _resolve_target(model)
    if quant is not None:
        raise DFlashError(
            "--quant only applies to registry aliases; pass the exact Hub id of the quantised "
            f"model instead of {model}"
        )
    match = registry.entry_for_target(target)
    if not drafter and Path(target).is_dir():
        drafter = read_dflash_json(Path(target))
    if drafter:
        drafters = [drafter]
    elif match is not None:
        drafters = list(match.drafters)
    else:
        raise DFlashError(
            f"no drafter known for {model}; pass --drafter <directory or Hub id> (drafter= in "
            "Python; `dflash models` lists the known pairs)"
        )
    return Resolved(target, drafters, display, match, match.block_size if match else None)


def locate(name: str, what: str, offline: bool | None, quiet: bool, log) -> Path:
    """A local path for a directory, a ``.gguf`` target or a Hub id (fetched if needed).

    Args:
        name: the path or Hub id. what: 'model' or 'drafter'. offline, quiet, log: as for
            ``hub.fetch``.
    """
    p = Path(os.path.expanduser(str(name)))
    if p.is_dir() or (what == "model" and p.is_file() and _is_gguf(p)):
        return p
    if p.exists():
        raise DFlashError(f"{what} path {name} is a file; pass the {what}'s directory")
    if not hub.is_hub_id(str(name)):
        raise _missing_path(str(name), what)
    return hub.fetch(str(name), what, offline=offline, quiet=quiet, log=log)


def _locate_drafter(names: list[str], offline, quiet, log) -> tuple[str, Path]:
    """The first drafter that can be found or fetched: (its name, its directory)."""
    errors = []
    for name in names:
        try:
            return name, locate(name, "drafter", offline, quiet, log)
        except DFlashError as e:
            errors.append(str(e))
    if len(errors) == 1:
        raise DFlashError(errors[0])
    raise DFlashError(f"{errors[0]} (also tried {', '.join(names[1:])})")


def check_compatible(adapter, drafter, drafter_name: str = "drafter") -> None:
    """Fail with one line when the drafter does not fit the target.

    Args:
        adapter: TargetAdapter of the target. drafter: DFlashDrafter.
    """
    a = drafter.args
    n = adapter.num_layers
    fix = "use the drafter made for this target"
    bad = [i for i in a.target_layer_ids if not 0 <= i < n]
    if bad:
        raise IncompatibleDrafterError(
            f"{drafter_name} reads target layers {bad}, but the target has {n} layers; {fix}"
        )
    if a.num_target_layers is not None and a.num_target_layers != n:
        raise IncompatibleDrafterError(
            f"{drafter_name} was made for a {a.num_target_layers}-layer target, this target has "
            f"{n}; {fix}"
        )
    H = adapter.hidden_size
    if a.hidden_size != H:
        raise IncompatibleDrafterError(
            f"{drafter_name} hidden size {a.hidden_size} does not match the target's {H}; {fix}"
        )
    V = adapter.vocab_size
    if a.vocab_size != V:
        raise IncompatibleDrafterError(
            f"{drafter_name} vocabulary {a.vocab_size} does not match the target's {V}; {fix}"
        )


def _notices(quiet: bool, log: Callable[[str], None] | None):
    """Where one-time notices go: log, else stderr; nowhere (a no-op) when quiet."""
    if quiet:
        return lambda _: None
    return log or (lambda msg: print(msg, file=sys.stderr, flush=True))


def _load_target(path: Path, name: str, tokenizer_config: dict | None, log=None, lazy=False):
    """(mlx-lm model, tokenizer) from an mlx-lm directory or a llama-family .gguf file;
    lazy: under a group, no weight read yet (sharding reads only the rank's own,
    ``distributed.shard``; a vision-language model is refused there)."""
    backend.install()  # the backend's ops before any layer is wrapped (a no-op but on Linux)
    if _is_gguf(path):
        from .gguf import load_gguf

        model, tokenizer, _ = load_gguf(path, log=log)
        return model, tokenizer
    from mlx_lm.utils import load as mlx_load

    if not (path / "config.json").is_file():
        raise DFlashError(f"model directory {path} has no config.json; point to an mlx-lm model")
    try:
        params = json.loads((path / "config.json").read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise DFlashError(
            f"model config {path / 'config.json'} is not valid JSON ({e}); "
            "fix it or re-download the model"
        ) from None
    check_target_config(params, path / "config.json")
    from ..vision import loader as vision

    if vision.is_vlm(params):  # mlx-vlm's model, imported only now
        return vision.load_vlm(path, params, tokenizer_config, grouped=lazy)
    try:
        return mlx_load(str(path), tokenizer_config=tokenizer_config or {}, lazy=lazy)
    except LOAD_ERRORS as e:
        raise load_failed(e, f"model {name} from {path}", "mlx-lm") from None


def load_target(model: str, offline: bool | None = None, quiet: bool = False):
    """Only the target (no drafter): for training a drafter, or plain mlx-lm decoding.

    Args:
        model: a registry alias (its default target), a Hub id, a local mlx-lm directory or
            a ``.gguf`` file. offline, quiet: as for ``load``.

    Returns:
        (mlx-lm model, tokenizer).
    """
    entry = registry.find(str(model).strip())
    target, name = (entry.target(), entry.alias) if entry else _resolve_target(str(model))
    path = locate(target, "model", hub.offline_mode(offline), quiet, None)
    return _load_target(path, name, None, _notices(quiet, None))


def _assemble(target, tpath: Path, dname: str, dpath: Path, name: str, bits, notes) -> DFlashModel:
    """The pair (the drafter in the target's dtype), checked to fit; its notes to ``notes``."""
    import mlx.core as mx

    from ..decoding.state import DFlashModel
    from ..model.checkpoint import load_drafter
    from ..model.target import TargetAdapter

    emb = getattr(target, "language_model", target).model.embed_tokens
    draft = load_drafter(dpath, dtype=emb(mx.array([[0]])).dtype, quant=(bits, target))
    adapter = TargetAdapter(target, [])
    check_compatible(adapter, draft, f"drafter {dname}")
    adapter.tap(draft.args.target_layer_ids)
    return DFlashModel(target, draft, adapter, str(tpath), str(dpath), name, notes=notes)


def _pair(res, paths, bits, notes, tokenizer_config, group, shard):
    """``load``'s (DFlashModel, tokenizer) from the located ``paths`` (target, drafter name,
    drafter), the target sharded over ``group`` by ``shard`` before any wrapper of ours (a
    group's target loads lazily: each rank reads only the weights it keeps)."""
    (tpath, dname, dpath), name = paths, res.display_name
    target, tokenizer = _load_target(tpath, name, tokenizer_config, notes, group is not None)
    mode = distributed.shard(target, group, shard)
    link.from_env(group)  # the benchmark's test hook (DFLASH_TEST_LINK_DELAY_MS), if set
    pair = _assemble(target, tpath, dname, dpath, name, bits, notes)
    distributed.connect(pair, group, mode)
    pair.group, pair.group_info = group, distributed.describe(group, mode)
    pair.tokenizer = tokenizer  # the tokenizer passes with its pair (inputs.check_tokenizer)
    return pair, tokenizer


def load(
    model: str,
    drafter: str | None = None,
    *,
    quant: str | None = None,
    offline: bool | None = None,
    quiet: bool = False,
    log: Callable[[str], None] | None = None,
    tokenizer_config: dict | None = None,
    warmup: bool = False,
    draft_vocab: int | None = None,
    max_memory: float | None = None,
    max_context: int | None = None,
    kv: tuple[int, int, int] | None = None,
    draft_quant: int | str | None = None,
    group=None,
    shard: str | None = None,
) -> tuple[DFlashModel, object]:
    """Load a target model and its DFlash drafter.

    Args:
        model: a registry alias (``dflash models``), a Hub id, a local mlx-lm or
            vision-language directory, or a llama-family ``.gguf`` file.
        drafter: drafter directory or Hub id (default: ``resolve``'s, tried in order).
        quant: an alias's target quantisation (4bit, 8bit, bf16, mxfp8). offline: never
            touch the network (default: the environment, ``hub.offline_mode``).
        quiet: no download notices or progress bars. log: callable(str) for notices
            (default: stderr). tokenizer_config: for mlx-lm's tokenizer loader.
        warmup: set the ``block_size="auto"`` step costs now (``warmup.ensure``); False: at
            the first ``auto`` request, so a fixed block size never pays for them.
        draft_vocab: the drafter's vocabulary (docs/algorithm.md §2.4): None the
            checkpoint's own (else the full vocabulary); 0 the full vocabulary; N the N most
            frequent ids by the tokenizer's merge ranks (plus its special tokens).
        max_memory, max_context, kv: the memory plan's limits and KV cache (``memory.Fit``).
        draft_quant: the drafter's layers: 4 / 8 bits, "none", "auto" (None; format.md §2.5).
        group, shard: a ``Group`` to shard over (None: mlx.launch's), "tensor" / "pipeline".

    Returns:
        (DFlashModel, tokenizer): ``model.target`` is the mlx-lm model, ``model.drafter``
        the drafter, ``model.name`` the alias, Hub id or directory name. Raises
        ``DFlashError``: one line naming the problem and the fix.
    """
    group = distributed.group(group)
    with handshake.told(group):  # a rank that fails here is named by every rank
        bits = parse_draft_quant(draft_quant)  # before any I/O
        distributed.check_shard(shard)
        res, offline = resolve(model, drafter, quant), hub.offline_mode(offline)
        ranks = distributed.plan_shard(group, shard)
        fit = memory.Fit(res, quant, max_memory, max_context, kv, offline, bits, ranks)
        notes = _notices(quiet, log)
        tpath = locate(res.target, "model", offline, quiet, log)
        dname, dpath = _locate_drafter(res.drafters, offline, quiet, log)
    handshake.check(group, (tpath, dpath))  # ranks started alike, or one error on each
    fit.check(tpath, dpath, notes)  # before loading (before downloading: in Fit, if it can)
    pair, tokenizer = _pair(res, (tpath, dname, dpath), bits, notes, tokenizer_config, group, shard)
    fit.cap(pair)
    set_draft_vocab(pair, tokenizer, draft_vocab)
    if warmup:  # the auto step costs now, on the same path on every rank
        policy.ensure(pair, group)
    return pair, tokenizer
