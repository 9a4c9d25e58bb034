"""``dflash roofline`` on a mixture-of-experts target: the routed experts a verify reads.

One plain step reads k experts per MoE layer; a verify of B rows reads the union of the
experts its rows route to. With uniform routing the expected union is E(1 - (1 - k/E)^B);
measured unions are lower (neighbouring tokens share experts), so it is scaled by a
correlation factor (``CORRELATION``). How often an expert's weights are read depends on
the kernel: MLX's ``SwitchGLU`` sorts a verify's (row, slot) pairs by expert only when
B x k >= 64 (mlx-lm ``switch_layers.py``), so below that it reads one expert per pair; the
grouped verify (``model/moe.py``) reads each chosen expert once. Estimates, from configs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..loading.footprint import config_int

# Measured union over the uniform one: lucebox PR #501 (Laguna XS, 256 experts, top 8)
# counted 39.4 distinct experts in 8 rows, where uniform routing gives 57.4 (0.69); at 15
# rows 58.9 of 97.0 (0.61). The 8-row figure is the default (``--moe-correlation``).
CORRELATION = 0.69
SORT_PAIRS = 64  # mlx-lm's SwitchGLU sorts rows by expert from this many (row, slot) pairs


@dataclass(frozen=True)
class MoE:
    """A target's routed experts.

    Attributes:
        layers: MoE layers. experts: E per layer. top_k: k experts per token.
        expert: parameters of one expert (gate, up and down projections).
        shared: parameters per MoE layer read by every token (shared expert, its gate, the
            router).
    """

    layers: int
    experts: int
    top_k: int
    expert: int
    shared: int


def moe_of(cfg: dict) -> MoE | None:
    """The routed experts of a target config (``text_config`` merged); None for a dense
    one. Reads mlx-lm's qwen3_moe / qwen3_5_moe / qwen3_next fields."""
    E = config_int(cfg, "num_experts") or config_int(cfg, "num_local_experts")
    k = config_int(cfg, "num_experts_per_tok")
    if not E or not k:
        return None
    H, n = config_int(cfg, "hidden_size"), config_int(cfg, "num_hidden_layers")
    dense = set(cfg.get("mlp_only_layers") or [])
    step = config_int(cfg, "decoder_sparse_step", 1)
    layers = sum(1 for i in range(n) if i not in dense and (i + 1) % step == 0)
    inter = config_int(cfg, "moe_intermediate_size", config_int(cfg, "intermediate_size"))
    shared = config_int(cfg, "shared_expert_intermediate_size")
    shared = 3 * H * shared + H if shared else 0  # its projections and its 1-wide gate
    return MoE(layers, E, k, 3 * H * inter, shared + H * E)


def dense_mlp(cfg: dict) -> float:
    """Parameters of the MLPs a verify reads once whatever its rows: dense layers' MLPs,
    plus on a MoE target its shared experts and routers (not the routed experts)."""
    H, n = config_int(cfg, "hidden_size"), config_int(cfg, "num_hidden_layers")
    inter = config_int(cfg, "intermediate_size", 4 * H)
    moe = moe_of(cfg)
    if moe is None:
        return n * 3 * H * inter
    return (n - moe.layers) * 3 * H * inter + moe.layers * moe.shared


def union(moe: MoE, rows: int, correlation: float = CORRELATION) -> float:
    """Expected distinct experts a verify of ``rows`` rows reads per layer: the uniform
    E(1 - (1 - k/E)^B) times ``correlation``, never under the k one row reads nor over
    B x k or E."""
    E, k = moe.experts, moe.top_k
    uniform = E * (1 - (1 - k / E) ** rows)
    return min(max(correlation * uniform, float(k)), float(min(E, rows * k)))


def reads(moe: MoE, rows: int, kernel: str, correlation: float = CORRELATION) -> float:
    """Expert weight reads per layer of a verify of ``rows`` rows by ``kernel``: "mlx"
    (``SwitchGLU``: one per (row, slot) pair below ``SORT_PAIRS`` pairs, else the union)
    or "grouped" (each chosen expert once: the union)."""
    if kernel == "mlx" and rows * moe.top_k < SORT_PAIRS:
        return float(rows * moe.top_k)
    return union(moe, rows, correlation)


def rows_per_read(moe: MoE, rows: int, kernel: str, correlation: float = CORRELATION) -> int:
    """Rows one expert read multiplies: 1 on MLX's unsorted path (one read per (row, slot)
    pair), else the B x k pairs shared among the reads (rounded)."""
    n = reads(moe, rows, kernel, correlation)
    return max(1, round(rows * moe.top_k / n))
