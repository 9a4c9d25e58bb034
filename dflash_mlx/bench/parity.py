"""``dflash bench``'s parity report: per prompt, whether each method's greedy tokens (and
text) equal plain decoding's, and the first token where they differ (docs/algorithm.md
§4.2.1 says when they must be equal: the CPU backend with the few-row kernel; on Metal they
may part at floating-point near-ties).
"""

from __future__ import annotations


def first_difference(plain: list[int], other: list[int]) -> int | None:
    """Index of the first token where two outputs differ, or None when they are equal.

    Args:
        plain, other: token ids. A shorter output differs at its end.
    """
    for i, (a, b) in enumerate(zip(plain, other, strict=False)):
        if a != b:
            return i
    return None if len(plain) == len(other) else min(len(plain), len(other))


def parity_report(outputs: list[dict[str, list[int]]], temperature: float, decode=None) -> dict:
    """Compare every method's output with plain decoding's, prompt by prompt.

    Args:
        outputs: per prompt, method -> generated token ids ("autoregressive" is plain).
        temperature: the run's; only greedy runs (0) are compared.
        decode: tokenizer.decode, to compare the texts too (None: tokens only).

    Returns:
        ``{"greedy": False}`` for a sampled run; else ``{"greedy": True, "prompts": [{method:
        {"identical", "text_equal", "first_diff", "tokens"}}], "summary": {method:
        {"identical", "of", "first_diffs"}}}``.
    """
    if temperature != 0:
        return {"greedy": False}
    prompts, summary = [], {}
    for out in outputs:
        plain, row = out["autoregressive"], {}
        for m, toks in out.items():
            if m == "autoregressive":
                continue
            at = first_difference(plain, toks)
            text_equal = at is None or (decode is not None and decode(plain) == decode(toks))
            row[m] = {"identical": at is None, "text_equal": text_equal, "first_diff": at}
            row[m]["tokens"] = len(toks)
            s = summary.setdefault(m, {"identical": 0, "of": 0, "first_diffs": []})
            s["identical"] += at is None
            s["of"] += 1
            if at is not None:
                s["first_diffs"].append(at)
        prompts.append(row)
    return {"greedy": True, "prompts": prompts, "summary": summary}


def summary_line(parity: dict | None) -> str | None:
    """One line for the table output, e.g. ``greedy parity with plain decoding: dflash2 3/3
    identical · auto 2/3 (first differs at token 41)``; None when nothing was compared.

    Args:
        parity: the report's ``parity`` entry.
    """
    if not parity:
        return None
    if not parity.get("greedy"):
        return "greedy parity with plain decoding: not measured (sampled run)"
    parts = []
    for m, s in parity["summary"].items():
        part = f"{m} {s['identical']}/{s['of']} identical"
        if s["first_diffs"]:
            part += f" (first differs at token {min(s['first_diffs'])})"
        parts.append(part)
    return "greedy parity with plain decoding: " + " · ".join(parts)
