"""What the ``dflash`` commands share: their options, the decoding settings built from them,
loading a pair, and reading a prompt.

Only typer and light modules are imported here; MLX and mlx-lm come in with ``load``.
Option defaults are ``GenerationConfig``'s (``settings.MAX_TOKENS`` per command).
"""

from __future__ import annotations

import sys

import typer

from ..decoding.prompt import check_text
from ..errors import DFlashError
from ..loading.hub import OFFLINE_HELP
from ..settings import MAX_TOKENS, GenerationConfig, parse_block_size
from .streams import stdin_closed

D = GenerationConfig()

MODEL = typer.Option(
    ...,
    "--model",
    help="Registry alias (see `dflash models`; case-insensitive), Hub id, local directory or "
    ".gguf file.",
    show_default=False,
)
DRAFTER = typer.Option(
    None,
    "--drafter",
    help="Drafter Hub id or directory (default: the registry's drafters, tried in order).",
)
QUANT = typer.Option(
    None,
    "--quant",
    help="Target quantisation for a registry alias: 4bit (default), 8bit, bf16, mxfp8.",
)
TEMP = typer.Option(D.temperature, "--temp", help="Sampling temperature (0 = greedy).")
TOP_P = typer.Option(D.top_p, "--top-p", help="Nucleus sampling (1 = off).")
TOP_K = typer.Option(D.top_k, "--top-k", help="Top-k sampling (0 = off).")
MIN_P = typer.Option(D.min_p, "--min-p", help="Min-p sampling (0 = off).")
PRESENCE = typer.Option(D.presence_penalty, "--presence-penalty", help="Presence penalty.")
SEED = typer.Option(D.seed, "--seed", help="PRNG seed for sampling, 0..2**32-1.")
BLOCK_SIZE = typer.Option(
    D.block_size,
    "--block-size",
    help="Tokens per verify: auto (each cycle's block chosen from measured costs and live "
    "acceptance, plain decoding when drafting cannot pay) or a fixed 2..the drafter's block.",
)
NO_SELECTOR = typer.Option(
    not D.use_selector,
    "--no-selector",
    help="Draft each position's top token (DFlash 1 behaviour).",
)
NO_LOOKUP = typer.Option(
    not D.lookup,
    "--no-lookup",
    help="Verify only the drafter's drafts, never ones copied from the context.",
)
NO_TREE = typer.Option(
    not D.tree,
    "--no-tree",
    help="Verify the drafter's path alone, without the siblings of its first draft.",
)
DRAFT_VOCAB = typer.Option(
    None,
    "--draft-vocab",
    help="Tokens the drafter scores: 0 = the full vocabulary, N = the N most frequent "
    "(merge ranks); default: the drafter's own draft vocabulary, if it ships one.",
)
SYSTEM = typer.Option(None, "--system", help="System prompt.")
OFFLINE = typer.Option(False, "--offline", help=OFFLINE_HELP)


def max_tokens_option(command: str, help: str = "Tokens to generate."):
    """The --max-tokens / -m option.

    Args:
        command: the command whose default to use (a key of ``settings.MAX_TOKENS``).
        help: the option's help text.
    """
    return typer.Option(MAX_TOKENS[command], "--max-tokens", "-m", help=help)


def settings(
    max_tokens: int,
    temp: float,
    top_p: float,
    top_k: int,
    min_p: float,
    presence_penalty: float,
    seed: int | None,
    block_size: str | None,
    no_selector: bool,
    no_lookup: bool = False,
    no_tree: bool = False,
) -> GenerationConfig:
    """The decoding settings of a command line, checked before anything is loaded.

    Args:
        max_tokens, temp, top_p, top_k, min_p, presence_penalty, seed, block_size: the flags'
            values. no_selector: ``--no-selector``. no_lookup: ``--no-lookup``.
            no_tree: ``--no-tree``.

    Raises:
        SettingError: a flag out of range, named as typed (``--temp``).
    """
    cfg = GenerationConfig(
        max_tokens=max_tokens,
        temperature=temp,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        presence_penalty=presence_penalty,
        block_size=parse_block_size(block_size),
        use_selector=not no_selector,
        lookup=not no_lookup,
        tree=not no_tree,
        seed=seed,
    )
    return cfg.validate(flags=True)


def load_pair(
    model: str,
    drafter,
    quant,
    offline: bool,
    quiet: bool,
    verbose: bool,
    cfg=None,
    draft_vocab: int | None = None,
):
    """(model, tokenizer) through ``dflash_mlx.load``.

    Args:
        model, drafter, quant, offline: ``--model``, ``--drafter``, ``--quant``, ``--offline``.
        quiet: no download notices. verbose: print the loaded paths to stderr.
        cfg: the command's settings; its block size is checked against the drafter's.
        draft_vocab: ``--draft-vocab`` (None: the drafter's own).
    """
    from ..loading.loader import load

    if draft_vocab is not None and draft_vocab < 0:
        raise DFlashError(f"--draft-vocab must be 0 (off) or a positive size (got {draft_vocab})")
    m, tok = load(
        model,
        drafter=drafter,
        quant=quant,
        offline=offline or None,
        quiet=quiet,
        draft_vocab=draft_vocab,
    )
    if verbose:
        print(f"target  {m.target_path}\ndrafter {m.drafter_path}", file=sys.stderr, flush=True)
    if cfg is not None:
        cfg.validate(m.block_size, flags=True)
    return m, tok


def fit_prompt(m, tok, text: str, cfg: GenerationConfig, raw: bool, system, quiet: bool):
    """(ids, settings) of a prompt checked against the model's context, ``max_tokens``
    clamped to the room left; the clamp is said in one line on stderr (unless quiet).

    Args:
        m, tok: the loaded pair. text: the prompt. cfg: the command's settings.
        raw: ``--ignore-chat-template``. system: ``--system``. quiet: ``--quiet``.

    Raises:
        DFlashError: the prompt does not fit (``ContextLengthError``) or is not valid text.
    """
    from ..generation import fit_prompt as fit

    ids, fitted = fit(m, tok, text, cfg, raw=raw, system=system)
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
