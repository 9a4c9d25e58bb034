"""What the ``dflash`` commands share besides their options (``options.py``): loading a
pair, fitting and reading a prompt.

Only typer and light modules are imported here; MLX and mlx-lm come in with ``load``.
"""

from __future__ import annotations

import sys

import typer

from ..decoding.prompt import check_text
from ..errors import DFlashError
from ..settings import GenerationConfig
from .options import ModelOptions
from .streams import stdin_closed

SYSTEM = typer.Option(None, "--system", help="System prompt.")


def load_pair(src: ModelOptions, quiet: bool, verbose: bool, cfg=None, sharded: bool = False):
    """(model, tokenizer) through ``dflash_mlx.load``.

    Args:
        src: ``--model``, ``--drafter``, ``--draft-vocab``, ``--draft-quant``, ``--quant``,
            ``--offline``.
        quiet: no download notices. verbose: print the loaded paths to stderr.
        cfg: the command's settings; its block size is checked against the drafter's.
        sharded: the command runs under ``mlx.launch`` (its target sharded over the ranks);
            else several processes are refused in one line.
    """
    from .. import distributed
    from ..loading.loader import load

    group = distributed.group()
    if group is not None and not sharded:
        raise DFlashError(
            "this command does not run under mlx.launch yet; `dflash run | chat | serve | "
            "bench` and the Python API do (docs/distributed.md)"
        )
    distributed.speak_only_on_rank_zero(group)

    vocab = src.draft_vocab
    if vocab is not None and vocab < 0:
        raise DFlashError(f"--draft-vocab must be 0 (off) or a positive size (got {vocab})")
    kv = None
    if getattr(cfg, "kv_bits", None):
        kv = (cfg.kv_bits, cfg.kv_group_size, cfg.quantized_kv_start)
    if verbose:
        print_plan(src, kv, group)
    m, tok = load(
        src.model,
        drafter=src.drafter,
        quant=src.quant,
        offline=src.offline or None,
        quiet=quiet,
        draft_vocab=vocab,
        draft_quant=src.draft_quant,
        max_memory=src.max_memory,
        max_context=src.max_context,
        kv=kv,
        group=group,
        shard=src.shard,
    )
    if verbose:
        from ..model.quantize import bits_of

        bits = bits_of(m.drafter)
        layers = f" ({bits}-bit layers)" if bits else ""
        print(
            f"target  {m.target_path}\ndrafter {m.drafter_path}{layers}",
            file=sys.stderr,
            flush=True,
        )
    if cfg is not None:
        cfg.validate(m.block_size, flags=True)
    note_lost_kernels()
    return m, tok


_noted: set = set()


def note_lost_kernels() -> None:
    """One ``note:`` line on stderr, once a process, when the CPU backend's few-row kernel
    or exact ops failed to build or load (a documented switch turning one off is silent):
    greedy DFlash is then no longer bit-identical to plain decoding (algorithm.md §4.2.1)."""
    from .. import ops
    from ..loading import cachedir

    st = ops.backend_status() or {}
    parts = [(k, st.get(k) or {}) for k in ("small_gemm", "exact_ops")]
    failed = [
        (k, p) for k, p in parts if p.get("error") and not p.get("off") and not p.get("active")
    ]
    if not failed or "kernels" in _noted:
        return
    _noted.add("kernels")
    names = " and ".join(
        {"small_gemm": "the few-row kernel", "exact_ops": "the exact ops"}[k] for k, _ in failed
    )
    error = " ".join(str(failed[0][1]["error"]).split())[:160]
    cachedir.note(
        f"{names} could not be built or loaded ({error}): greedy DFlash is no longer "
        f"bit-identical to plain decoding, and decodes slower; make {cachedir.cache_dir()} "
        f"writable (or point {cachedir.ENV_DIR} at a writable folder) and check that a C "
        "compiler is installed, then run again (dflash doctor shows the kernels)"
    )


