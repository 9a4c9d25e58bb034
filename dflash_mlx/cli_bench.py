"""``dflash bench``: the benchmark command (kept apart from cli.py, which holds the
interactive commands). Heavy imports stay inside the function."""

from __future__ import annotations

import sys
from typing import Optional

import typer

from .errors import DFlashError


def bench(
    model: str = typer.Option(..., "--model", help="Registry alias, Hub id or directory.",
                              show_default=False),
    drafter: Optional[str] = typer.Option(None, "--drafter", help="Drafter Hub id or directory."),
    quant: Optional[str] = typer.Option(None, "--quant", help="Target quantisation of an alias."),
    dataset: Optional[str] = typer.Option(
        None, "--dataset", help="'humaneval' (needs the bench extra) or a JSONL file."),
    field: str = typer.Option("prompt", "--field", help="JSONL field holding the prompt."),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="A single prompt."),
    max_samples: int = typer.Option(20, "--max-samples", "-n", help="Prompts to run."),
    max_tokens: int = typer.Option(128, "--max-tokens", "-m", help="Tokens per prompt."),
    block_size: Optional[int] = typer.Option(None, "--block-size", help="Tokens per verify."),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature (0 = greedy)."),
    seed: int = typer.Option(0, "--seed", help="PRNG seed."),
    chat_template: bool = typer.Option(
        False, "--chat-template", help="Wrap prompts in the chat template (default: raw)."),
    json_path: Optional[str] = typer.Option(None, "--json", help="Write the report as JSON."),
    plot_path: Optional[str] = typer.Option(None, "--plot", help="Write a PNG of the curves."),
    offline: bool = typer.Option(False, "--offline", help="Use the local Hub cache only."),
):
    """Benchmark autoregressive vs DFlash 1 vs DFlash 2: tau, speedup, Recall@k, latency."""
    if max_samples < 1 or max_tokens < 2:
        raise DFlashError("--max-samples must be >= 1 and --max-tokens >= 2")
    if temp < 0:
        raise DFlashError(f"--temp must be >= 0 (got {temp}); use 0 for greedy decoding")
    from .bench import latency_split, load_prompts

    prompts = load_prompts(dataset, max_samples, prompt, field)
    if plot_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise DFlashError("--plot needs matplotlib; pip install 'dflash-mlx[bench]'") from None
    from rich.console import Console
    from rich.progress import Progress

    from .bench import run_bench
    from .bench_report import print_report, write_json, write_plot
    from .cli import _check_block, _load

    m, tok, _ = _load(model, drafter, quant, offline, False, False)
    _check_block(m, block_size)
    con = Console(stderr=True, highlight=False)
    with Progress(console=con, transient=True) as bar:
        task = bar.add_task("prompts", total=len(prompts))
        rep = run_bench(m, tok, prompts, max_tokens=max_tokens, block_size=block_size,
                        temperature=temp, seed=seed, raw=not chat_template,
                        progress=lambda done, total: bar.update(task, completed=done))
        from .generation import encode_prompt

        rep["latency_split"] = latency_split(
            m, encode_prompt(tok, prompts[0], not chat_template), max_tokens,
            block_size or m.block_size, temp)
    print_report(rep, Console(highlight=False))
    if json_path:
        write_json(rep, json_path)
        print(f"wrote {json_path}", file=sys.stderr)
    if plot_path:
        write_plot(rep, plot_path)
        print(f"wrote {plot_path}", file=sys.stderr)
