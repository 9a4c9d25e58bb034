"""``dflash doctor``: what this install runs on and whether DFlash decodes losslessly here.

The checks are ``dflash_mlx.doctor``'s; this module prints them and sets the exit code.
Under ``mlx.launch`` it also checks the group (docs/distributed.md, "Plans"): every rank
answers an ``all_sum`` in time and runs the same versions on the same model files; only
rank 0 prints, with a line per rank.
"""

from __future__ import annotations

import json

import typer

GROUP_TIMEOUT = 30.0  # seconds for one all_sum over the group


def doctor(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead."),
    model: str = typer.Option(
        "demo", "--model", help="Under mlx.launch: the pair every rank must hold alike."
    ),
):
    """Check this install (device, memory, versions, kernels, a greedy parity check, caches)
    and exit 1 when a check fails; paste its output into bug reports. Under mlx.launch, also
    the group: every rank reachable, the same versions and model files."""
    from .. import distributed
    from ..doctor import as_json, render, run_checks

    group = distributed.group()
    distributed.speak_only_on_rank_zero(group)
    checks = run_checks()
    table = None
    if group is not None:
        check, table = _group_check(group, model)
        checks.append(check)
    out = as_json(checks) | ({"ranks": table} if table else {})
    print(json.dumps(out) if json_out else render(checks), flush=True)
    if table and not json_out:
        from ..distributed.handshake import table as lines

        print(lines(table), flush=True)
    if not all(c.ok for c in checks):
        raise typer.Exit(1)


def _group_check(group, model: str):
    """(the "group" check, every rank's facts or None): an ``all_sum`` within
    ``GROUP_TIMEOUT``, then the ranks' versions and ``model``'s files against rank 0's."""
    from ..distributed import handshake
    from ..doctor import Check
    from ..loading.loader import resolve
    from ..loading.memory import offline_path

    n = group.size()
    seconds = handshake.reachable(group, GROUP_TIMEOUT)
    if seconds is None:
        why = f"an all_sum over {n} ranks did not complete in {GROUP_TIMEOUT:g} s"
        return Check("group", f"{why}: a rank is down or unreachable", ok=False), None
    res = resolve(model)
    paths = [p for p in (offline_path(res.target), offline_path(res.drafters[0])) if p]
    rows = handshake.gather(handshake.facts(paths, ["dflash", "doctor"]), group)
    diff = handshake.differences(rows)
    value = f"{n} ranks answer (an all_sum in {seconds * 1e3:.1f} ms); "
    value += "; ".join(diff) if diff else f"same versions and {model} files on every rank"
    return Check("group", value, ok=not diff), rows
