"""The statistics ``dflash run`` and ``dflash chat`` print after a generation."""

from __future__ import annotations

_BARS = "▁▂▃▄▅▆▇█"
# what tau is when no cycle followed the prefill: (no token was generated, one was)
NO_CYCLE = (
    "none: no drafting cycle ran; the prefill's token ended the answer",
    "none: no drafting cycle ran; the prefill gave the only token",
)


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
        **({"notes": list(r.notes)} if getattr(r, "notes", None) else {}),
    }


def _drafting_lines(s: dict) -> list[str]:
    """The tau and acceptance lines, true when no cycle ran (``-m 1``: the prefill's token
    is the whole answer) or none verified a draft (plain steps only)."""
    if not s["cycles"]:
        return [f"[dim]tau       [/dim] {NO_CYCLE[bool(s['generation_tokens'])]}"]
    tau = (
        f"[dim]tau       [/dim] {s['tau']:.2f} tokens/cycle over {s['cycles']} "
        f"cycle{'s' if s['cycles'] != 1 else ''} "
        f"(block {s['block_size']}, selector {'on' if s['selector'] else 'off'}"
        + (f", {s['copied_cycles']} copied from the context" if s["copied_cycles"] else "")
        + (f", {s['sibling_cycles']} took a sibling)" if s.get("sibling_cycles") else ")")
    )
    if not any(int(b) > 1 for b in s["blocks"]) and s["blocks"]:
        return [tau, "[dim]acceptance[/dim] none: every cycle was a plain step, no draft verified"]
    acc = s["acceptance"]
    pct = " ".join(f"{round(100 * a):d}" for a in acc)
    return [tau, f"[dim]acceptance[/dim] {sparkline(acc)}  {pct} % by block position"]


def stats_lines(s: dict, timings: dict | None = None, verbose: dict | None = None):
    """The human stats block (rich markup).

    Args:
        s: ``stats_dict``. timings: the cycle's time split to show. verbose: extra lines'
            data: "schedule" (why decoding went plain) and "blas" (the BLAS in use).
    """
    cached = s["prompt_tokens"] - s["prompt_processed"]
    n = s["generation_tokens"]
    rate = f", {s['generation_tps']:.1f} tok/s" if s["cycles"] else ""
    lines = [
        f"[dim]prompt    [/dim] {s['prompt_tokens']} tokens, {s['prompt_tps']:.1f} tok/s"
        + (f" ({cached} from cache)" if cached else ""),
        f"[dim]generated [/dim] {n} token{'' if n == 1 else 's'}{rate}",
        *_drafting_lines(s),
    ]
    if s["block_size"] == "auto" and s["blocks"]:
        blocks = {int(b): n for b, n in s["blocks"].items()}
        lines.append(
            f"[dim]blocks    [/dim] {blocks_text(blocks)} (plain {100 * s['plain_share']:.0f}%)"
        )
    lines.append(f"[dim]peak mem  [/dim] {s['peak_memory_gb']:.2f} GB")
    for note in s.get("notes", []):  # fallbacks: shown without -v, never silent
        lines.append(f"[dim]note      [/dim] {note}")
    for note in (verbose or {}).get("schedule", []):
        lines.append(f"[dim]schedule  [/dim] {note}")
    if (verbose or {}).get("blas"):
        lines.append(f"[dim]blas      [/dim] {verbose['blas']}")
    if timings:
        total = sum(timings.values()) or 1.0
        split = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in timings.items())
        lines.append(f"[dim]time split[/dim] {split}")
    return lines


def answer_stats(r) -> str:
    """``dflash chat``'s /stats lines about its last answer (a GenerationResponse)."""
    cached = r.prompt_tokens - r.prompt_processed
    head = (
        f"last answer: prefilled {r.prompt_processed} of {r.prompt_tokens} prompt tokens "
        f"({cached} from cache), {r.prompt_tps:.1f} tok/s\n"
        f"             generated {r.generation_tokens} tokens"
    )
    notes = "".join(f"\n             note: {n}" for n in getattr(r, "notes", None) or [])
    if not r.cycles:
        return f"{head}; tau {NO_CYCLE[bool(r.generation_tokens)]}{notes}"
    acc = " ".join(f"{round(100 * a)}" for a in r.acceptance)
    drafted = any(b > 1 for b in r.blocks)
    return (
        f"{head}, {r.generation_tps:.1f} tok/s, tau {r.tau:.2f} over {r.cycles} cycles "
        f"({r.copied} copied from the context, {r.siblings} took a sibling)\n"
        "             acceptance "
        + (
            f"{sparkline(r.acceptance)}  {acc} % by block position"
            if drafted
            else "none: no draft verified"
        )
        + notes
    )


def stderr_console():
    """A rich console on stderr that leaves text as it is."""
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)
