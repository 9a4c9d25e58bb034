"""The ``dflash`` command line: run, chat, models, serve (and bench, in cli_bench).

Only typer is imported at module level: MLX, mlx-lm, huggingface_hub and the engine are
imported inside the commands, so ``dflash --help`` stays instant. Every bad input ends with
one line on stderr (``error: <problem>; <fix>``) and exit code 2, never a traceback.
"""

from __future__ import annotations

import json
import os
import sys
from typing import List, Optional

import typer
from typer.core import TyperGroup

try:  # typer >= 0.26 vendors click
    from typer._click import exceptions as _cx
except ImportError:  # pragma: no cover - older typer
    from click import exceptions as _cx

from .errors import DFlashError

USAGE_EXIT = 2


def _err(msg: str) -> None:
    msg = " ".join(str(msg).split())
    print(f"error: {msg}", file=sys.stderr, flush=True)


class _Group(TyperGroup):
    """Typer group whose errors are one line on stderr with exit code 2."""

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        if not standalone_mode:  # an embedding caller handles errors itself
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except _cx.NoArgsIsHelpError as e:
            print(e.ctx.get_help())
            sys.exit(0)
        except _cx.UsageError as e:
            cmd = e.ctx.command_path if e.ctx is not None else "dflash"
            msg = e.format_message().rstrip(".")
            _err(f"{msg}; see `{cmd} --help`")
            sys.exit(USAGE_EXIT)
        except _cx.ClickException as e:
            _err(e.format_message())
            sys.exit(e.exit_code if e.exit_code else 1)
        except DFlashError as e:
            _err(str(e))
            sys.exit(USAGE_EXIT)
        except (typer.Abort, KeyboardInterrupt, EOFError):
            print("\ninterrupted", file=sys.stderr, flush=True)
            sys.exit(130)
        if isinstance(rv, int) and rv:
            if rv == 130:
                print("\ninterrupted", file=sys.stderr, flush=True)
            sys.exit(rv)
        sys.exit(0)


app = typer.Typer(
    cls=_Group,
    name="dflash",
    help="DFlash 2 speculative decoding on MLX: lossless, faster local LLM inference.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool):
    if value:
        from . import __version__

        print(f"dflash-mlx {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
):
    """DFlash 2 speculative decoding on MLX: lossless, faster local LLM inference.

    Examples: dflash run --model Qwen3.8-27B "Write a haiku" · dflash chat --model demo ·
    dflash models
    """


# ----------------------------------------------------------------------------- options

_MODEL_HELP = "Registry alias (see `dflash models`; case-insensitive), Hub id or local directory."
_DRAFTER_HELP = "Drafter Hub id or directory (default: the registry's drafters, tried in order)."
_QUANT_HELP = "Target quantisation for a registry alias: 4bit (default), 8bit, bf16, mxfp8."


def _model_opt():
    return typer.Option(..., "--model", help=_MODEL_HELP, show_default=False)


def _check_options(max_tokens, temp, top_p, top_k, min_p, presence_penalty, block_size):
    """Validate decoding options before anything is loaded (one-line errors)."""
    if max_tokens is not None and max_tokens < 1:
        raise DFlashError(f"--max-tokens must be at least 1 (got {max_tokens})")
    if temp < 0:
        raise DFlashError(f"--temp must be >= 0 (got {temp}); use 0 for greedy decoding")
    if not 0 < top_p <= 1:
        raise DFlashError(f"--top-p must be in (0, 1] (got {top_p}); use 1.0 to turn it off")
    if top_k < 0:
        raise DFlashError(f"--top-k must be >= 0 (got {top_k}); use 0 to turn it off")
    if not 0 <= min_p <= 1:
        raise DFlashError(f"--min-p must be in [0, 1] (got {min_p}); use 0 to turn it off")
    if not -2 <= presence_penalty <= 2:
        raise DFlashError(
            f"--presence-penalty must be in [-2, 2] (got {presence_penalty}); use 0 to turn it off"
        )
    if block_size is not None and block_size < 2:
        raise DFlashError(f"--block-size must be at least 2 (got {block_size})")


def _check_block(model, block_size: Optional[int]) -> None:
    if block_size is not None and block_size > model.block_size:
        raise DFlashError(
            f"--block-size {block_size} is larger than this drafter's block of "
            f"{model.block_size}; use 2..{model.block_size}"
        )


def _load(model: str, drafter, quant, offline, quiet: bool, verbose: bool):
    from .registry import load_model

    m, tok, name = load_model(model, drafter=drafter, quant=quant, offline=offline or None,
                              quiet=quiet)
    if verbose:
        print(f"target  {m.target_path}\ndrafter {m.drafter_path}", file=sys.stderr, flush=True)
    return m, tok, name


def _read_prompt(prompt: Optional[str], prompt_opt: Optional[str]) -> str:
    if prompt is not None and prompt_opt is not None:
        raise DFlashError("give the prompt once: as an argument or with --prompt, not both")
    text = prompt if prompt is not None else prompt_opt
    if text == "-" or (text is None and not sys.stdin.isatty()):
        text = sys.stdin.read()
    if text is None:
        raise DFlashError('no prompt; pass it as an argument, with --prompt, or on stdin ("-")')
    if not text.strip():
        raise DFlashError("the prompt is empty; give some text")
    return text


# ----------------------------------------------------------------------------- stats

_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: List[float]) -> str:
    """One character per value in [0, 1]."""
    out = []
    for v in values:
        v = min(max(float(v), 0.0), 1.0)
        out.append(_BARS[round(v * (len(_BARS) - 1))])
    return "".join(out)


