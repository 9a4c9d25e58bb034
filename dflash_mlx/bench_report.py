"""Render a ``dflash bench`` report: rich tables on the terminal, JSON, and a PNG plot."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import DFlashError


def print_report(rep: dict, console) -> None:
    """Print the method table, the per-position table and the latency split."""
    from rich.table import Table

    c = rep["config"]
    t = Table(title=f"dflash bench — {c['prompts']} prompts, block {c['block_size']}, "
                    f"T={c['temperature']}, BLAS: {rep['blas']}")
    for col in ("method", "tau", "tok/s", "speedup"):
        t.add_column(col, justify="right" if col != "method" else "left")
    for m, row in rep["methods"].items():
        tau = f"{row['tau']:.2f}" if "tau" in row else "1.00"
        t.add_row(m, tau, f"{row['tok_per_s']:.1f}", f"{row['speedup']:.2f}x")
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
    console.print(f"tau with top-1 drafting (teacher forced): {rep['tau_top1_teacher_forced']:.2f}"
                  f"   oracle tau (top-{c['top_k']}): {rep['tau_oracle']:.2f}")
    if "selector_gain" in rep:
        console.print(f"selector gain in tau: {100 * rep['selector_gain']:+.1f}%")
    split = rep.get("latency_split")
    if split:
        s = Table(title=f"cycle latency split (dflash2, {split['cycle_ms']:.1f} ms per cycle)")
        names = [k for k in split if k != "cycle_ms"]
        for n in names:
            s.add_column(n, justify="right")
        s.add_row(*[f"{100 * split[n]:.1f}%" for n in names])
        console.print(s)


def write_json(rep: dict, path: str) -> None:
    """Write the report as JSON."""
    Path(path).write_text(json.dumps(rep, indent=2) + "\n")


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
    ax.set_title(f"tau: dflash1 {rep['methods'].get('dflash1', {}).get('tau', 0):.2f}, "
                 f"dflash2 {rep['methods'].get('dflash2', {}).get('tau', 0):.2f}, "
                 f"oracle {rep['tau_oracle']:.2f}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
