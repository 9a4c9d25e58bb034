"""``dflash roofline``'s cost model: the bytes one verify cycle of block B reads, part by
part, and the time each takes at a chip's memory bandwidth (decoding on a Mac is bound by
bytes read). From configs alone: no weight is read and nothing runs. Estimates.

Per cycle: the target's verify (every weight but the embedding, the attention KV cache at
the context, a hybrid's recurrent states), the drafter (its layers at ``draft_quant``, its
dense fc / conv / selector projections, the target's LM head over the full or a draft
vocabulary, its context K/V) and, on a hybrid target, the rollback of the Gated DeltaNet
state after a rejection: *replay* (the mixers' input projections again over the kept
tokens) or *tape* (only the recurrence, from inputs the verify kept). On a mixture-of-experts
target the routed experts are counted apart, as many as a verify's rows reach
(``roofline_moe``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..loading.footprint import config_int
from ..model.verify_attention import fused_rows
from . import roofline_data as data
from . import roofline_moe as moe_model

GROUP = 64  # the drafter's quantization group (model/quantize.py)


@dataclass
class Inputs:
    """What the model is asked about.

    Attributes:
        target, drafter: config dicts (``text_config`` merged). quant: the target's
            (``roofline_data.QUANT_BYTES``). draft_quant: the drafter's layers' bits (0:
            bf16). draft_vocab: its draft vocabulary (0: the full one). block: B rows per
            verify. context: tokens in the caches. rollback: "tape" or "replay".
            correlation: a MoE target's measured over uniform expert union
            (``roofline_moe.CORRELATION``).
    """

    target: dict
    drafter: dict
    quant: str = "4bit"
    draft_quant: int = 4
    draft_vocab: int = 0
    block: int = 8
    context: int = 4096
    rollback: str = "tape"
    correlation: float = moe_model.CORRELATION


@dataclass
class Report:
    """Bytes per part (name -> bytes, in order), the chunks MLX's fused attention allows,
    and the totals the command prints."""

    parts: dict[str, float] = field(default_factory=dict)
    chunks: int = 1
    rows_per_chunk: int = 0
    hybrid: bool = False
    plain: float = 0.0  # bytes of one plain decoding step (B = 1)
    other: tuple[str, float] | None = None  # (kind, bytes) of the rollback not counted
    moe: moe_model.MoE | None = None  # a MoE target's routed experts
    expert_bytes: float = 0.0  # one expert read in every MoE layer

    def group(self, prefix: str) -> float:
        """Bytes of the parts whose name starts with ``prefix``."""
        return sum(v for k, v in self.parts.items() if k.startswith(prefix))


def _attention(cfg: dict) -> tuple[int, int, int, int]:
    """(attention layers, heads, KV heads, head dim) of a target config."""
    layers = config_int(cfg, "num_hidden_layers")
    heads = config_int(cfg, "num_attention_heads", 1)
    kv = config_int(cfg, "num_key_value_heads", heads)
    hd = config_int(cfg, "head_dim", config_int(cfg, "hidden_size") // heads)
    if "linear_num_value_heads" in cfg:
        layers //= config_int(cfg, "full_attention_interval", 4)
    return layers, heads, kv, hd


def _deltanet(cfg: dict) -> tuple[int, int, int, int]:
    """(Gated DeltaNet layers, input-projection width, state bytes per layer, one kept
    token's recurrence inputs in elements) of a hybrid target; zeros for a dense one."""
    if "linear_num_value_heads" not in cfg:
        return 0, 0, 0, 0
    layers = config_int(cfg, "num_hidden_layers")
    layers -= layers // config_int(cfg, "full_attention_interval", 4)
    hv, hk = config_int(cfg, "linear_num_value_heads"), config_int(cfg, "linear_num_key_heads")
    dk, dv = config_int(cfg, "linear_key_head_dim"), config_int(cfg, "linear_value_head_dim")
    qkv = 2 * hk * dk + hv * dv
    conv = (config_int(cfg, "linear_conv_kernel_dim", 4) - 1) * qkv * 2  # 16-bit window
    state = hv * dk * dv * 4 + conv  # the float32 recurrence and the conv window
    return layers, qkv + hv * dv + 2 * hv, state, qkv + 2 * hv  # in: q, k, v, z, b, a


def target_weights(cfg: dict) -> float:
    """Weights a verify reads (all but the embedding, whose B rows are gathered), in
    parameters."""
    H, V = config_int(cfg, "hidden_size"), config_int(cfg, "vocab_size")
    att, heads, kv, hd = _attention(cfg)
    gated = cfg.get("attn_output_gate", "linear_num_value_heads" in cfg)  # qwen3_5's q is gated
    q = heads * hd * (2 if gated else 1)
    attention = att * H * (q + 2 * kv * hd + heads * hd)
    dn, width, _, tape_in = _deltanet(cfg)
    hv, dv = config_int(cfg, "linear_num_value_heads"), config_int(cfg, "linear_value_head_dim")
    conv = (tape_in - 2 * hv) * config_int(cfg, "linear_conv_kernel_dim", 4)  # conv1d taps
    mixers = dn * (H * (width + hv * dv) + conv)  # input, output projections and the conv
    mlp = moe_model.dense_mlp(cfg)  # a MoE target's routed experts are counted apart
    return mlp + attention + mixers + V * H  # + the LM head


def drafter_parts(inp: Inputs, head_bytes: float) -> dict[str, float]:
    """The drafter's bytes per cycle: layers, dense projections, head, context K/V."""
    d = inp.drafter
    dc = d.get("dflash_config", {})
    H, inter = config_int(d, "hidden_size"), config_int(d, "intermediate_size")
    heads, kv = config_int(d, "num_attention_heads", 1), config_int(d, "num_key_value_heads", 1)
    hd, n = config_int(d, "head_dim", H // heads), config_int(d, "num_hidden_layers")
    layer = H * (2 * heads * hd + 2 * kv * hd) + 3 * H * inter
    per = inp.draft_quant / 8 + 4 / GROUP if inp.draft_quant else 2.0
    taps = len(dc.get("target_layer_ids", [])) or 5
    conv = 0
    if "DFlash2DraftModel" in d.get("architectures", ["DFlash2DraftModel"]):
        groups = H // (dc.get("conv_group_size") or 16)
        conv = n * 2 * H * 2 * (dc.get("conv_kernel_size") or 2) * groups
        conv += H * (dc.get("selector_rank") or 256)
    V = inp.draft_vocab or config_int(d, "vocab_size")
    window = d.get("sliding_window") or inp.context
    ctx = min(inp.context, window) * n * 2 * kv * hd * 2
    return {
        f"drafter layers ({inp.draft_quant or 16}-bit)": n * layer * per,
        "drafter fc, conv, selector (16-bit)": (taps * H * H + conv) * 2.0,
        f"drafter head ({V:,} rows)": V * H * head_bytes,
        "drafter context K/V": ctx,
    }


def estimate(inp: Inputs) -> Report:
    """The bytes of one verify cycle, part by part.

    Args:
        inp: the pair, quantizations, block, context and rollback kind.
    """
    t = inp.target
    per = data.QUANT_BYTES[inp.quant]
    rep = Report()
    rep.parts["target weights (verify)"] = target_weights(t) * per
    att, heads, kv, hd = _attention(t)
    rep.rows_per_chunk = fused_rows(heads, kv)  # what the verify's chunks take on Metal
    rep.chunks = math.ceil(inp.block / rep.rows_per_chunk)
    kv_bytes = att * 2 * kv * hd * inp.context * 2  # 16-bit K and V
    rep.parts[f"target KV ({inp.context:,} tokens x {rep.chunks} chunks)"] = kv_bytes * rep.chunks
    dn, width, state, tape_in = _deltanet(t)
    rep.hybrid = dn > 0
    if dn:
        rep.parts["target recurrent states (read, write)"] = dn * 2 * state
    rep.plain = rep.group("target") - kv_bytes * (rep.chunks - 1)
    _experts(rep, inp, per)
    rep.parts.update(drafter_parts(inp, per))
    if dn:
        H = config_int(t, "hidden_size")
        replay = dn * (H * width * per + 2 * state)
        tape = dn * (2 * state + inp.block * tape_in * 2)
        both = {"tape": tape, "replay": replay}
        rep.parts[f"rollback ({inp.rollback})"] = both.pop(inp.rollback)
        rep.other = next(iter(both.items()))  # the rollback not chosen, for comparison
    return rep


def _experts(rep: Report, inp: Inputs, per: float) -> None:
    """A MoE target's routed experts: the union a verify of ``inp.block`` rows reads (as the
    grouped verify reads it), k of them in a plain step."""
    rep.moe = moe_model.moe_of(inp.target)
    if rep.moe is None:
        return
    m = rep.moe
    rep.expert_bytes = m.layers * m.expert * per
    u = moe_model.union(m, inp.block, inp.correlation)
    rep.parts[f"target routed experts ({u:.1f} of {m.experts} a layer)"] = u * rep.expert_bytes
    rep.plain += m.top_k * rep.expert_bytes


def summary(rep: Report, bandwidth: float) -> dict:
    """Totals: the target's verify, the drafter, the rollback, the cycle, the drafter and
    rollback as a share of the verify, and the seconds each takes at ``bandwidth`` GB/s."""
    verify = rep.group("target")
    drafter = rep.group("drafter")
    rollback = rep.group("rollback")
    cycle = verify + drafter + rollback
    sec = 1e9 * bandwidth
    return {
        "target_verify_bytes": verify,
        "drafter_bytes": drafter,
        "rollback_bytes": rollback,
        "cycle_bytes": cycle,
        "drafter_and_rollback_share": (drafter + rollback) / verify if verify else 0.0,
        "plain_step_bytes": rep.plain,
        "break_even_tau": cycle / rep.plain if rep.plain else 0.0,
        "cycle_seconds": cycle / sec,
        "verify_seconds": verify / sec,
        "fused_attention_rows_per_chunk": rep.rows_per_chunk,
        "fused_attention_chunks": rep.chunks,
    }


TAUS = (3.0, 4.8)  # tokens a cycle commits, for the predicted speedups


def row_cost(column: str, quant: str, chip_name: str, rows: int) -> float:
    """One matmul over ``rows`` rows over one row, for a ``compute`` column: "bytes_only"
    (1.0), "mlx_qmm" (MLX's quantized matmul; bf16 is flat) or "few_row" (the few-row
    kernel on affine 4 / 8 bits, else MLX's). Estimated."""
    if column == "bytes_only" or quant == "bf16":
        return 1.0
    if column == "few_row" and quant in ("4bit", "8bit"):
        return data.few_row_ratio(chip_name, rows)
    return data.mlx_qmm_ratio(chip_name, rows)


def _experts_cost(rep: Report, inp: Inputs, column: str, chip_name: str) -> tuple[float, float]:
    """(expert reads per layer, their bytes-equivalent cost) of a verify in a ``compute``
    column: MLX's ``SwitchGLU`` for "mlx_qmm", the grouped verify otherwise."""
    if rep.moe is None:
        return 0.0, 0.0
    kernel = "mlx" if column == "mlx_qmm" else "grouped"
    n = moe_model.reads(rep.moe, inp.block, kernel, inp.correlation)
    m = moe_model.rows_per_read(rep.moe, inp.block, kernel, inp.correlation)
    return n, n * rep.expert_bytes * row_cost(column, inp.quant, chip_name, m)


def compute(rep: Report, inp: Inputs, chip_name: str, bandwidth: float) -> dict:
    """The cycle with quantized matmul's cost per row, for MLX's kernel and ours.

    A verify of B rows costs the target's weights' bytes times the kernel's B-row ratio
    (``row_cost``); the drafter's quantized layers pay MLX's ratio in both columns (only
    the target is wrapped); the rest stays bytes-bound. A MoE target's routed experts are
    read as each kernel reads them (``roofline_moe.reads``), each read at the row cost of
    the rows sharing it. A plain step is one row: bytes-bound. All estimated.

    Args:
        rep: ``estimate``'s report. inp: its inputs. chip_name: a ``CHIPS`` key.
        bandwidth: GB/s.

    Returns:
        {"source": the MLX figure's origin, "block", "taus", "bytes_only" / "mlx_qmm" /
        "few_row": each's rows ratio, expert reads per layer (0: dense), cycle seconds,
        break-even tokens per cycle and speedups at ``TAUS``}.
    """
    sec = 1e9 * bandwidth
    weights = rep.parts["target weights (verify)"]
    draft = rep.group("drafter layers") if inp.draft_quant else 0.0
    experts = rep.group("target routed experts")
    rest = rep.group("") - weights - draft - experts
    mlx = data.mlx_qmm_ratio(chip_name, inp.block)
    out = {"source": data.qmm_rows(chip_name)[1], "block": inp.block, "taus": TAUS}
    plain = rep.plain / sec
    for name in ("bytes_only", "mlx_qmm", "few_row"):
        r = row_cost(name, inp.quant, chip_name, inp.block)
        reads, routed = _experts_cost(rep, inp, name, chip_name)
        cycle = (rest + weights * r + routed + draft * (1.0 if name == "bytes_only" else mlx)) / sec
        even = cycle / plain
        speed = {f"speedup_at_tau_{t:g}": t / even if t <= inp.block else None for t in TAUS}
        out[name] = {"rows_ratio": r, "expert_reads": reads, "cycle_seconds": cycle}
        out[name] |= {"break_even_tau": even, **speed}
    return out


BLOCKS = (2, 3, 4, 5, 6, 8, 12, 16)  # the widths ``by_block`` lists (up to the block asked)


def by_block(inp: Inputs, chip_name: str, bandwidth: float) -> list[dict]:
    """``compute`` at each width of ``BLOCKS`` up to ``inp.block`` (and at it): per block,
    a MoE target's expert union and MLX's expert reads per layer, then MLX's kernel's and
    ours' break-even tokens per cycle and speedups at ``TAUS``. Estimated.

    Args:
        inp: the pair as asked (its block is the widest listed). chip_name: a ``CHIPS``
            key. bandwidth: GB/s.
    """
    rows = []
    for b in sorted({b for b in BLOCKS if b <= inp.block} | {inp.block}):
        at = replace(inp, block=b)
        c = compute(estimate(at), at, chip_name, bandwidth)
        row = {"block": b, "union": c["few_row"]["expert_reads"] or None}
        row["mlx_expert_reads"] = c["mlx_qmm"]["expert_reads"] or None
        for name, col in (("mlx", "mlx_qmm"), ("ours", "few_row")):
            keep = ("break_even_tau", *(f"speedup_at_tau_{t:g}" for t in TAUS))
            row[name] = {k: c[col][k] for k in keep}
        rows.append(row)
    return rows


def batched(rep: Report, inp: Inputs, chip_name: str, bandwidth: float, rows: int) -> dict:
    """A batch of ``rows`` requests on a Mac (estimated): one plain step of all rows (rows x
    1 tokens) against one verify of all rows' blocks (rows x ``inp.block`` tokens). The
    target's and the drafter's quantized weights are read once for all rows at MLX's
    quantized-matmul row ratio (``roofline_data.mlx_qmm_ratio``; a batched verify turns
    compute-bound sooner than one row's); each row reads its own KV and context.

    Args:
        rep: ``estimate``'s report. inp: its inputs. chip_name: a ``CHIPS`` key.
        bandwidth: GB/s. rows: requests in the batch.

    Returns:
        {"rows", "block", "plain_step_seconds", "verify_cycle_seconds", "break_even_tau"
        (tokens each row must commit per cycle for the verify to match plain steps)}.
    """
    sec = 1e9 * bandwidth
    weights = rep.parts["target weights (verify)"]
    layers = rep.group("drafter layers")
    parts = ("target KV", "target recurrent", "drafter context", "rollback")
    per_row = sum(rep.group(p) for p in parts)  # each row's own caches
    once = rep.group("drafter") - layers - rep.group("drafter context")  # dense, read once
    plain_row = rep.plain - weights

    def qmm(m: int) -> float:
        return 1.0 if inp.quant == "bf16" else data.mlx_qmm_ratio(chip_name, m)

    plain = (weights * qmm(rows) + rows * plain_row) / sec
    tokens = rows * inp.block
    draft = layers * data.mlx_qmm_ratio(chip_name, tokens) + once
    cycle = (weights * qmm(tokens) + draft + rows * per_row) / sec
    return {
        "rows": rows,
        "block": inp.block,
        "plain_step_seconds": plain,
        "verify_cycle_seconds": cycle,
        "break_even_tau": cycle / plain,
        "estimated": True,
    }
