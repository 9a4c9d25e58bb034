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
from .thinking import NO_THINK, THINKING_BUDGET, Shown, check_budget, processors, template_kwargs

# the decoding options, with this command's defaults
SETTINGS = decoding("run")
IMAGE = typer.Option(
    None,
    "--image",
    help="An image (PNG, JPEG, WebP, GIF) for a vision-language model; repeatable. "
    "The images come first in the user turn, then the prompt.",
)


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
    no_think: bool = NO_THINK,
    thinking_budget: int | None = THINKING_BUDGET,
    image: list[str] | None = IMAGE,
):
    """Generate a completion: stream the text to stdout, then stats to stderr. A thinking
    model's reasoning goes to stderr (dim; not with --quiet), its answer to stdout."""
    require_stdout("run")
    if system is not None and ignore_chat_template:
        raise DFlashError("--system needs the chat template; drop --ignore-chat-template")
    if image and ignore_chat_template:
        raise DFlashError("--image needs the chat template; drop --ignore-chat-template")
    budget = check_budget(thinking_budget)
    text = c.read_prompt(prompt, prompt_opt)
    pictures = c.read_images(image)  # a bad file is refused before the model loads
    m, tok = c.load_pair(src, quiet, verbose, cfg, sharded=True)
    cfg, guard = _across_ranks(cfg)
    kw = template_kwargs(False if no_think else None)
    prompt, ids, cfg, opts = _request(m, tok, text, cfg, (system, pictures), ignore_chat_template, quiet, kw)  # fmt: skip
    opts.update(profile=verbose, logits_processors=processors(tok, ids, budget))
    count = getattr(m.adapter, "experts", None) if as_json else None  # MoE: experts read
    if count is not None:
        count.reset()
    with guard:
        last, shown = _generate(m, tok, (prompt, ids), cfg, opts, as_json, quiet)
    has_selector = bool(getattr(m.drafter, "has_selector", True))
    s = stats_dict(last, m.name, cfg.block_size or m.block_size, cfg.use_selector and has_selector)
    extra = None
    if verbose:
        from .. import ops

        extra = {"schedule": last.schedule, "blas": ops.backend_name()}
    if as_json:
        thought = {"reasoning": "".join(shown.reasoning)} if shown.reasoning else {}
        s["experts"] = None if count is None else count.summary()  # null: a dense target
        print(json.dumps({"text": "".join(shown.content), **thought, **s}, ensure_ascii=False))
        return
    sys.stdout.write("\n")
    sys.stdout.flush()
    if not quiet:
        con = stderr_console()
        for line in stats_lines(s, last.timings if verbose else None, extra):
            con.print(line)


def _request(m, tok, text: str, cfg, given: tuple, raw: bool, quiet: bool, kw):
    """(the engine's prompt, its ids, the fitted settings, the engine's image keywords) of
    the prompt ``text`` with ``given`` = (--system, the --image pictures). With images the
    engine's entry expands each image (refusing a text-only model), rendering the template
    with ``kw`` (--no-think) as the text path does; the engine decodes that prepared prompt."""
    system, pictures = given
    if not pictures:
        ids, cfg = c.fit_prompt(m, tok, text, cfg, raw, system, quiet, kw)
        return ids, ids, cfg, {}
    from ..generation import request_ids

    ids, cfg, vision = request_ids(
        m, tok, text, cfg, system=system, images=pictures, template_kwargs=kw
    )
    return ids, ids, cfg, {"images": vision}


def _across_ranks(cfg: GenerationConfig):
    """(settings, guard): under ``mlx.launch`` rank 0's seed for every rank, and the
    watchdog that ends every rank when one is lost (``distributed.faults``); ``auto``
    follows rank 0's choices in the decode itself (``distributed.policy``)."""
    from contextlib import nullcontext

    from .. import distributed

    group = distributed.group()
    if group is None:
        return cfg, nullcontext()
    from ..distributed import follow, wire

    channel, dog = follow.start(group)
    return wire.seeded(cfg, channel.seed), follow.guarded(dog)


def _dim(text: str) -> None:
    """Reasoning on stderr: dim on a terminal."""
    err = sys.stderr
    err.write(f"\x1b[2m{text}\x1b[0m" if err.isatty() else text)
    err.flush()


def _out(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _generate(m, tok, request: tuple, cfg, opts: dict, as_json: bool, quiet: bool):
    """Stream the completion of ``request`` (the engine's prompt, its ids), its answer to
    stdout and its reasoning to stderr (--json: kept for the object; --quiet: no
    reasoning); (last response, the ``Shown`` answer)."""
    from ..generation import stream_generate

    last = None
    write = (lambda s: None) if as_json else _out
    prompt, ids = request
    shown = Shown(tok, ids, write, None if as_json or quiet else _dim)
    try:
        for r in stream_generate(m, tok, prompt, config=cfg, **opts):
            last = r
            shown.feed(r.text)
        shown.close()
    except KeyboardInterrupt:
        if not as_json:
            _out("\n")
        raise
    return last, shown
