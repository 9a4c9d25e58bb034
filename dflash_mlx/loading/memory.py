"""A memory plan before loading: what a pair will need at its peak, against what the
machine can give, so an oversized pair is refused before any download or load.

Every figure here is an estimate, read from file headers and ``config.json`` (no weight is
read). Only the standard library at import; MLX is imported inside the functions that need it.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DFlashError
from .footprint import config_int, drafter_size, kv_cache_bytes, target_size, transient_bytes
from .rank_plan import for_rank
from .wired import _WIRED, decoding  # noqa: F401  (importable from here as before)

GB = 1e9
MAX_MEMORY_GB = 1e6  # a petabyte: past it a budget is a typo (and 1e300 overflows)
MAX_CONTEXT = 2**31 - 1  # tokens: past it no model has a context


def _metal_budget() -> int | None:
    """MLX's recommended working set on a Mac (Metal), or None off Metal."""
    if platform.system() != "Darwin":
        return None
    try:
        import mlx.core as mx

        if not mx.metal.is_available():
            return None
        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        size = int(info.get("max_recommended_working_set_size", 0))
    except (ImportError, AttributeError, RuntimeError, TypeError, ValueError):
        return None
    return size or None


def _meminfo_available(path: str = "/proc/meminfo") -> int | None:
    """MemAvailable from /proc/meminfo (Linux), in bytes, or None."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def device_budget(max_memory_gb: float | None = None) -> tuple[int, str]:
    """The bytes a pair may use on this machine, and where that number came from.

    Args:
        max_memory_gb: ``--max-memory`` in GB (10**9 bytes); when given it is the budget.

    Returns:
        (bytes, description): e.g. ``(22906503168, "Metal's recommended working set")``;
        ``(0, "unknown")`` when nothing can be measured.
    """
    if max_memory_gb is not None:  # at least a byte: 0 would mean "unknown", unchecked
        return max(1, int(max_memory_gb * GB)), f"--max-memory {max_memory_gb:g} GB"
    size = _metal_budget()
    if size:
        return size, "Metal's recommended working set (mx.device_info)"
    size = _meminfo_available()
    if size:
        return size, "MemAvailable in /proc/meminfo"
    return 0, "unknown"


# ----------------------------------------------------------------------------- the headers

DEFAULT_CONTEXT_CAP = 32768  # the context the plan assumes when none is given
WARN_SHARE = 0.85  # a plan above this share of the budget gets one warning line


def _cpu_backend() -> bool:
    """Whether MLX runs on its CPU backend (it dequantizes GGUF targets to float32)."""
    import mlx.core as mx

    return mx.default_device() == mx.cpu or not mx.metal.is_available()


@dataclass
class Plan:
    """What a pair will hold at its peak (bytes, estimated from headers and configs).

    Attributes:
        target, drafter: the weights (the drafter's with its draft-vocabulary head and, on
            the CPU, its exact 16-bit copies). kv: the target's KV cache (and recurrent
            states) at ``context``. draft_kv: the drafter's context cache.
            transient: the largest temporary of a decode. load_extra: what loading holds
            besides (a GGUF's float16 copy while the CPU casts it to float32).
        context: tokens the caches are sized for; context_note: where that came from.
        kv_bits: the KV cache's bits (None: the compute dtype).
    """

    target: int
    drafter: int
    kv: int
    draft_kv: int
    transient: int
    load_extra: int
    context: int
    context_note: str
    kv_bits: int | None = None
    fixed: dict = field(default_factory=dict)

    @property
    def peak(self) -> int:
        """Bytes at the peak: loading the target, or decoding at the full context."""
        return self.peak_with()

    def peak_with(self, target=None, kv=None, draft_kv=None) -> int:
        """The peak with other target weights or cache sizes (bytes; None: the plan's)."""
        target = self.target if target is None else target
        kv = self.kv if kv is None else kv
        draft_kv = self.draft_kv if draft_kv is None else draft_kv
        extra = self.load_extra * target / max(self.target, 1)
        return int(max(target + extra, target + self.drafter + kv + draft_kv + self.transient))

    def line(self) -> str:
        """The plan in one line (``-v``)."""
        kv = f"kv {_gb(self.kv)}" + (f" ({self.kv_bits}-bit)" if self.kv_bits else "")
        return (
            f"memory  ~{_gb(self.peak)} GB estimated: target {_gb(self.target)} + drafter "
            f"{_gb(self.drafter)} + {kv} + drafter cache {_gb(self.draft_kv)} at "
            f"{self.context} tokens ({self.context_note}) + transient {_gb(self.transient)} GB"
        )


def _gb(n: float) -> str:
    return f"{n / GB:.2f}" if n < 10 * GB else f"{n / GB:.1f}"


def choose_context(cfg: dict, max_context: int | None) -> tuple[int, str]:
    """(tokens the caches are sized for, why): ``max_context`` within the model's context,
    else the model's ``max_position_embeddings`` capped at ``DEFAULT_CONTEXT_CAP``."""
    model = config_int(cfg, "max_position_embeddings")
    if max_context is not None:
        if model and max_context > model:
            return model, f"the model's context; --max-context {max_context} is beyond it"
        return max_context, "--max-context"
    if not model:
        return DEFAULT_CONTEXT_CAP, "the model states none; --max-context sets it"
    if model > DEFAULT_CONTEXT_CAP:
        return DEFAULT_CONTEXT_CAP, f"of the model's {model}; --max-context sets it"
    return model, "the model's context"


def make_plan(target: Path, drafter: Path, max_context=None, kv=None, draft_bits=0) -> Plan:
    """The memory plan of a pair on disk, from its headers and configs (no weight read).

    Args:
        target: the target's directory or ``.gguf`` file. drafter: the drafter's directory.
            Either may be a ``footprint.Remote`` (a Hub repo before its download).
        max_context: tokens to size the caches for (None: see ``choose_context``).
        kv: a quantized KV cache, (kv_bits, kv_group_size, quantized_kv_start) as
            ``DecodeOptions.kv``; None: the compute dtype. Below the start the cache is
            not quantized; where it is converted, both copies are held for a moment.
        draft_bits: the drafter's layers quantized at load (``draft_quant``: 0, 4, 8;
            None: auto, 4 on a GPU beside a quantized target).
    """
    from .footprint import Remote

    cpu = _cpu_backend()
    target, drafter = (p if isinstance(p, Remote) else Path(p) for p in (target, drafter))
    size, cfg, dt, extra = target_size(target, cpu)
    context, note = choose_context(cfg, max_context)
    if draft_bits is None:  # auto (model/quantize.py's default_bits)
        draft_bits = 4 if not cpu and "quantization" in cfg else 0
    dsize, dkv = drafter_size(drafter, context, dt, cpu, draft_bits)
    bits, group, start = kv or (None, 64, 0)
    cache = kv_cache_bytes(cfg, context, dt, bits, group)
    if bits and start:
        held = min(context, start)
        both = kv_cache_bytes(cfg, held, dt, bits, group) if context > start else 0
        cache = max(cache, kv_cache_bytes(cfg, held, dt) + both)
    per_token = kv_cache_bytes(cfg, 1, dt, bits, group) + dkv / max(context, 1)
    kv8 = kv_cache_bytes(cfg, context, dt, 8, group)
    fixed = {"per_token": per_token, "kv8": kv8 if not bits else cache}
    transient = transient_bytes(cfg, context, dt, cpu)
    return Plan(size, dsize, cache, dkv, transient, extra, context, note, bits, fixed)


# ----------------------------------------------------------------------------- the check

_QUANT_BITS = {"4bit": 4.5, "mxfp8": 8.25, "8bit": 8.5, "bf16": 16.0}


def _fixes(plan: Plan, budget: int, quants: list[str], quant: str | None) -> list[str]:
    """The options that would each bring the plan within the budget, as typed."""
    from ..settings import GenerationConfig

    fixes = []
    now = _QUANT_BITS.get(quant or (quants[0] if quants else ""), 0)
    for q in sorted(quants, key=lambda q: -_QUANT_BITS.get(q, 99)):
        bits = _QUANT_BITS.get(q, 99)
        if now and bits < now and plan.peak_with(target=plan.target * bits / now) <= budget:
            fixes.append(f"--quant {q}")
            break
    kv8 = plan.fixed.get("kv8", plan.kv)  # quantized from the first token
    flags = GenerationConfig.__dataclass_fields__
    if "kv_bits" in flags and not plan.kv_bits and plan.peak_with(kv=kv8) <= budget:
        start = " --quantized-kv-start 0" if "quantized_kv_start" in flags else ""
        fixes.append("--kv-bits 8" + start)
    per = plan.fixed.get("per_token", 0)
    if per and plan.peak_with(kv=0, draft_kv=0) < budget:
        tokens = int((budget - plan.peak_with(kv=0, draft_kv=0)) / per) // 1024 * 1024
        if tokens >= 1024:
            fixes.append(f"--max-context {min(tokens, plan.context)}")
    return fixes


def check(plan: Plan, budget: int, where: str, quants=(), quant=None) -> str | None:
    """Refuse a plan beyond the budget; a warning line when it is close to it.

    Args:
        plan: the pair's plan. budget, where: ``device_budget``'s answer.
        quants: an alias's quantisations (for a smaller one to suggest). quant: the one asked.

    Returns:
        a ``warning:`` line when the plan takes more than 85% of the budget, else None.

    Raises:
        DFlashError: the plan exceeds the budget, naming the numbers and what would fit.
    """
    if budget <= 0:
        return None
    need = f"~{_gb(plan.peak)} GB (estimated, at {plan.context} tokens of context)"
    have = f"{_gb(budget)} GB ({where})"
    if plan.peak > budget:
        fixes = _fixes(plan, budget, list(quants), quant)
        fix = "try " + " or ".join(fixes) if fixes else "use a smaller model or more memory"
        raise DFlashError(f"this pair needs {need}, more than the {have} available; {fix}")
    if plan.peak > WARN_SHARE * budget:
        return (
            f"warning: this pair needs {need}, {plan.peak / budget:.0%} of the {have} "
            "available; expect swapping"
        )
    return None


def _source(name: str, offline: bool):
    """What the plan reads for a target or drafter: its complete local copy, else (online,
    a Hub id) what the Hub says before a download; None when neither is there."""
    from . import hub
    from .footprint import complete, remote

    p = offline_path(name)
    if p is not None and complete(p):
        return p
    if offline or not hub.is_hub_id(str(name)):
        return None
    try:
        return remote(str(name))
    except Exception:  # noqa: BLE001 (the Hub unreachable or odd: the plan waits for the files)
        return None


def offline_path(name: str) -> Path | None:
    """A local path for a directory, a ``.gguf`` file or a cached Hub repo; never touches
    the network; None when it would have to be downloaded."""
    from . import hub

    p = Path(os.path.expanduser(str(name)))
    if p.exists():
        return p
    return hub.cached(str(name)) if hub.is_hub_id(str(name)) else None


class Fit:
    """``load``'s memory plan: made and checked before any download (from the files here,
    or online from the Hub's sizes and ``config.json``), else before any load.

    Args:
        res: ``loader.resolve``'s answer. quant: ``--quant``. max_memory: GB (None: the
            device's budget). max_context: tokens (None: see ``choose_context``).
        kv: (kv_bits, kv_group_size, quantized_kv_start) the estimate counts, or None.
        offline: never ask the Hub (the plan waits until the files are here). bits: as
            ``make_plan``'s ``draft_bits``. shard: (size, rank, mode): one rank's plan.

    Raises:
        DFlashError: a bad limit, or a pair that does not fit."""

    def __init__(
        self,
        res,
        quant,
        max_memory=None,
        max_context=None,
        kv=None,
        offline=True,
        bits=0,
        shard=None,
    ):
        check_limits(max_memory, max_context, kv=kv)
        entry = res.entry
        self.quants = (list(entry.targets), quant) if entry and not entry.local else ((), None)
        self.limits = (max_memory, max_context, kv, bits, shard)
        self.plan, self.warning = None, None
        self.check(res.target, res.drafters[0], offline=offline)

    def check(self, target, drafter, notes=None, offline=True) -> None:
        """Make and check the plan unless done; say a warning through ``notes`` once.

        Args:
            target, drafter: paths or Hub ids (a Hub id not in the cache: not yet).
            notes: callable(str) for the warning line, or None. offline: no Hub request.
        """
        if self.plan is None:
            tpath, dpath = _source(target, offline), _source(drafter, offline)
            if tpath is None or dpath is None:
                return
            max_memory, max_context, kv, bits, shard = self.limits
            try:
                self.plan = for_rank(make_plan(tpath, dpath, max_context, kv, bits), tpath, shard)
            except (OSError, ValueError, KeyError, TypeError, AttributeError, DFlashError):
                return  # a damaged file: loading it names the problem
            budget, where = device_budget(max_memory)
            self.warning = check(self.plan, budget, where, *self.quants)
        if self.warning and notes is not None:
            notes(self.warning)
            self.warning = None

    def cap(self, pair) -> None:
        """Make ``max_context`` the loaded pair's context (prompts and answers fit in it)."""
        from ..decoding.prompt import context_length

        limit = self.limits[1]
        if limit is None or (context_length(pair) or limit + 1) <= limit:
            return
        try:
            pair.target.args.max_position_embeddings = limit
        except AttributeError:  # a model without args: its context stays the model's
            pass


def check_limits(max_memory, max_context, flags: bool = False, kv=None) -> None:
    """The one check of ``max_memory`` (GB, > 0, finite, at most ``MAX_MEMORY_GB``),
    ``max_context`` (tokens, 1 to ``MAX_CONTEXT``) and ``load``'s ``kv``.

    Args:
        max_memory, max_context: the values, or None. flags: name them as command-line flags.
        kv: (kv_bits, kv_group_size, quantized_kv_start) or None.

    Raises:
        DFlashError: one line naming the setting, the value and the fix.
    """
    import math
    from numbers import Integral, Real

    mem, ctx = ("--max-memory", "--max-context") if flags else ("max_memory", "max_context")
    sep = " " if flags else "="
    if max_memory is not None and (
        isinstance(max_memory, bool)
        or not isinstance(max_memory, Real)
        or not math.isfinite(max_memory)
        or not 0 < max_memory <= MAX_MEMORY_GB
    ):
        raise DFlashError(
            f"{mem} must be a positive number of GB, at most {MAX_MEMORY_GB:g} (got "
            f"{max_memory!r}); e.g. {mem}{sep}16, or leave it out to use what the device reports"
        )
    if max_context is not None and (
        isinstance(max_context, bool)
        or not isinstance(max_context, Integral)
        or not 1 <= max_context <= MAX_CONTEXT
    ):
        raise DFlashError(
            f"{ctx} must be a positive number of tokens, at most {MAX_CONTEXT} (got "
            f"{max_context!r}); e.g. {ctx}{sep}8192"
        )
    check_kv(kv)


def check_kv(kv) -> None:
    """Refuse a ``load(kv=...)`` that is not (kv_bits, kv_group_size, quantized_kv_start)
    with values ``GenerationConfig`` accepts.

    Raises:
        DFlashError: one line naming kv, the value and the fix.
    """
    from numbers import Integral

    from ..settings import KV_BITS, KV_GROUP_SIZES

    if kv is None:
        return
    ints = isinstance(kv, (tuple, list)) and len(kv) == 3
    ints = ints and all(isinstance(v, Integral) and not isinstance(v, bool) for v in kv)
    if not (ints and kv[0] in KV_BITS and kv[1] in KV_GROUP_SIZES and kv[2] >= 0):
        raise DFlashError(
            f"kv must be (kv_bits, kv_group_size, quantized_kv_start) with kv_bits 4 or 8, "
            f"kv_group_size 32, 64 or 128 and quantized_kv_start 0 or more (got {kv!r}); "
            "e.g. kv=(8, 64, 0), or None for a full-precision cache"
        )
