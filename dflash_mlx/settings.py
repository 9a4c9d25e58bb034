"""Decoding settings: one typed object, checked in one place.

The Python API, ``dflash run`` / ``chat`` / ``serve`` / ``bench`` and the HTTP server all build
a ``GenerationConfig`` and call ``validate``; their defaults are its field defaults (and
``MAX_TOKENS`` per command). Error messages name the setting the way the user spelled it: the
flag on the command line (``--temp``), the field name in Python and JSON (``temperature``);
``OPTIONS`` is the table of those flags, which every command declares from.
No MLX here: the command line imports this module before anything heavy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from numbers import Integral, Real

from .errors import DFlashError

SEED_MAX = 2**32 - 1  # seeds are 0 .. 2**32 - 1
AUTO = "auto"  # block_size chosen per cycle by the scheduler (schedule.py)
# KV-cache quantization: the bits and group sizes offered, mlx-lm's defaults (generate.py).
KV_BITS, KV_GROUP_SIZES = (4, 8), (32, 64, 128)
KV_GROUP_SIZE, QUANTIZED_KV_START = 64, 5000

# max_tokens when the user gives none, per entry point; "api" is the field default.
MAX_TOKENS = {"api": 256, "run": 256, "chat": 1024, "serve": 512, "bench": 128}


class SettingError(DFlashError):
    """A decoding setting that is out of range or of the wrong type.

    Attributes:
        field: the ``GenerationConfig`` field at fault (the server reports it as ``param``).
    """

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class GenerationConfig:
    """How to decode one completion; mlx-lm's names where mlx-lm has the setting.

    Attributes:
        max_tokens: tokens to generate (>= 1).
        temperature: 0 is greedy (token for token the target's output); else > 0.
        top_p, top_k, min_p: mlx-lm's sampling filters; 1.0, 0 and 0.0 turn them off.
        presence_penalty, frequency_penalty: in [-2, 2], 0 is off. repetition_penalty:
            > 0 or None (off). logit_bias: token id -> bias in [-100, 100]. All applied
            exactly at every block position, so sampling stays lossless.
        block_size: tokens per verify cycle: "auto" (the default) chooses each cycle's block,
            plain decoding included, from measured costs and live acceptance; None is the
            drafter checkpoint's block; an int in 2 .. the checkpoint's is fixed.
        use_selector: walk the DFlash 2 path selector; False drafts each row's top token.
        lookup: also verify drafts copied from the context (after the latest earlier
            occurrence of the committed tokens' last n-gram) when they are expected to pay.
        tree: also verify the drafter's next-best first tokens beside its path (a tree in
            one verify, ``tree.py``) on targets that can, without logits processors; False:
            the path alone.
        seed: 0 .. 2**32 - 1 makes sampling reproducible; None draws a fresh one.
        stop: strings that end the completion (not included in the text).
        kv_bits: quantize the target's attention caches to 4 or 8 bits through mlx-lm's
            ``QuantizedKVCache`` (None: full precision); lossless against the target decoding
            alone with the same quantization. kv_group_size: 32, 64 or 128 (mlx-lm's).
            quantized_kv_start: the cache length from which it is quantized (mlx-lm's).
    """

    max_tokens: int = MAX_TOKENS["api"]
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    block_size: int | str | None = AUTO
    use_selector: bool = True
    lookup: bool = True
    tree: bool = True
    seed: int | None = None
    stop: str | list[str] | None = None
    kv_bits: int | None = None
    kv_group_size: int = KV_GROUP_SIZE
    quantized_kv_start: int = QUANTIZED_KV_START

    def validate(
        self, max_block_size: int | None = None, *, flags: bool = False
    ) -> GenerationConfig:
        """Check every setting; return self.

        Args:
            max_block_size: the drafter checkpoint's block size, when it is known yet.
            flags: name settings by their command-line flags in messages.

        Raises:
            SettingError: one line naming the setting, the bad value and the fix.
        """
        c = _Checker(flags)
        c.integer("max_tokens", self.max_tokens, 1, None, "must be at least 1")
        c.number("temperature", self.temperature, "use 0 for greedy decoding", lo=0)
        c.number("top_p", self.top_p, "use 1.0 to turn it off", lo=0, hi=1, open_lo=True)
        c.integer("top_k", self.top_k, 0, None, "must be >= 0", "; use 0 to turn it off")
        c.number("min_p", self.min_p, "use 0 to turn it off", lo=0, hi=1)
        c.number("presence_penalty", self.presence_penalty, "use 0 to turn it off", lo=-2, hi=2)
        c.number("frequency_penalty", self.frequency_penalty, "use 0 to turn it off", lo=-2, hi=2)
        if self.repetition_penalty is not None:
            c.number(
                "repetition_penalty",
                self.repetition_penalty,
                "leave it unset to turn it off",
                lo=0,
                open_lo=True,
            )
        c.logit_bias(self.logit_bias)
        check_block_size(self.block_size, max_block_size, flags)
        c.boolean("use_selector", self.use_selector)
        c.boolean("lookup", self.lookup)
        c.boolean("tree", self.tree)
        if self.seed is not None:
            c.integer("seed", self.seed, 0, SEED_MAX, f"must be in 0..{SEED_MAX}")
        c.stop(self.stop)
        c.kv(self.kv_bits, self.kv_group_size, self.quantized_kv_start)
        return self


def check_block_size(value, checkpoint: int | None, flags: bool = False) -> None:
    """The one check of a block size: "auto", None (the checkpoint's) or an int in
    2..checkpoint.

    Args:
        value: the setting. checkpoint: the drafter's block size, or None when not loaded.
        flags: phrase the message for the command line.

    Raises:
        SettingError: out of range or not an integer.
    """
    if value is None or value == AUTO:
        return
    name = FLAGS["block_size"] if flags else "block_size"
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise SettingError(f"{name} must be an integer or {AUTO!r} (got {value!r})", "block_size")
    if flags and value < 2:
        raise SettingError(f"{name} must be at least 2 (got {value})", "block_size")
    if checkpoint is None:
        if value < 2:
            raise SettingError(f"{name} must be at least 2 (got {value})", "block_size")
        return
    if flags and value > checkpoint:
        raise SettingError(
            f"{name} {value} is larger than this drafter's block of {checkpoint}; "
            f"use 2..{checkpoint}",
            "block_size",
        )
    if not 2 <= value <= checkpoint:
        raise SettingError(
            f"block size {value} is out of range; this drafter supports 2..{checkpoint}",
            "block_size",
        )


def _shown(v) -> str:
    """A value as messages quote it: short, even for an integer of thousands of digits."""
    try:
        text = str(v)
    except ValueError:  # Python refuses to print integers over 4300 digits
        return f"an integer of {v.bit_length()} bits"
    return text if len(text) <= 40 else text[:37] + "..."


class _Checker:
    """Range and type checks that phrase one-line messages with the user's name for a field."""

    def __init__(self, flags: bool):
        self.flags = flags

    def name(self, field: str) -> str:
        return FLAGS.get(field, field) if self.flags else field

    def fail(self, field: str, message: str):
        raise SettingError(f"{self.name(field)} {message}", field)

    def number(self, field, v, fix, lo=None, hi=None, open_lo=False) -> None:
        if isinstance(v, bool) or not isinstance(v, Real):
            self.fail(field, f"must be a number (got {v!r})")
        try:
            finite = math.isfinite(v)
        except OverflowError:  # an integer beyond any float (JSON allows them)
            finite = False
        if not finite:
            self.fail(field, f"must be a finite number (got {_shown(v)})")
        if hi is not None and not (lo < v <= hi if open_lo else lo <= v <= hi):
            left = "(" if open_lo else "["
            self.fail(field, f"must be in {left}{lo:g}, {hi:g}] (got {_shown(v)}); {fix}")
        if hi is None and not (v > lo if open_lo else v >= lo):
            self.fail(field, f"must be {'>' if open_lo else '>='} {lo:g} (got {_shown(v)}); {fix}")

    def integer(self, field, v, lo, hi, rule, fix="") -> None:
        if isinstance(v, bool) or not isinstance(v, Integral):
            self.fail(field, f"must be an integer (got {v!r})")
        if v < lo or (hi is not None and v > hi):
            self.fail(field, f"{rule} (got {_shown(v)}){fix}")

    def boolean(self, field, v) -> None:
        if not isinstance(v, bool):
            self.fail(field, f"must be true or false (got {v!r})")

    def logit_bias(self, bias) -> None:
        if bias is None:
            return
        if not isinstance(bias, dict):
            self.fail("logit_bias", f"must map token ids to numbers (got {bias!r})")
        for tid, v in bias.items():
            if isinstance(tid, bool) or not isinstance(tid, Integral) or tid < 0:
                self.fail("logit_bias", f"keys must be token ids (got {tid!r})")
            self.number("logit_bias", v, "-100 bans a token", lo=-100, hi=100)

    def kv(self, bits, group, start) -> None:
        if bits is not None:
            self.integer("kv_bits", bits, 0, None, "")
            if bits not in KV_BITS:
                self.fail(
                    "kv_bits",
                    f"must be 4 or 8 (got {bits}); leave it unset for a full-precision cache",
                )
        self.integer("kv_group_size", group, 0, None, "")
        if group not in KV_GROUP_SIZES:
            self.fail("kv_group_size", f"must be 32, 64 or 128 (got {_shown(group)})")
        self.integer("quantized_kv_start", start, 0, None, "must be >= 0")

    def stop(self, stop) -> None:
        if stop is None or isinstance(stop, str):
            return
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            self.fail("stop", f"must be a string or a list of strings (got {stop!r})")


def parse_block_size(text: str | None):
    """A block size as typed on a command line: "auto", an integer, or None; anything else
    is returned as-is for ``check_block_size`` to reject with the flag's name."""
    if text is None:
        return None
    t = str(text).strip().lower()
    if t == AUTO:
        return AUTO
    try:
        return int(t)
    except ValueError:
        return text


@dataclass(frozen=True)
class Flag:
    """The command-line option of one ``GenerationConfig`` field.

    Attributes:
        field: the field it sets. name: the flag as typed. help: its help text.
        kind: the type typed on the command line. short: a one-letter alias, if any.
        negate: a switch that turns the field off (``--no-tree`` sets ``tree=False``).
    """

    field: str
    name: str
    help: str
    kind: type = float
    short: str | None = None
    negate: bool = False

    @property
    def default(self):
        """The flag's default: the field's, as typed (a switch that negates is off)."""
        default = next(f.default for f in fields(GenerationConfig) if f.name == self.field)
        return not default if self.negate else default

    def value(self, typed):
        """The field's value for what was typed."""
        if self.negate:
            return not typed
        return parse_block_size(typed) if self.field == "block_size" else typed


# The decoding options of ``dflash run`` / ``chat`` / ``serve`` / ``bench``, in help order.
OPTIONS = (
    Flag("max_tokens", "--max-tokens", "Tokens to generate.", int, short="-m"),
    Flag("temperature", "--temp", "Sampling temperature (0 = greedy)."),
    Flag("top_p", "--top-p", "Nucleus sampling (1 = off)."),
    Flag("top_k", "--top-k", "Top-k sampling (0 = off).", int),
    Flag("min_p", "--min-p", "Min-p sampling (0 = off)."),
    Flag("presence_penalty", "--presence-penalty", "Presence penalty."),
    Flag("seed", "--seed", "PRNG seed for sampling, 0..2**32-1.", int),
    Flag(
        "block_size",
        "--block-size",
        "Tokens per verify: auto (each cycle's block chosen from measured costs and live "
        "acceptance, plain decoding when drafting cannot pay) or a fixed 2..the drafter's block.",
        str,
    ),
    Flag(
        "use_selector",
        "--no-selector",
        "Draft each position's top token (DFlash 1 behaviour).",
        bool,
        negate=True,
    ),
    Flag(
        "lookup",
        "--no-lookup",
        "Verify only the drafter's drafts, never ones copied from the context.",
        bool,
        negate=True,
    ),
    Flag(
        "tree",
        "--no-tree",
        "Verify the drafter's path alone, without the siblings of its first draft.",
        bool,
        negate=True,
    ),
    Flag(
        "kv_bits",
        "--kv-bits",
        "Quantize the target's KV cache to 4 or 8 bits (mlx-lm's QuantizedKVCache; "
        "default: full precision).",
        int,
    ),
    Flag("kv_group_size", "--kv-group-size", "Group size of the KV quantization.", int),
    Flag(
        "quantized_kv_start",
        "--quantized-kv-start",
        "Cache length (tokens) from which the KV cache is quantized.",
        int,
    ),
)

# The flag that carries each field's value, for messages (a negating switch carries none).
FLAGS = {f.field: f.name for f in OPTIONS if not f.negate}


SHUTDOWN_GRACE = 5.0  # seconds in-flight requests get to finish after SIGTERM / Ctrl-C
MAX_SHUTDOWN_GRACE = 3600.0  # an hour; a timer's wait overflows far past it


@dataclass(frozen=True)
class ServerConfig:
    """Who may call ``dflash serve`` from a web page, how it stops, what images it takes.

    Attributes:
        allow_origins: web origins (``scheme://host[:port]``, or "*" for any page) whose
            pages may call the server from a browser; requests from other origins get a 403.
        shutdown_grace: seconds (0 .. 3600) in-flight requests get to finish after SIGTERM or
            Ctrl-C before the rest are ended with a 503 or their stream's error event.
        allow_image_urls: fetch http(s) image URLs (off: ``data:`` URLs and base64 only).
            image_limits: a ``vision.images.ImageLimits`` (None: its defaults).
    """

    allow_origins: tuple[str, ...] = ()
    shutdown_grace: float = SHUTDOWN_GRACE
    allow_image_urls: bool = False
    image_limits: object = None

    def validate(self, *, flags: bool = False) -> ServerConfig:
        """Check the grace and origins; return a copy with the origins normalized (lower case,
        no trailing '/'). Args: flags: name settings by their flags in messages. Raises:
        SettingError: one line naming the setting, the bad value and the fix."""
        g = self.shutdown_grace
        try:  # an integer beyond any float overflows
            ok = not isinstance(g, bool) and isinstance(g, Real) and 0 <= g <= MAX_SHUTDOWN_GRACE
        except OverflowError:
            ok = False
        if not ok:
            raise SettingError(
                f"{'--shutdown-grace' if flags else 'shutdown_grace'} must be in "
                f"0..{MAX_SHUTDOWN_GRACE:g} seconds (got {_shown(g)}); 0 ends running "
                "requests at once",
                "shutdown_grace",
            )
        name = "--allow-origin" if flags else "allow_origins"
        origins = tuple(_origin(o, name) for o in self.allow_origins)
        return replace(self, allow_origins=origins, shutdown_grace=float(g))


def _origin(text, name: str) -> str:
    """An origin as browsers send it: 'scheme://host[:port]' in lower case, or '*'."""
    o = text.strip().lower().rstrip("/") if isinstance(text, str) else ""
    scheme, sep, rest = o.partition("://")
    if o == "*" or (
        sep
        and scheme.isascii()
        and scheme.isalpha()
        and rest.isprintable()
        and rest
        and not set(rest) & set("/?#@ ")
    ):
        return o
    raise SettingError(
        f"{name} {_shown(text)!r} is not an origin; give scheme://host[:port] as the browser "
        "shows it (e.g. http://localhost:3000), or '*' for any page",
        "allow_origins",
    )
