"""``dflash models``: the registry and what of it is already in the local cache."""

from __future__ import annotations

import json
import os

import typer

from ..loading import hub, registry


def _local_size(path: str) -> int | None:
    return hub.dir_size(path) if os.path.exists(path) else None


def _cached(e: registry.Entry):
    """(cached target bytes per quantisation, cached bytes per drafter) of an entry."""
    if e.local:
        tsize = _local_size(e.target())
        tcached = {e.default_quant: tsize} if tsize is not None else {}
        return tcached, [_local_size(d) for d in e.drafters]
    sizes = {q: hub.cached_size(r) for q, r in e.targets.items()}
    return {q: s for q, s in sizes.items() if s is not None}, [
        hub.cached_size(d) for d in e.drafters
    ]


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
                    "cached_targets": tc,
                    "cached_drafters": dict(zip(e.drafters, ds, strict=True)),
                    "note": e.note,
                }
                for e, tc, ds in rows
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
    con.print(
        f"[dim]Hub cache: {hub.cache_dir()} · any Hub id or directory also works with "
        "--model (and --drafter)[/dim]"
    )


def models(
    as_json: bool = typer.Option(False, "--json", help="Print the registry as JSON."),
):
    """List the model registry and what is already in the local Hub cache."""
    rows = [(e, *_cached(e)) for e in registry.entries()]
    if as_json:
        _print_json(rows)
    else:
        _print_table(rows)
