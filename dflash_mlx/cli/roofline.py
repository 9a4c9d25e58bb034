"""``dflash roofline``: offline, the bytes one verify cycle reads, part by part, and what
each costs at an Apple chip's memory bandwidth (``bench/roofline.py``; estimates)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ..errors import DFlashError

ROLLBACKS = ("tape", "replay")


def _configs(model: str, drafter: str | None) -> tuple[str, dict, dict, str | None]:
    """(name, target config, drafter config, the target's stored quantization or None):
    the registry's table for an alias, else the configs of a local or cached pair."""
    from ..bench import roofline_data as data
    from ..loading import footprint, memory
    from ..loading.loader import resolve

    for alias, arch in data.ARCHS.items():
        if alias.lower() == model.strip().lower():
            return alias, arch["target"], arch["drafter"], None
    res = resolve(model, drafter)
    tpath, dpath = memory.offline_path(res.target), memory.offline_path(res.drafters[0])
    if tpath is None or dpath is None:
        known = ", ".join(data.ARCHS)
        raise DFlashError(
            f"--model {model}: its shapes are not known offline (aliases with built-in shapes: "
            f"{known}); download the pair first (dflash run --model {model}) or give a directory"
        )
    try:
        _, tcfg, _, _ = footprint.target_size(Path(tpath), cpu=False)
        dcfg = json.loads((Path(dpath) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise DFlashError(f"--model {model}: cannot read its configs ({e}); re-download it")
    bits = (tcfg.get("quantization") or {}).get("bits")
    return res.display_name, tcfg, dcfg, {4: "4bit", 8: "8bit"}.get(bits)


def _check(quant, context: int, block: int | None, draft_vocab: int | None, rollback: str):
    from ..bench.roofline_data import QUANT_BYTES

    if quant is not None and quant.lower() not in QUANT_BYTES:
        choices = ", ".join(QUANT_BYTES)
        raise DFlashError(f"--quant {quant} is not one of {choices}; pick one of them")
    if context < 1:
        raise DFlashError(f"--context must be at least 1 token (got {context})")
    if block is not None and not 2 <= block <= 64:
        raise DFlashError(f"--block must be in 2..64 (got {block})")
    if draft_vocab is not None and draft_vocab < 0:
        raise DFlashError(
            f"--draft-vocab must be 0 (the full vocabulary) or a size (got {draft_vocab})"
        )
    if rollback not in ROLLBACKS:
        raise DFlashError(f"--rollback must be tape or replay (got {rollback!r})")


def _check_group(hosts: int, link: str, shard: str) -> None:
    from ..bench.roofline_link import LINKS, MODES

    if not 1 <= hosts <= 64:
        raise DFlashError(f"--hosts must be 1 to 64 Macs (got {hosts})")
    if link not in LINKS:
        raise DFlashError(f"--link {link} is not one of {', '.join(LINKS)}; pick one of them")
    if shard not in MODES:
        raise DFlashError(f"--shard must be tensor or pipeline (got {shard!r})")


def _check_sizes(configs: tuple, context: int, draft_vocab: int | None) -> tuple:
    """``_configs``'s answer, after refusing a context past the model's and a draft
    vocabulary past its vocabulary."""
    _, tcfg, dcfg, _ = configs
    from ..loading.footprint import config_int
    from ..loading.memory import MAX_CONTEXT

    limit = config_int(tcfg, "max_position_embeddings") or MAX_CONTEXT
    if context > limit:
        raise DFlashError(
            f"--context {context} is past this model's context ({limit} tokens); "
            f"use --context {limit} or less"
        )
    vocab = config_int(dcfg, "vocab_size") or config_int(tcfg, "vocab_size")
    if draft_vocab and vocab and draft_vocab > vocab:
        raise DFlashError(
            f"--draft-vocab {draft_vocab} is past this model's vocabulary ({vocab} ids); "
            f"use --draft-vocab {vocab} or less (0: the full vocabulary)"
        )
    return configs


def roofline(
    model: str = typer.Option(
        ..., "--model", help="Registry alias, local pair or cached Hub id.", show_default=False
    ),
    drafter: str = typer.Option(None, "--drafter", help="Drafter directory (default: the pair's)."),
    quant: str = typer.Option(
        None, "--quant", help="The target's: 4bit (default), 8bit, bf16, mxfp8."
    ),
    chip: str = typer.Option("M4 Pro", "--chip", help='Apple chip, e.g. "M4 Pro", "M3 Max".'),
    context: int = typer.Option(4096, "--context", help="Tokens in the caches."),
    block: int = typer.Option(None, "--block", help="Rows per verify (default: the drafter's)."),
    draft_quant: str = typer.Option(
        "4", "--draft-quant", help="The drafter's layers: 4, 8 or none."
    ),
    draft_vocab: int = typer.Option(
        None, "--draft-vocab", help="Draft vocabulary size (0: full; default: the drafter's own)."
    ),
    rollback: str = typer.Option("tape", "--rollback", help="A hybrid's rollback: tape or replay."),
    hosts: int = typer.Option(1, "--hosts", help="Macs the target is sharded over."),
    link: str = typer.Option("tb5-rdma", "--link", help="Their link: tb5-rdma, tb5, tb4, ..."),
    shard: str = typer.Option("tensor", "--shard", help="With --hosts: tensor or pipeline."),
    moe_correlation: float = typer.Option(
        None,
        "--moe-correlation",
        help="A MoE target's expert union over the uniform one (default 0.69: lucebox #501).",
    ),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead."),
):
    """Offline cost model of a verify cycle: the bytes the target's verify, the drafter and
    the rollback read, and their time at the chip's bandwidth (estimated; nothing runs).
    On a mixture-of-experts target the routed experts are the union a verify's rows reach.
    Then each block's break-even tokens per cycle and speedups, with MLX's kernels and ours.
    With --hosts N, also plain and DFlash per token with the link's round trips added."""
    from ..bench import roofline_data as data
    from ..model.config import parse_draft_quant

    _check(quant, context, block, draft_vocab, rollback)
    _check_group(hosts, link, shard)
    correlation = _check_correlation(moe_correlation)
    bits = parse_draft_quant(draft_quant, "--draft-quant")
    try:
        chip_name, bandwidth, note = data.chip(chip)
    except KeyError:
        raise DFlashError(f"--chip {chip!r} is unknown; use one of: {', '.join(data.CHIPS)}")
    name, tcfg, dcfg, stored = _check_sizes(_configs(model, drafter), context, draft_vocab)
    inp = _inputs(tcfg, dcfg, (quant or stored or "4bit").lower(), bits, draft_vocab, block)
    inp.context, inp.rollback, inp.correlation = context, rollback, correlation
    head = {"model": name, "quant": inp.quant, "chip": chip_name, "bandwidth_gb_s": bandwidth}
    _report(head, inp, (chip_name, bandwidth, note), (hosts, link, shard), json_out)


def _check_correlation(value: float | None) -> float:
    """``--moe-correlation``, or its cited default."""
    from ..bench.roofline_moe import CORRELATION

    if value is None:
        return CORRELATION
    if not 0 < value <= 1:
        raise DFlashError(
            f"--moe-correlation must be above 0 and at most 1 (got {value}); 1 is uniform "
            f"routing, the default {CORRELATION} the measured union"
        )
    return value


def _report(head: dict, inp, chip: tuple, group_args: tuple, json_out: bool) -> None:
    """Estimate the cycle of ``inp`` on ``chip`` (name, GB/s, note) and print the table or
    the JSON object."""
    from ..bench import roofline as rl

    chip_name, bandwidth, note = chip
    rep = rl.estimate(inp)
    total = rl.summary(rep, bandwidth) | {"compute": rl.compute(rep, inp, chip_name, bandwidth)}
    total["blocks"] = rl.by_block(inp, chip_name, bandwidth)
    head |= {"block": inp.block, "context": inp.context, "draft_quant": inp.draft_quant}
    head |= {"draft_vocab": inp.draft_vocab, "rollback": inp.rollback if rep.hybrid else None}
    head["moe"] = _moe(rep, inp)
    group = _group(inp, rep, total, bandwidth, group_args)
    if json_out:
        head["hosts"] = group
        parts = {k: {"bytes": v, "seconds": v / (bandwidth * 1e9)} for k, v in rep.parts.items()}
        other = None if rep.other is None else {"kind": rep.other[0], "bytes": rep.other[1]}
        print(
            json.dumps(
                {**head, "estimated": True, "parts": parts, **total, "other_rollback": other}
            )
        )
        return
    _print(head, rep, total, bandwidth, note)
    if group is not None:
        print(_render(head["model"], inp.quant, chip_name, group))


def _moe(rep, inp) -> dict | None:
    """A MoE target's experts for the report: E, k, layers, the union at the block (uniform
    and as counted), the correlation and MLX's reads; None for a dense target."""
    from ..bench import roofline_moe as moe_model

    m = rep.moe
    if m is None:
        return None
    uniform = moe_model.union(m, inp.block, 1.0)
    return {
        "experts": m.experts,
        "top_k": m.top_k,
        "layers": m.layers,
        "uniform_union": uniform,
        "correlation": inp.correlation,
        "union": moe_model.union(m, inp.block, inp.correlation),
        "mlx_reads": moe_model.reads(m, inp.block, "mlx", inp.correlation),
        "mlx_sorts": inp.block * m.top_k >= moe_model.SORT_PAIRS,
    }


def _inputs(tcfg: dict, dcfg: dict, quant: str, bits, draft_vocab, block):
    """``roofline.Inputs`` of a pair: the drafter's own draft vocabulary and block unless
    given."""
    from ..bench import roofline as rl

    dc = dcfg.get("dflash_config", {})
    draft_vocab = dc.get("draft_vocab_size") or 0 if draft_vocab is None else draft_vocab
    block = block or dc.get("block_size") or dcfg.get("block_size") or 8
    draft_quant = 4 if bits is None else bits
    return rl.Inputs(tcfg, dcfg, quant, draft_quant, draft_vocab, block)


def _group(inp, rep, total: dict, bandwidth: float, group: tuple) -> dict | None:
    """``roofline_link.estimate`` for (hosts, link, mode); None for one Mac."""
    if group[0] <= 1:
        return None
    from ..bench import roofline_link

    return roofline_link.estimate(inp, rep, total["compute"]["mlx_qmm"], bandwidth, *group)


def _render(name: str, quant: str, chip_name: str, group: dict) -> str:
    from ..bench.roofline_link import render

    return render(name, quant, chip_name, group["hosts"], group["link"], group["mode"], group)


def _print(head: dict, rep, total: dict, bandwidth: float, note: str) -> None:
    """The table: one row per part, GB and ms at the chip's bandwidth, then the totals."""
    ms = 1e3 / (bandwidth * 1e9)
    print(
        f"{head['model']} {head['quant']}, block {head['block']}, context {head['context']:,}, "
        f"drafter {head['draft_quant'] or 16}-bit, on {head['chip']} ({bandwidth:g} GB/s, "
        "estimated)"
    )
    print(f"{'part':<48}{'GB':>8}{'ms':>9}")
    for k, v in rep.parts.items():
        print(f"{k:<48}{v / 1e9:>8.3f}{v * ms:>9.2f}")
    print(f"{'cycle total':<48}{total['cycle_bytes'] / 1e9:>8.3f}{total['cycle_bytes'] * ms:>9.2f}")
    print(
        f"drafter + rollback: {total['drafter_and_rollback_share']:.1%} of the target's verify; "
        f"a cycle must commit {total['break_even_tau']:.2f} tokens to match plain decoding "
        f"({total['plain_step_bytes'] / 1e9:.2f} GB a step)"
    )
    print(
        f"fused vector attention: {rep.rows_per_chunk} rows a chunk, {rep.chunks} chunk(s) "
        f"per verify (q_len <= 8 and q_len x heads / KV heads <= 32)"
    )
    if head["moe"] is not None:
        print(_moe_line(head["moe"], head["block"]))
    if rep.other is not None:
        kind, v = rep.other
        print(f"rollback by {kind} instead: {v / 1e9:.3f} GB ({v * ms:.2f} ms)")
    if note:
        print(f"note: {note}")
    _print_compute(total["compute"])
    _print_blocks(total["blocks"], head["moe"] is not None)


def _print_compute(c: dict) -> None:
    """MLX's quantized matmul against the few-row kernel: their row cost, the break-even
    tokens per cycle and the predicted speedups (``bench/roofline.compute``)."""
    cols = ("bytes_only", "mlx_qmm", "few_row")
    print(
        f"quantized matmul at {c['block']} rows over 1 row (estimated): MLX's qmm "
        f"{c['mlx_qmm']['rows_ratio']:.2f}x ({c['source']}); few-row kernel "
        f"{c['few_row']['rows_ratio']:.2f}x (one pass over the weights and a small cost a row)"
    )
    print(f"{'(estimated)':<32}{'bytes only':>12}{'MLX qmm':>12}{'few-row':>12}")
    rows = [
        ("cycle ms", "cycle_seconds", 1e3),
        ("break-even tokens per cycle", "break_even_tau", 1),
    ]
    rows += [(f"speedup at tau {t:g}", f"speedup_at_tau_{t:g}", 1) for t in c["taus"]]
    for label, key, scale in rows:
        cells = [c[col][key] for col in cols]
        text = "".join(f"{'-' if v is None else f'{v * scale:.2f}':>12}" for v in cells)
        print(f"{label:<32}{text}")


def _moe_line(m: dict, block: int) -> str:
    """What a MoE target's experts cost a verify of ``block`` rows."""
    how = "sorted by expert" if m["mlx_sorts"] else "one read per (row, slot) below 64 pairs"
    return (
        f"routed experts: {m['experts']} a layer, top {m['top_k']}, in {m['layers']} layers; "
        f"a plain step reads {m['top_k']}, a verify of {block} rows the union "
        f"{m['union']:.1f} (uniform {m['uniform_union']:.1f} x correlation "
        f"{m['correlation']:g}; lucebox #501 measured 39.4 of 57.4 at 8 rows); MLX's "
        f"SwitchGLU reads {m['mlx_reads']:.0f} ({how}), the grouped verify {m['union']:.1f}"
    )


def _print_blocks(rows: list[dict], moe: bool) -> None:
    """Per block: break-even tokens per cycle and speedups at tau 3 and 4.8, MLX's kernels
    (qmm and SwitchGLU) against ours (few-row and grouped verify); a MoE target's expert
    reads per layer first."""
    taus = [k for k in rows[0]["mlx"] if k.startswith("speedup")]
    head = f"{'block':>5}" + (f"{'union':>8}{'MLX reads':>11}" if moe else "")
    head += f"{'break-even MLX':>16}{'ours':>7}"
    head += "".join(f"{'x at tau ' + k.rsplit('_', 1)[1] + ' MLX':>18}{'ours':>7}" for k in taus)
    print(
        "per block (estimated; ours: the few-row kernel"
        + (" and the grouped verify)" if moe else ")")
    )
    print(head)
    cell = lambda v, w: f"{'-' if v is None else f'{v:.2f}':>{w}}"
    for r in rows:
        line = f"{r['block']:>5}"
        if moe:
            line += f"{r['union']:>8.1f}{r['mlx_expert_reads']:>11.1f}"
        line += cell(r["mlx"]["break_even_tau"], 16) + cell(r["ours"]["break_even_tau"], 7)
        line += "".join(cell(r["mlx"][k], 18) + cell(r["ours"][k], 7) for k in taus)
        print(line)
