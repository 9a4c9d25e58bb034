"""``dflash bench``: the benchmark command, and its report as rich tables, JSON and a PNG.

The measurements themselves are ``dflash_mlx.bench.runner``'s.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import typer

from ..errors import DFlashError
from ..settings import GenerationConfig
from . import common as c
from .options import MODEL, ModelOptions, decoding, expand
from .stats import blocks_text
from .streams import require_stdout

# The settings the bench honours: it samples at --temp alone and runs DFlash 1 and 2 both
# (so no --top-p ... --no-selector); its seed is fixed, so runs compare.
SETTINGS = decoding(
    "bench",
    "Tokens per prompt.",
    fields=("max_tokens", "temperature", "seed", "block_size", "lookup", "tree")
    + ("kv_bits", "kv_group_size", "quantized_kv_start"),
    seed={"default": 0, "help": "PRNG seed, 0..2**32-1 (fixed, for comparable runs)."},
)


def _check_args(args: dict) -> None:
    """The bench's own limits, checked before the decoding settings (so ``-m 0`` is told
    the bench's minimum)."""
    require_stdout("bench")
    if args["max_samples"] < 1:
        raise DFlashError(f"--max-samples must be at least 1 (got {args['max_samples']})")
    if args["max_tokens"] < 2:
        raise DFlashError(f"--max-tokens must be at least 2 (got {args['max_tokens']})")
    if args["dataset"] is not None and not args["dataset"].strip():
        raise DFlashError("--dataset is empty; name a built-in set or a JSONL file")
    if args["context"] is not None and args["context"] < 1:
        raise DFlashError(f"--context must be a prompt length in tokens (got {args['context']})")


@expand(first=_check_args)
def bench(
    src: ModelOptions = MODEL,
    dataset: str | None = typer.Option(
        None,
        "--dataset",
        help="Built-in 'mixed' (default: code + chat), 'code' or 'chat'; 'humaneval' (needs the "
        "bench extra); or a JSONL file.",
    ),
    field: str = typer.Option("prompt", "--field", help="JSONL field holding the prompt."),
    prompt: str | None = typer.Option(None, "--prompt", "-p", help="A single prompt."),
    max_samples: int = typer.Option(20, "--max-samples", "-n", help="Prompts to run."),
    context: int | None = typer.Option(
        None,
        "--context",
        help="Make every prompt N tokens long: standard-library source, then the prompt.",
    ),
    cfg: GenerationConfig = SETTINGS,
    chat_template: bool = typer.Option(
        True,
        "--chat-template/--raw",
        help="Send prompts through the model's chat template (default), or as raw text.",
    ),
    json_path: str | None = typer.Option(None, "--json", help="Write the report as JSON."),
    plot_path: str | None = typer.Option(None, "--plot", help="Write a PNG of the curves."),
):
    """Benchmark autoregressive vs DFlash 1 vs DFlash 2 (also with copied drafts) vs auto:
    tau, speedup, Recall@k, latency."""
    from ..bench.datasets import load_prompts

    prompts = load_prompts(dataset, max_samples, prompt, field)
    json_path = json_path if json_path is None else check_output(json_path, "--json")
    plot_path = plot_path if plot_path is None else check_output(plot_path, "--plot", PLOT_SUFFIXES)
    if plot_path and importlib.util.find_spec("matplotlib") is None:
        raise DFlashError("--plot needs matplotlib; pip install 'dflash-mlx[bench]'")
    m, tok = c.load_pair(src, False, False, cfg, sharded=True)
    rank, cfg, guard = _ranks(m, cfg)
    if context is not None:
        prompts, cfg = with_context(m, tok, prompts, context, cfg, raw=not chat_template)
    block = m.block_size if cfg.block_size in (None, "auto") else cfg.block_size
    if cfg.max_tokens < block:  # Recall@k needs a continuation of at least one block
        raise DFlashError(
            f"--max-tokens {cfg.max_tokens} is shorter than the block ({block} tokens), so no "
            f"per-position Recall can be measured; pass -m {block} or more"
        )
    with guard:
        rep = _measure(m, tok, prompts, cfg, raw=not chat_template)
    from rich.console import Console

    print_report(rep, Console(highlight=False))
    if rank:
        return  # every rank ran the same bench; rank 0 writes it
    for path, write in ((json_path, write_json), (plot_path, write_plot)):
        if path:
            write(rep, path)
            print(f"wrote {path}", file=sys.stderr)


PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def with_context(m, tok, prompts: list[str], tokens: int, cfg: GenerationConfig, raw: bool):
    """(prompts, cfg) for ``--context``: each prompt made ``tokens`` long, refused when the
    model's context cannot hold it and a generated token, ``--max-tokens`` clamped (with a
    note) to the room it leaves, as ``dflash run`` clamps it.

    Raises:
        DFlashError: ``tokens`` does not fit the context, or leaves no room for source.
    """
    from dataclasses import replace

    from ..bench.long_prompts import with_context as lengthen
    from ..decoding.prompt import context_length, room

    ctx = context_length(m)
    if ctx is not None and tokens >= ctx:
        raise DFlashError(
            f"--context {tokens} is beyond this model's context ({ctx} tokens); pass "
            f"--context {max(1, ctx - cfg.max_tokens)} or less"
        )
    fitted = room(tokens, cfg.max_tokens, ctx)
    if fitted < cfg.max_tokens:
        print(
            f"note: --max-tokens {cfg.max_tokens} lowered to {fitted}: --context {tokens} "
            f"takes {tokens} of this model's {ctx}-token context",
            file=sys.stderr,
        )
        cfg = replace(cfg, max_tokens=fitted)
    return lengthen(tok, prompts, tokens, raw), cfg


def check_output(path: str, flag: str, suffixes=None) -> str:
    """The file a report goes to, checked before the run: named, not a folder, in a folder
    that exists and is writable. With ``suffixes`` (a figure: matplotlib picks the format by
    suffix) a name without one gets the first, as matplotlib would, and others are refused.

    Raises:
        DFlashError: naming the flag and the problem.
    """
    import os

    if not path.strip():
        raise DFlashError(f"{flag} needs a file name")
    p = Path(os.path.expanduser(path))
    if p.is_dir():
        raise DFlashError(f"{flag} {path} is a directory; give a file name")
    if suffixes is None:
        pass
    elif not p.suffix:
        p = p.with_name(p.name + suffixes[0])
    elif p.suffix.lower() not in suffixes:
        raise DFlashError(f"{flag} {path}: the file must end in {' / '.join(suffixes)}")
    parent = p.parent
    if not parent.is_dir():
        raise DFlashError(f"{flag} {path}: folder {parent} does not exist; create it first")
    if not os.access(p if p.exists() else parent, os.W_OK):
        raise DFlashError(f"{flag} {path} is not writable; pick another path")
    return str(p)


def _ranks(m, cfg: GenerationConfig):
    """(this rank, the settings, a guard): under ``mlx.launch`` rank 0's seed and the
    watchdog's guard; (None, cfg, a null guard) in one process. Every rank runs the same
    bench (same collectives); ``auto`` takes rank 0's choices (``distributed.policy``)."""
    from contextlib import nullcontext

    group = m.group
    if group is None:
        return None, cfg, nullcontext()
    from ..distributed import follow, wire

    channel, dog = follow.start(group)
    return group.rank(), wire.seeded(cfg, channel.seed), follow.guarded(dog)


def _measure(m, tok, prompts, cfg: GenerationConfig, raw: bool) -> dict:
    """Run the benchmark with a progress bar; the report with the latency split added."""
    from rich.console import Console
    from rich.progress import Progress

    from ..bench.runner import run_bench

    con = Console(stderr=True, highlight=False)
    _forecast(m, tok, prompts, cfg, raw, con)
    with Progress(console=con, transient=True, disable=not con.is_terminal) as bar:
        task = bar.add_task("prompts", total=len(prompts))
        rep = run_bench(
            m,
            tok,
            prompts,
            max_tokens=cfg.max_tokens,
            block_size=cfg.block_size,
            temperature=cfg.temperature,
            seed=cfg.seed,
            raw=raw,
            progress=lambda done, total: bar.update(task, completed=done),
            lookup=cfg.lookup,
            tree=cfg.tree,
            kv=None
            if cfg.kv_bits is None
            else (cfg.kv_bits, cfg.kv_group_size, cfg.quantized_kv_start),
            latency=True,
        )
    return rep


LONG_BENCH = 2048  # prompt tokens in all from which a bench says how long it will take


def _forecast(m, tok, prompts, cfg: GenerationConfig, raw: bool, con) -> None:
    """Before a long bench starts: its prompt tokens and a rough expected time."""
    from ..bench.prefix import expected_seconds
    from ..generation import encode_prompt

    lengths = [len(encode_prompt(tok, p, raw)) for p in prompts]
    if sum(lengths) < LONG_BENCH:
        return
    methods = 3 + int(m.drafter.has_selector) + int(cfg.lookup) + 1  # and the latency split
    secs = expected_seconds(m, lengths, cfg.max_tokens, methods)
    con.print(
        f"note: {len(prompts)} prompts of {sum(lengths):,} tokens in all, each prefilled once; "
        f"expected about {secs / 60:.1f} min (a rough forecast from short-context speeds)",
        soft_wrap=True,  # one line, however narrow the terminal or pipe
    )