def stats_dict(r, name: str, block_size: int, selector: bool) -> dict:
    """The machine-readable stats of a finished generation."""
    return {
        "model": name,
        "finish_reason": r.finish_reason,
        "prompt_tokens": r.prompt_tokens,
        "prompt_processed": r.prompt_processed,
        "prompt_tps": round(r.prompt_tps, 3),
        "generation_tokens": r.generation_tokens,
        "generation_tps": round(r.generation_tps, 3),
        "tau": round(r.tau, 4),
        "cycles": r.cycles,
        "block_size": block_size,
        "selector": selector,
        "acceptance": [round(a, 4) for a in r.acceptance],
        "peak_memory_gb": round(r.peak_memory, 4),
    }


def stats_lines(s: dict, timings: Optional[dict] = None) -> List[str]:
    """The human stats block (rich markup)."""
    acc = s["acceptance"]
    pct = " ".join(f"{round(100 * a):d}" for a in acc)
    cached = s["prompt_tokens"] - s["prompt_processed"]
    lines = [
        f"[dim]prompt    [/dim] {s['prompt_tokens']} tokens, {s['prompt_tps']:.1f} tok/s"
        + (f" ({cached} from cache)" if cached else ""),
        f"[dim]generated [/dim] {s['generation_tokens']} tokens, {s['generation_tps']:.1f} tok/s",
        f"[dim]tau       [/dim] {s['tau']:.2f} tokens/cycle over {s['cycles']} cycles "
        f"(block {s['block_size']}, selector {'on' if s['selector'] else 'off'})",
        f"[dim]acceptance[/dim] {sparkline(acc)}  {pct} % by block position",
        f"[dim]peak mem  [/dim] {s['peak_memory_gb']:.2f} GB",
    ]
    if timings:
        total = sum(timings.values()) or 1.0
        split = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in timings.items())
        lines.append(f"[dim]time split[/dim] {split}")
    return lines


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


# ----------------------------------------------------------------------------- run


@app.command()
def run(
    prompt: Optional[str] = typer.Argument(
        None, help='The prompt; "-" or a pipe reads stdin.', show_default=False
    ),
    model: str = _model_opt(),
    drafter: Optional[str] = typer.Option(None, "--drafter", help=_DRAFTER_HELP),
    quant: Optional[str] = typer.Option(None, "--quant", help=_QUANT_HELP),
    prompt_opt: Optional[str] = typer.Option(None, "--prompt", "-p", help="The prompt."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-m", help="Tokens to generate."),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature (0 = greedy)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling (1 = off)."),
    top_k: int = typer.Option(0, "--top-k", help="Top-k sampling (0 = off)."),
    min_p: float = typer.Option(0.0, "--min-p", help="Min-p sampling (0 = off)."),
    presence_penalty: float = typer.Option(0.0, "--presence-penalty", help="Presence penalty."),
    seed: Optional[int] = typer.Option(None, "--seed", help="PRNG seed for sampling."),
    block_size: Optional[int] = typer.Option(
        None, "--block-size", help="Tokens per verify (default: the drafter's block size)."
    ),
    no_selector: bool = typer.Option(
        False, "--no-selector", help="Draft each position's top token (DFlash 1 behaviour)."
    ),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt."),
    ignore_chat_template: bool = typer.Option(
        False, "--ignore-chat-template", help="Use the prompt as-is, without the chat template."
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print one JSON object (text + stats) instead of streaming."
    ),
    offline: bool = typer.Option(
        False, "--offline", help="Use the local Hugging Face cache only (also HF_HUB_OFFLINE=1)."
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Paths and the time split."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only the text: no stats, no notices."),
):
    """Generate a completion: stream the text to stdout, then stats to stderr."""
    _check_options(max_tokens, temp, top_p, top_k, min_p, presence_penalty, block_size)
    if system is not None and ignore_chat_template:
        raise DFlashError("--system needs the chat template; drop --ignore-chat-template")
    text_in = _read_prompt(prompt, prompt_opt)
    m, tok, name = _load(model, drafter, quant, offline, quiet, verbose)
    _check_block(m, block_size)
    from .generation import stream_generate

    bs = block_size or m.block_size
    use_selector = not no_selector
    has_selector = bool(getattr(m.drafter, "has_selector", True))
    last, pieces = None, []
    out = sys.stdout
    try:
        for r in stream_generate(
            m, tok, text_in, max_tokens=max_tokens, temperature=temp, top_p=top_p, top_k=top_k,
            min_p=min_p, presence_penalty=presence_penalty, block_size=bs,
            use_selector=use_selector, seed=seed, raw=ignore_chat_template, system=system,
            profile=verbose,
        ):
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
    s = stats_dict(last, name, bs, use_selector and has_selector)
    if as_json:
        print(json.dumps({"text": "".join(pieces), **s}, ensure_ascii=False))
        return
    out.write("\n")
    out.flush()
    if not quiet:
        con = _stderr_console()
        for line in stats_lines(s, last.timings if verbose else None):
            con.print(line)


