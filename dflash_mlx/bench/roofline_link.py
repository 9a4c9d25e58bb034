"""``dflash roofline --hosts N --link L``: the one-machine cost model (``roofline.py``) with
the link between the Macs added. Estimates: nothing here ran on Macs.

Per forward, a sharded target pays the link in round trips and in bytes:

- ``tensor`` (mlx-lm's ``shard``): two all-reduces per layer (after the attention or
  DeltaNet mixer and after the MLP), each of [rows, hidden] 16-bit activations; a ring
  all-reduce sends 2(N-1)/N of that per rank. Each rank reads 1/N of the layers' weights
  and KV cache; the embeddings, the head and the drafter are whole on every rank.
- ``pipeline``: one hop per stage (N-1 between the stages and one that shares the last
  stage's result), each of [rows, hidden]; the stages run one after the other, so a
  forward reads every weight once, on whichever rank holds it.

A plain step is a forward of one row; a DFlash cycle is one forward of B rows (its verify)
plus the drafter, and commits tau tokens, so it pays the link once for tau tokens. Under a
group ``auto`` adds one small all-reduce a cycle (rank 0's choice, ``distributed/policy``),
counted. The latency of a round trip grows with the ranks on a ring of more than two; the
cited figures are for the setups named and are kept flat (estimated).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..loading.footprint import config_int
from .roofline_data import QUANT_BYTES


@dataclass(frozen=True)
class Link:
    """A link's cost: seconds per collective round trip, GB/s each way, and the source."""

    latency: float
    bandwidth: float
    source: str


LINKS: dict[str, Link] = {
    "tb5-rdma": Link(
        10e-6,
        3.5,
        "JACCL over Thunderbolt 5 RDMA: 5-9 us reported (techboards.net thread on macOS 26.2 "
        "RDMA, mlx #2808), 'single-digit microseconds' (exo); 3.5-3.8 GB/s sustained (mlx "
        "#3207); 10 us and 3.5 GB/s taken",
    ),
    "tb5": Link(
        300e-6,
        3.0,
        "ring (TCP) over the Thunderbolt bridge: ~300 us per operation for ring backends "
        "(JACCL announcement coverage, wpnews.pro); 0.38-0.95 ms bridge round trips measured "
        "under load (exo #2295); 3 GB/s estimated",
    ),
    "tb4": Link(
        300e-6,
        2.0,
        "ring (TCP) over a Thunderbolt 4 bridge: latency as tb5's (the TCP stack dominates; "
        "estimated); 16.4 Gb/s iperf3 over TB4 (jiribrejcha.net): 2 GB/s",
    ),
    "10gbe": Link(
        300e-6,
        1.1,
        "ring (TCP) over 10 Gb Ethernet: no all-reduce measurement found, latency taken as "
        "the Thunderbolt bridge's (estimated); 10 Gb/s line rate less overhead",
    ),
    "1gbe": Link(
        500e-6,
        0.11,
        "ring (TCP) over 1 Gb Ethernet: estimated (no measurement found); 1 Gb/s line rate",
    ),
    "wifi": Link(
        10e-3,
        0.05,
        "ring (TCP) over Wi-Fi: 7.5-30 ms average round trips measured (exo #2295); 10 ms "
        "and 50 MB/s taken",
    ),
}
MODES = ("tensor", "pipeline")
ACT_BYTES = 2  # 16-bit activations on the wire


def trips(cfg: dict, hosts: int, mode: str) -> int:
    """Collective round trips of one forward of the target over ``hosts`` ranks."""
    if hosts <= 1:
        return 0
    return 2 * config_int(cfg, "num_hidden_layers") if mode == "tensor" else hosts


def wire_bytes(cfg: dict, hosts: int, mode: str, rows: int) -> float:
    """Bytes one rank sends in one forward of ``rows`` rows."""
    if hosts <= 1:
        return 0.0
    one = rows * config_int(cfg, "hidden_size") * ACT_BYTES
    if mode == "tensor":
        return trips(cfg, hosts, mode) * one * 2 * (hosts - 1) / hosts
    return one  # a stage sends its rows once


