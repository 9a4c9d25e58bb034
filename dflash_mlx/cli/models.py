"""``dflash models``: the registry and what of it is already in the local cache."""

from __future__ import annotations

import json
import os

import typer

from ..errors import DFlashError
from ..loading import hub, registry


def _local_size(path: str) -> int | None:
    return hub.dir_size(path) if os.path.exists(path) else None


def _cached(e: registry.Entry):
    """(cached target bytes per quantisation, cached bytes per drafter) of an entry."""
    if e.local:
        tsize = _local_size(e.target())
        tcached = {e.default_quant: tsize} if tsize is not None else {}
        return tcached, [_local_size(d) for d in e.drafters]
    sizes = {q: _downloaded(r) for q, r in e.targets.items()}
    return {q: s for q, s in sizes.items() if s is not None}, [_downloaded(d) for d in e.drafters]


def _downloaded(repo_id: str) -> int | None:
    """Cached bytes of a Hub repo whose weights are all there, else None (a snapshot
    holding only config.json, fetched to plan memory before a download, is not cached)."""
    from ..loading.footprint import complete

    path = hub.cached(repo_id)
    return hub.cached_size(repo_id) if path is not None and complete(path) else None


def _memory(e: registry.Entry) -> dict[str, tuple[int, int]]:
    """(estimated peak bytes, at a context) per quantisation whose target and a drafter are
    on this machine; nothing is downloaded or loaded."""
    from ..loading import memory

    drafter = next(filter(None, (memory.offline_path(d) for d in e.drafters)), None)
    out = {}
    for q, target in e.targets.items() if drafter is not None else ():
        path = memory.offline_path(target)
        try:
            plan = memory.make_plan(path, drafter) if path is not None else None
        except (OSError, ValueError, KeyError, TypeError, AttributeError, DFlashError):
            plan = None  # a damaged file: loading it names the problem
        if plan is not None:
            out[q] = (plan.peak, plan.context)
    return out


def _short(path: str) -> str:
    """A package-data path relative to the installed package's parent, else as given."""
    pkg = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if os.path.isabs(path) and path.startswith(pkg + os.sep):
        return os.path.relpath(path, pkg)
    return path


def _print_json(rows) -> None:
    print(
        json.dumps(
            [
                {
                    "alias": e.alias,
                    "target": e.target(),
                    "quants": e.targets,
                    "drafters": list(e.drafters),
                    "block_size": e.block_size,
                    "kind": e.kind,
                    "moe": e.moe,
                    "cached_targets": tc,
                    "cached_drafters": dict(zip(e.drafters, ds, strict=True)),
                    "memory": {q: {"bytes": b, "context": c} for q, (b, c) in mem.items()},
                    "note": e.note,
                }
                for e, tc, ds, mem in rows
            ],
            indent=2,
        )
    )


def _print_table(rows) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="dflash models", title_justify="left")
    table.add_column("alias", style="bold cyan", no_wrap=True)
    table.add_column("target · --quant", no_wrap=True)
    table.add_column("drafters, tried in order", no_wrap=True)
    table.add_column("in cache")
    table.add_column("memory (estimated)")
    for e, tc, ds, mem in rows:
        moe = " · MoE" if e.moe else ""
        alias = f"{e.alias}\n[dim]{e.kind} · block {e.block_size}{moe}[/dim]"
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
        need = "\n".join(f"{q} ~{b / 1e9:.1f} GB at {c} tok" for q, (b, c) in mem.items())
        table.add_row(alias, target, drafters, cached, need or "[dim]?[/dim]")
    con = Console(highlight=False)
    con.print(table)
    con.print(
        f"[dim]Hub cache: {hub.cache_dir()} · any Hub id or directory also works with "
        "--model (and --drafter)[/dim]"
    )


def models(
    as_json: bool = typer.Option(False, "--json", help="Print the registry as JSON."),
):
    """List the model registry, what is already in the local Hub cache and, for what is,
    the memory each pair needs (estimated: weights, drafter, KV cache at the stated context)."""
    rows = [(e, *_cached(e), _memory(e)) for e in registry.entries()]
    if as_json:
        _print_json(rows)
    else:
        _print_table(rows)