# ----------------------------------------------------------------------------- chat


@app.command()
def chat(
    model: str = _model_opt(),
    drafter: Optional[str] = typer.Option(None, "--drafter", help=_DRAFTER_HELP),
    quant: Optional[str] = typer.Option(None, "--quant", help=_QUANT_HELP),
    max_tokens: int = typer.Option(1024, "--max-tokens", "-m", help="Tokens per answer."),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature (0 = greedy)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling (1 = off)."),
    top_k: int = typer.Option(0, "--top-k", help="Top-k sampling (0 = off)."),
    min_p: float = typer.Option(0.0, "--min-p", help="Min-p sampling (0 = off)."),
    presence_penalty: float = typer.Option(0.0, "--presence-penalty", help="Presence penalty."),
    seed: Optional[int] = typer.Option(None, "--seed", help="PRNG seed for sampling."),
    block_size: Optional[int] = typer.Option(
        None, "--block-size", help="Tokens per verify (default: the drafter's block size)."
    ),
    no_selector: bool = typer.Option(
        False, "--no-selector", help="Draft each position's top token (DFlash 1 behaviour)."
    ),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt."),
    offline: bool = typer.Option(
        False, "--offline", help="Use the local Hugging Face cache only (also HF_HUB_OFFLINE=1)."
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Print the loaded paths."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No per-turn stats line."),
    no_markdown: bool = typer.Option(
        False, "--no-markdown", help="Keep answers as streamed (no markdown rendering)."
    ),
):
    """Chat in the terminal; caches persist across turns. /help lists the commands."""
    _check_options(max_tokens, temp, top_p, top_k, min_p, presence_penalty, block_size)
    m, tok, name = _load(model, drafter, quant, offline, False, verbose)
    _check_block(m, block_size)
    if getattr(tok, "chat_template", None) is None:
        raise DFlashError(
            f"{name} has no chat template, so it cannot chat; use `dflash run` with a prompt"
        )
    from .chat import ChatSession

    gen = dict(
        max_tokens=max_tokens, temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p,
        presence_penalty=presence_penalty, block_size=block_size or m.block_size,
        use_selector=not no_selector, seed=seed,
    )
    ChatSession(m, tok, name, gen, system=system, show_stats=not quiet,
                markdown=not no_markdown).loop()


# ----------------------------------------------------------------------------- models


