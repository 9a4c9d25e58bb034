"""What a MoE target's experts read in a bench run: counted per method while it decodes
(``model/moe.py``'s ``ExpertCount``), summed over the prompts for the report."""

from __future__ import annotations


def count(model, res=None, name: str = "") -> None:
    """On a MoE target: start counting the experts read (no ``res``), or keep what the
    method ``name`` read in ``res`` (after its timer stopped)."""
    counter = model.adapter.experts
    if counter is not None and res is None:
        counter.reset()
    elif counter is not None:
        res.experts[name] = counter.take()
        counter.reset(on=False)


def row(model, results, method: str) -> dict | None:
    """The distinct experts a MoE target read per layer per verify and per plain step in
    ``method`` over every prompt (``moe.ExpertCount.summary``); None on a dense target."""
    count = getattr(model.adapter, "experts", None)
    if count is None:
        return None
    sums: dict = {}
    for r in results:
        sums = count.merge(sums, r.experts.get(method, {}))
    return count.summary(sums)
