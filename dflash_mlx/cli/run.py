"""``dflash run``: one completion, streamed to stdout, then its stats to stderr."""

from __future__ import annotations

import json
import sys

import typer

from ..errors import DFlashError
from ..settings import GenerationConfig
from . import common as c
from .options import MODEL, ModelOptions, decoding, expand
from .stats import stats_dict, stats_lines, stderr_console
from .streams import require_stdout

# the decoding options, with this command's defaults
SETTINGS = decoding("run")


@expand()
def run(
    prompt: str | None = typer.Argument(
        None, help='The prompt; "-" or a pipe reads stdin.', show_default=False
    ),
    src: ModelOptions = MODEL,
    prompt_opt: str | None = typer.Option(None, "--prompt", "-p", help="The prompt."),
    cfg: GenerationConfig = SETTINGS,
    system: str | None = c.SYSTEM,
    ignore_chat_template: bool = typer.Option(
        False, "--ignore-chat-template", help="Use the prompt as-is, without the chat template."
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print one JSON object (text + stats) instead of streaming."
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Paths and the time split."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only the text: no stats, no notices."),
):
    """Generate a completion: stream the text to stdout, then stats to stderr."""
    require_stdout("run")
    if system is not None and ignore_chat_template:
        raise DFlashError("--system needs the chat template; drop --ignore-chat-template")
    text = c.read_prompt(prompt, prompt_opt)
    m, tok = c.load_pair(src, quiet, verbose, cfg)
    ids, cfg = c.fit_prompt(m, tok, text, cfg, ignore_chat_template, system, quiet)
    last, pieces = _generate(m, tok, ids, cfg, {"profile": verbose}, as_json)
    has_selector = bool(getattr(m.drafter, "has_selector", True))
    s = stats_dict(last, m.name, cfg.block_size or m.block_size, cfg.use_selector and has_selector)
    extra = None
    if verbose:
        from .. import ops

        extra = {"schedule": last.schedule, "blas": ops.backend_name()}
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