@app.command()
def models(
    as_json: bool = typer.Option(False, "--json", help="Print the registry as JSON."),
):
    """List the model registry and what is already in the local Hub cache."""
    from . import hub, registry

    rows = []
    for e in registry.entries():
        if e.local:
            t = e.target()
            tsize = hub.dir_size(t) if os.path.isdir(t) else None
            dsize = [hub.dir_size(d) if os.path.isdir(d) else None for d in e.drafters]
            tcached = {e.default_quant: tsize} if tsize is not None else {}
        else:
            tcached = {q: s for q, r in e.targets.items() if (s := hub.cached_size(r)) is not None}
            dsize = [hub.cached_size(d) for d in e.drafters]
        rows.append((e, tcached, dsize))
    if as_json:
        print(json.dumps([
            {
                "alias": e.alias, "target": e.target(), "quants": e.targets,
                "drafters": list(e.drafters), "block_size": e.block_size, "kind": e.kind,
                "cached_targets": tc, "cached_drafters": dict(zip(e.drafters, ds, strict=True)),
                "note": e.note,
            }
            for e, tc, ds in rows
        ], indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="dflash models", title_justify="left")
    table.add_column("alias", style="bold cyan", no_wrap=True)
    table.add_column("target · --quant", no_wrap=True)
    table.add_column("drafters, tried in order", no_wrap=True)
    table.add_column("in cache")
    for e, tc, ds in rows:
        alias = f"{e.alias}\n[dim]{e.kind} · block {e.block_size}[/dim]"
        target = _short(e.target())
        if not e.local:
            target += "\n[dim]" + " ".join(e.targets) + "[/dim]"
        drafters = "\n".join(_short(d) for d in e.drafters)
        if tc or any(s is not None for s in ds):
            parts = [f"{q} {hub.human_size(s)}" for q, s in tc.items()]
            parts += [f"drafter {hub.human_size(s)}" for s in ds if s is not None][:1]
            cached = "[green]" + "\n".join(parts) + "[/green]"
        else:
            cached = "[dim]no[/dim]"
        table.add_row(alias, target, drafters, cached)
    con = Console(highlight=False)
    con.print(table)
    con.print(f"[dim]Hub cache: {hub.cache_dir()} · any Hub id or directory also works with "
              "--model (and --drafter)[/dim]")


def _short(path: str) -> str:
    """A package-data path relative to the installed package's parent, else as given."""
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isabs(path) and path.startswith(pkg + os.sep):
        return os.path.relpath(path, pkg)
    return path


# ----------------------------------------------------------------------------- serve

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@app.command()
def serve(
    model: str = _model_opt(),
    drafter: Optional[str] = typer.Option(None, "--drafter", help=_DRAFTER_HELP),
    quant: Optional[str] = typer.Option(None, "--quant", help=_QUANT_HELP),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind."),
    port: int = typer.Option(8080, "--port", help="Port to listen on (0: a free one)."),
    api_key: Optional[str] = typer.Option(
        None, "--api-key", help="Require 'Authorization: Bearer KEY' (also DFLASH_API_KEY).",
        envvar="DFLASH_API_KEY",
    ),
    max_queue: int = typer.Option(16, "--max-queue", help="Waiting requests before 503."),
    max_tokens: int = typer.Option(512, "--max-tokens", "-m", help="Default max tokens."),
    temp: float = typer.Option(0.0, "--temp", help="Default temperature."),
    top_p: float = typer.Option(1.0, "--top-p", help="Default top-p."),
    top_k: int = typer.Option(0, "--top-k", help="Default top-k."),
    min_p: float = typer.Option(0.0, "--min-p", help="Default min-p."),
    presence_penalty: float = typer.Option(0.0, "--presence-penalty", help="Default presence."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Default PRNG seed."),
    block_size: Optional[int] = typer.Option(None, "--block-size", help="Tokens per verify."),
    no_selector: bool = typer.Option(False, "--no-selector", help="DFlash 1 drafting."),
    offline: bool = typer.Option(False, "--offline", help="Use the local Hub cache only."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Print the loaded paths."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No download notices."),
):
    """Serve an OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models)."""
    _check_options(max_tokens, temp, top_p, top_k, min_p, presence_penalty, block_size)
    if not 0 <= port < 65536:
        raise DFlashError(f"--port must be in 0..65535 (got {port}); 0 picks a free port")
    if max_queue < 1:
        raise DFlashError(f"--max-queue must be at least 1 (got {max_queue})")
    if host not in _LOOPBACK and not host.startswith("127.") and not api_key:
        print(
            f"warning: binding {host} without --api-key: anyone who can reach this machine can "
            "use the model; pass --api-key KEY",
            file=sys.stderr, flush=True,
        )
    m, tok, name = _load(model, drafter, quant, offline, quiet, verbose)
    _check_block(m, block_size)
    from .server import run_server

    defaults = dict(
        max_tokens=max_tokens, temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p,
        presence_penalty=presence_penalty, block_size=block_size or m.block_size,
        use_selector=not no_selector, seed=seed,
    )
    run_server(m, tok, name, host=host, port=port, api_key=api_key, defaults=defaults,
               max_queue=max_queue)


from .cli_bench import bench as _bench  # noqa: E402

app.command(name="bench")(_bench)


def main():  # pragma: no cover - console entry for `python -m dflash_mlx.cli`
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
