"""``dflash doctor``: what this install runs on and whether DFlash decodes losslessly here.

The checks are ``dflash_mlx.doctor``'s; this module prints them and sets the exit code.
"""

from __future__ import annotations

import json

import typer


def doctor(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead."),
):
    """Check this install (device, memory, versions, kernels, a greedy parity check, caches)
    and exit 1 when a check fails; paste its output into bug reports."""
    from ..doctor import as_json, render, run_checks

    checks = run_checks()
    print(json.dumps(as_json(checks)) if json_out else render(checks), flush=True)
    if not all(c.ok for c in checks):
        raise typer.Exit(1)
