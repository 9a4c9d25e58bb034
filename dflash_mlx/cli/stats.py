"""The statistics ``dflash run`` and ``dflash chat`` print after a generation."""

from __future__ import annotations

_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float]) -> str:
    """One character per value in [0, 1]."""
    out = []
    for v in values:
        v = min(max(float(v), 0.0), 1.0)
        out.append(_BARS[round(v * (len(_BARS) - 1))])
    return "".join(out)


def blocks_text(blocks: dict) -> str:
    """A block-size histogram as "plain 12 · 4:3 · 8:40" (1 = a plain step)."""
    parts = [f"plain {n}" if b == 1 else f"{b}:{n}" for b, n in sorted(blocks.items())]
    return " · ".join(parts)


def stats_dict(r, name: str, block_size, selector: bool) -> dict:
    """The machine-readable stats of a finished generation (its last GenerationResponse).

    Args:
        r: the last response. name: the model's name. block_size: "auto" or the fixed block.
        selector: whether the path selector was on.
    """
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
        "blocks": {str(b): n for b, n in r.blocks.items()},
        "plain_share": round(r.plain_share, 4),
        "copied_cycles": r.copied,
        "sibling_cycles": r.siblings,
        "peak_memory_gb": round(r.peak_memory, 4),
    }


def stats_lines(s: dict, timings: dict | None = None, verbose: dict | None = None):
    """The human stats block (rich markup).

    Args:
        s: ``stats_dict``. timings: the cycle's time split to show. verbose: extra lines'
            data: "schedule" (why decoding went plain) and "blas" (the BLAS in use).
    """
    acc = s["acceptance"]
    pct = " ".join(f"{round(100 * a):d}" for a in acc)
    cached = s["prompt_tokens"] - s["prompt_processed"]
    lines = [
        f"[dim]prompt    [/dim] {s['prompt_tokens']} tokens, {s['prompt_tps']:.1f} tok/s"
        + (f" ({cached} from cache)" if cached else ""),
        f"[dim]generated [/dim] {s['generation_tokens']} tokens, {s['generation_tps']:.1f} tok/s",
        f"[dim]tau       [/dim] {s['tau']:.2f} tokens/cycle over {s['cycles']} cycles "
        f"(block {s['block_size']}, selector {'on' if s['selector'] else 'off'}"
        + (f", {s['copied_cycles']} copied from the context" if s["copied_cycles"] else "")
        + (f", {s['sibling_cycles']} took a sibling)" if s.get("sibling_cycles") else ")"),
        f"[dim]acceptance[/dim] {sparkline(acc)}  {pct} % by block position",
    ]
    if s["block_size"] == "auto":
        blocks = {int(b): n for b, n in s["blocks"].items()}
        lines.append(
            f"[dim]blocks    [/dim] {blocks_text(blocks)} (plain {100 * s['plain_share']:.0f}%)"
        )
    lines.append(f"[dim]peak mem  [/dim] {s['peak_memory_gb']:.2f} GB")
    for note in (verbose or {}).get("schedule", []):
        lines.append(f"[dim]schedule  [/dim] {note}")
    if (verbose or {}).get("blas"):
        lines.append(f"[dim]blas      [/dim] {verbose['blas']}")
    if timings:
        total = sum(timings.values()) or 1.0
        split = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in timings.items())
        lines.append(f"[dim]time split[/dim] {split}")
    return lines


def stderr_console():
    """A rich console on stderr that leaves text as it is."""
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)