def experts_text(ex: dict) -> str:
    """'41.3 @ 7.6 rows (8)': a MoE target's distinct experts per layer per verify at its
    mean rows, and per plain step (``moe.ExpertCount.summary``)."""
    plain = ex["per_plain_step"]
    tail = f"({plain:g})" if plain is not None else ""
    if ex["per_verify"] is None:
        return f"- {tail}"
    return f"{ex['per_verify']:.1f} @ {ex['verify_rows']:.1f} rows {tail}".rstrip()


def print_report(rep: dict, console) -> None:
    """Print the method table, the per-position table and the latency split."""
    from rich.table import Table

    from ..bench.parity import summary_line

    c = rep["config"]
    t = Table(
        title=f"dflash bench — {c['prompts']} prompts (~{c.get('prompt_tokens', '?')} tokens), "
        f"block {c['block_size']}, "
        f"T={c['temperature']}, BLAS: {rep['blas']}{group_text(rep.get('group'))}"
    )
    moe = any(row.get("experts") for row in rep["methods"].values())
    cols = ("method", "tau", "tok/s", "speedup", "blocks (plain share)")
    for col in cols + (("experts/layer: verify (plain step)",) if moe else ()):
        t.add_column(col, justify="right" if col != "method" else "left")
    for m, row in rep["methods"].items():
        tau = f"{row['tau']:.2f}" if "tau" in row else "1.00"
        blocks = ""
        if m == "auto":
            hist = {int(b): n for b, n in row["blocks"].items()}
            blocks = f"{blocks_text(hist)} ({100 * row['plain_share']:.0f}%)"
        if row.get("copied_share"):
            blocks += f"{' · ' if blocks else ''}copied {100 * row['copied_share']:.0f}%"
        cells = [m, tau, f"{row['tok_per_s']:.1f}", f"{row['speedup']:.2f}x", blocks]
        t.add_row(*cells, *([experts_text(row["experts"])] if moe else []))
    console.print(t)
    pos = rep["positions"]
    keys = [k for k in pos if k.startswith("recall")] + [k for k in pos if k.startswith("accept")]
    p = Table(title="per block position (Recall: teacher-forced; acceptance: conditional)")
    p.add_column("position", justify="right")
    for k in keys:
        p.add_column(k.replace("acceptance_", "acc "), justify="right")
    for i in range(len(pos[keys[0]])):
        p.add_row(str(i), *[f"{100 * pos[k][i]:.1f}%" for k in keys])
    console.print(p)
    console.print(
        f"tau with top-1 drafting (teacher forced): {rep['tau_top1_teacher_forced']:.2f}"
        f"   oracle tau (top-{c['top_k']}): {rep['tau_oracle']:.2f}"
    )
    if "selector_gain" in rep:
        console.print(f"selector gain in tau: {100 * rep['selector_gain']:+.1f}%")
    line = summary_line(rep.get("parity"))
    if line:
        console.print(line)
    split = rep.get("latency_split")
    if split:
        s = Table(title=f"cycle latency split (dflash2, {split['cycle_ms']:.1f} ms per cycle)")
        names = [k for k in split if k != "cycle_ms"]
        for n in names:
            s.add_column(n, justify="right")
        s.add_row(*[f"{100 * split[n]:.1f}%" for n in names])
        console.print(s)


def group_text(group: dict | None) -> str:
    """The table title's words for the ranks the bench ran on ("" for one process)."""
    if not group or group.get("ranks", 1) == 1:
        return ""
    words = f", {group['ranks']} ranks ({group['shard']}, {group['backend']}, {group['link']}"
    delay = group.get("injected_delay_ms")
    return words + ("" if delay is None else f", +{delay:g} ms a collective injected") + ")"


def write_json(rep: dict, path: str) -> None:
    """Write the report as JSON.

    Raises:
        DFlashError: the file cannot be written (a full disk, a folder gone meanwhile).
    """
    try:
        Path(path).write_text(json.dumps(rep, indent=2) + "\n")
    except OSError as e:
        raise DFlashError(f"cannot write {path} ({e.strerror}); pick another path") from None


def write_plot(rep: dict, path: str) -> None:
    """Per-position Recall@1 / Recall@K / conditional acceptance curves as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise DFlashError("--plot needs matplotlib; pip install 'dflash-mlx[bench]'") from None
    pos = rep["positions"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for k, v in pos.items():
        ax.plot(range(len(v)), [100 * x for x in v], marker="o", label=k)
    ax.set_xlabel("block position")
    ax.set_ylabel("%")
    ax.set_ylim(0, 100)
    ax.set_title(
        f"tau: dflash1 {rep['methods'].get('dflash1', {}).get('tau', 0):.2f}, "
        f"dflash2 {rep['methods'].get('dflash2', {}).get('tau', 0):.2f}, "
        f"oracle {rep['tau_oracle']:.2f}"
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise DFlashError(f"cannot write {path} ({e.strerror}); pick another path") from None
    finally:
        plt.close(fig)
