"""``dflash roofline --hosts N --link L``: the round trips and bytes a sharded forward pays,
the per-token time they add to plain decoding and to a DFlash cycle, and the one-line
refusals of a bad group."""

import json

import pytest

from dflash_mlx.bench import roofline as rl
from dflash_mlx.bench import roofline_data as data
from dflash_mlx.bench import roofline_link as link

ARCH = data.ARCHS["Qwen3.8-27B"]


def _group(hosts=2, name="tb5-rdma", mode="tensor", quant="4bit", chip="M4 Pro"):
    inp = rl.Inputs(ARCH["target"], ARCH["drafter"], quant=quant)
    rep = rl.estimate(inp)
    bw = data.CHIPS[chip][0]
    cyc = rl.compute(rep, inp, chip, bw)["mlx_qmm"]
    return inp, rep, cyc, link.estimate(inp, rep, cyc, bw, hosts, name, mode)


def test_a_tensor_forward_pays_two_all_reduces_a_layer_and_a_pipeline_one_hop_a_stage():
    cfg = ARCH["target"]  # 64 layers, hidden 5120
    assert link.trips(cfg, 2, "tensor") == 128 and link.trips(cfg, 4, "pipeline") == 4
    assert link.trips(cfg, 1, "tensor") == 0 and link.wire_bytes(cfg, 1, "tensor", 8) == 0
    # 128 all-reduces of 8 rows x 5120 x 2 bytes, a ring sending 2(N-1)/N of each
    assert link.wire_bytes(cfg, 2, "tensor", 8) == 128 * 8 * 5120 * 2
    assert link.wire_bytes(cfg, 4, "pipeline", 8) == 8 * 5120 * 2


def test_one_host_is_the_one_machine_model_and_two_tensor_hosts_halve_the_layers():
    _, rep, _, g = _group()
    bw = data.CHIPS["M4 Pro"][0] * 1e9
    one = g["one"]["plain"]
    assert one["seconds_per_token"] == pytest.approx(rep.plain / bw)
    assert one["round_trips_per_token"] == 0 and one["link_share"] == 0
    many = g["many"]["plain"]
    compute = many["seconds_per_token"] * (1 - many["link_share"])
    assert rep.plain / bw / 2 < compute < rep.plain / bw  # the head stays whole
    link_s = 128 * 10e-6 + 128 * 5120 * 2 / 3.5e9
    assert many["seconds_per_token"] - compute == pytest.approx(link_s)


def test_a_dflash_cycle_pays_the_link_once_for_tau_tokens_plus_rank_zeros_choice():
    _, _, _, g = _group(name="tb4")
    plain, d = g["many"]["plain"], g["many"]["dflash"][4.8]
    assert d["round_trips_per_token"] == pytest.approx((128 + 1) / 4.8)
    assert plain["round_trips_per_token"] == 128


def test_the_slower_the_link_the_more_dflash_gains_over_plain():
    gains = [
        _group(name=n)[3]["many"]["dflash"][4.8]["speedup"] for n in ("tb5-rdma", "tb4", "wifi")
    ]
    assert gains[0] < gains[1] < gains[2]
    one = _group()[3]["one"]
    assert gains[0] == pytest.approx(
        one["plain"]["seconds_per_token"] / one["dflash"][4.8]["seconds_per_token"], rel=0.1
    )


def test_the_command_adds_the_group_to_its_table_and_json(capsys):
    from dflash_mlx.cli.roofline import roofline

    args = {"quant": "8bit", "chip": "M4 Max", "context": 4096, "block": None, "drafter": None}
    args |= {"draft_quant": "4", "draft_vocab": 0, "rollback": "tape", "shard": "tensor"}
    args["moe_correlation"] = None
    roofline(model="Qwen3.8-27B", hosts=2, link="tb4", json_out=False, **args)
    text = capsys.readouterr().out
    assert "on 2x M4 Max, tensor parallel over tb4 (300 us a round trip" in text
    assert "DFlash / plain at tau 4.8 over the link" in text and "jiribrejcha.net" in text
    roofline(model="Qwen3.8-27B", hosts=2, link="tb4", json_out=True, **args)
    out = json.loads(capsys.readouterr().out)
    assert out["hosts"]["many"]["plain"]["round_trips_per_token"] == 128


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--hosts", "0"], "--hosts must be 1 to 64 Macs (got 0)"),
        (["--hosts", "2", "--link", "carrier-pigeon"], "--link carrier-pigeon is not one of"),
        (["--hosts", "2", "--shard", "data"], "--shard must be tensor or pipeline"),
    ],
)
def test_a_bad_group_is_one_line(args, needle):
    from typer.testing import CliRunner

    from dflash_mlx.cli import app

    r = CliRunner().invoke(app, ["roofline", "--model", "Qwen3.8-27B", *args])
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: ")
    assert needle in lines[0] and "Traceback" not in r.stdout + r.stderr