def print_plan(src: ModelOptions, kv: tuple[int, int, int] | None, group=None) -> None:
    """The memory plan (estimated) in one line on stderr, when the pair's files are here.

    Args:
        src: the command's model options. kv: (kv_bits, kv_group_size, quantized_kv_start)
            of a quantized KV cache, or None. group: under ``mlx.launch``, this rank's plan.
    """
    from ..loading import memory, rank_plan
    from ..loading.loader import resolve

    res = resolve(src.model, src.drafter, src.quant)
    tpath, dpath = memory.offline_path(res.target), memory.offline_path(res.drafters[0])
    if tpath is None or dpath is None:
        print("memory  not estimated: the pair is not downloaded yet", file=sys.stderr)
        return
    try:
        plan = memory.make_plan(tpath, dpath, src.max_context, kv)
        shard = None if group is None else (group.size(), group.rank(), "tensor")
        plan = rank_plan.for_rank(plan, tpath, shard)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, DFlashError):
        return  # a damaged file: loading it names the problem
    budget, where = memory.device_budget(src.max_memory)
    print(f"{plan.line()}; budget {budget / 1e9:.2f} GB ({where})", file=sys.stderr, flush=True)


def fit_prompt(
    m, tok, text: str, cfg: GenerationConfig, raw: bool, system, quiet: bool, template_kwargs=None
):
    """(ids, settings) of a prompt checked against the model's context, ``max_tokens``
    clamped to the room left; the clamp is said in one line on stderr (unless quiet).

    Args:
        m, tok: the loaded pair. text: the prompt. cfg: the command's settings.
        raw: ``--ignore-chat-template``. system: ``--system``. quiet: ``--quiet``.
        template_kwargs: chat template variables (``--no-think``: enable_thinking false).

    Raises:
        DFlashError: the prompt does not fit (``ContextLengthError``) or is not valid text.
    """
    from ..generation import fit_prompt as fit

    ids, fitted = fit(m, tok, text, cfg, raw=raw, system=system, template_kwargs=template_kwargs)
    if fitted.max_tokens < cfg.max_tokens and not quiet:
        ctx = len(ids) + fitted.max_tokens
        print(
            f"note: --max-tokens {cfg.max_tokens} lowered to {fitted.max_tokens}: the prompt "
            f"takes {len(ids)} of this model's {ctx}-token context",
            file=sys.stderr,
            flush=True,
        )
    return ids, fitted


def read_prompt(prompt: str | None, prompt_opt: str | None) -> str:
    """The prompt text.

    Args:
        prompt: the positional argument ("-" reads stdin). prompt_opt: ``--prompt``. With
            neither, a pipe on stdin is read.
    """
    if prompt is not None and prompt_opt is not None:
        raise DFlashError("give the prompt once: as an argument or with --prompt, not both")
    text = prompt if prompt is not None else prompt_opt
    if stdin_closed() and (text is None or text == "-"):
        raise DFlashError(
            "no prompt: stdin is closed (<&-); pass the prompt as an argument or with --prompt"
        )
    if text == "-" or (text is None and not sys.stdin.isatty()):
        text = read_stdin()
    elif text is not None:
        check_text(text, "the prompt argument")
    if text is None:
        raise DFlashError('no prompt; pass it as an argument, with --prompt, or on stdin ("-")')
    if not text.strip():
        raise DFlashError("the prompt is empty; give some text")
    return text


def read_stdin() -> str:
    """All of stdin as text: UTF-8 (a leading byte-order mark is dropped), else an error.

    Raises:
        DFlashError: stdin is not UTF-8, naming the first bad byte and its offset.
    """
    buf = getattr(sys.stdin, "buffer", None)
    if buf is None:  # a text-only stream (tests, embedding): already decoded
        text = sys.stdin.read()
        check_text(text, "stdin")
        return text
    data = buf.read()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DFlashError(
            f"stdin is not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); "
            "convert it first, e.g. iconv -f latin1 -t utf-8"
        ) from None


def read_images(paths) -> list:
    """The ``--image`` files, checked and decoded before the model loads.

    Args:
        paths: the files (None: no images).

    Raises:
        DFlashError: a file missing, not an image, too large or corrupt (``ImageError``).
    """
    if not paths:
        return []
    import re

    from ..vision.images import ImageError, read_all

    try:
        pictures = read_all(list(paths))
        for path, pic in zip(paths, pictures):
            pic.pil(str(path))  # decoded once now (a corrupt file fails here), then dropped
        return pictures
    except ImageError as e:  # the limits' flags are the server's: not named here
        raise ImageError(re.sub(r" \(--max-image[a-z-]* to change it\)", "", str(e)), e.kind)


def require_vision(m) -> None:
    """Refuse images for a text-only model at once (``chat``'s ``/image``), with the
    engine's own refusal (``vision.request.no_vision``)."""
    from ..vision.notes import vision_language

    if not vision_language(m):
        from ..vision.request import no_vision

        raise no_vision(m)