def shard_seconds(seconds: float, target: float, head: float, hosts: int, mode: str) -> float:
    """Time of ``seconds`` of work of which ``target`` seconds are the target's (``head``
    of them its LM head, kept whole) when each of ``hosts`` tensor ranks does 1/N of the
    rest; pipeline stages take turns, so their time is the whole."""
    if hosts <= 1 or mode == "pipeline":
        return seconds
    return seconds - (target - head) * (1 - 1 / hosts)


def across(inp, rep, cyc: dict, bandwidth: float, hosts: int, link: Link, mode: str) -> dict:
    """Plain and DFlash per token over the link, against one machine.

    Args:
        inp: ``roofline.Inputs``. rep: its ``estimate``. cyc: ``compute``'s MLX column
            (``cycle_seconds``, ``rows_ratio``). bandwidth: the chip's GB/s. hosts, link,
            mode: the group.

    Returns:
        {"plain": {...}, "dflash": {tau: {...}}} with seconds and tokens/s per token,
        round trips and wire bytes per token, and the weights each rank holds.
    """
    cfg, sec, B = inp.target, 1e9 * bandwidth, inp.block
    head = config_int(cfg, "vocab_size") * config_int(cfg, "hidden_size")
    head = head * QUANT_BYTES[inp.quant] / sec  # the LM head: whole on every rank
    plain_target = rep.plain / sec
    plain = shard_seconds(plain_target, plain_target, head, hosts, mode)
    weights = rep.parts["target weights (verify)"]
    cyc_target = (rep.group("target") + weights * (cyc["rows_ratio"] - 1)) / sec
    cycle = shard_seconds(cyc["cycle_seconds"], cyc_target, head * cyc["rows_ratio"], hosts, mode)

    def over(compute: float, rows: int, extra: int, tokens: float) -> dict:
        n = trips(cfg, hosts, mode) + extra * (hosts > 1)
        wire = wire_bytes(cfg, hosts, mode, rows)
        link_s = n * link.latency + wire / (link.bandwidth * 1e9)
        per = (compute + link_s) / tokens
        return {
            "seconds_per_token": per,
            "tokens_per_s": 1 / per,
            "link_share": link_s / (compute + link_s),
            "round_trips_per_token": n / tokens,
            "wire_bytes_per_token": wire / tokens,
        }

    out = {"plain": over(plain, 1, 0, 1.0), "dflash": {}}
    for tau in (3.0, 4.8):
        if tau <= B:
            d = over(cycle, B, 1, tau)
            d["speedup"] = out["plain"]["seconds_per_token"] / d["seconds_per_token"]
            out["dflash"][tau] = d
    return out


def render(name: str, quant: str, chip: str, hosts: int, link_name: str, mode: str, res) -> str:
    """The estimate as lines: plain and DFlash per token on one machine and over the link."""
    link = LINKS[link_name]
    head = (
        f"{name} {quant} on {hosts}x {chip}, {mode} parallel over {link_name} "
        f"({link.latency * 1e6:g} us a round trip, {link.bandwidth:g} GB/s; estimated)"
    )
    lines = [head, f"{'(estimated)':<26}{'tok/s':>8}{'vs 1 Mac':>10}{'link':>7}{'trips/token':>13}"]
    for label, one, many in _rows(res):
        ratio = many["tokens_per_s"] / one["tokens_per_s"]
        lines.append(
            f"{label:<26}{many['tokens_per_s']:>8.1f}{ratio:>9.2f}x"
            f"{many['link_share']:>7.0%}{many['round_trips_per_token']:>13.1f}"
        )
    for tau, d in res["many"]["dflash"].items():
        lines.append(f"DFlash / plain at tau {tau:g} over the link: {d['speedup']:.2f}x")
    lines.append(f"link figures: {link.source}")
    return "\n".join(lines)


def _rows(res):
    yield "plain", res["one"]["plain"], res["many"]["plain"]
    for tau, d in res["many"]["dflash"].items():
        yield f"DFlash at tau {tau:g}", res["one"]["dflash"][tau], d


def estimate(inp, rep, cyc: dict, bandwidth: float, hosts: int, link: str, mode: str) -> dict:
    """:func:`across` on one machine and on ``hosts``: {"one", "many", "link", "mode"}."""
    one = across(inp, rep, cyc, bandwidth, 1, LINKS[link], mode)
    many = across(inp, rep, cyc, bandwidth, hosts, LINKS[link], mode)
    return {"hosts": hosts, "link": link, "mode": mode, "one": one, "many": many}
