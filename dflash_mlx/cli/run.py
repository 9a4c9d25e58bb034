"""``dflash run``: one completion, streamed to stdout, then its stats to stderr."""

from __future__ import annotations

import json
import sys

import typer

from ..errors import DFlashError
from . import common as c
from .stats import stats_dict, stats_lines, stderr_console
from .streams import require_stdout


def run(
    prompt: str | None = typer.Argument(
        None, help='The prompt; "-" or a pipe reads stdin.', show_default=False
    ),
    model: str = c.MODEL,
    drafter: str | None = c.DRAFTER,
    draft_vocab: int | None = c.DRAFT_VOCAB,
    quant: str | None = c.QUANT,
    prompt_opt: str | None = typer.Option(None, "--prompt", "-p", help="The prompt."),
    max_tokens: int = c.max_tokens_option("run"),
    temp: float = c.TEMP,
    top_p: float = c.TOP_P,
    top_k: int = c.TOP_K,
    min_p: float = c.MIN_P,
    presence_penalty: float = c.PRESENCE,
    seed: int | None = c.SEED,
    block_size: str | None = c.BLOCK_SIZE,
    no_selector: bool = c.NO_SELECTOR,
    no_lookup: bool = c.NO_LOOKUP,
    no_tree: bool = c.NO_TREE,
    system: str | None = c.SYSTEM,
    ignore_chat_template: bool = typer.Option(
        False, "--ignore-chat-template", help="Use the prompt as-is, without the chat template."
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print one JSON object (text + stats) instead of streaming."
    ),
    offline: bool = c.OFFLINE,
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Paths and the time split."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only the text: no stats, no notices."),
):
    """Generate a completion: stream the text to stdout, then stats to stderr."""
    flags = (max_tokens, temp, top_p, top_k, min_p, presence_penalty, seed, block_size)
    cfg = c.settings(*flags, no_selector, no_lookup, no_tree)
    require_stdout("run")
    if system is not None and ignore_chat_template:
        raise DFlashError("--system needs the chat template; drop --ignore-chat-template")
    text = c.read_prompt(prompt, prompt_opt)
    m, tok = c.load_pair(model, drafter, quant, offline, quiet, verbose, cfg, draft_vocab)
    ids, cfg = c.fit_prompt(m, tok, text, cfg, ignore_chat_template, system, quiet)
    last, pieces = _generate(m, tok, ids, cfg, dict(profile=verbose), as_json)
    has_selector = bool(getattr(m.drafter, "has_selector", True))
    s = stats_dict(last, m.name, cfg.block_size or m.block_size, cfg.use_selector and has_selector)
    extra = None
    if verbose:
        from ..cpu.blas import measure

        extra = {"schedule": last.schedule, "blas": measure()["name"]}
    if as_json:
        print(json.dumps({"text": "".join(pieces), **s}, ensure_ascii=False))
        return
    sys.stdout.write("\n")
    sys.stdout.flush()
    if not quiet:
        con = stderr_console()
        for line in stats_lines(s, last.timings if verbose else None, extra):
            con.print(line)


def _generate(m, tok, prompt, cfg, opts: dict, as_json: bool):
    """Stream the completion to stdout (or collect it for --json): (last response, pieces)."""
    from ..generation import stream_generate

    last, pieces, out = None, [], sys.stdout
    try:
        for r in stream_generate(m, tok, prompt, config=cfg, **opts):
            last = r
            if as_json:
                pieces.append(r.text)
            elif r.text:
                out.write(r.text)
                out.flush()
    except KeyboardInterrupt:
        if not as_json:
            out.write("\n")
            out.flush()
        raise
    return last, pieces
