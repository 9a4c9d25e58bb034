"""``block_size="auto"`` on a fresh model, simulated: no model and no timing, the decisions
of the real scheduler on cost curves (``dflash roofline``'s predictions for a mixture of
experts and the dense 27B on an M4 Pro, and a flat one) against drafts accepted at a seeded
rate per position. Speeds are tokens per plain step's time (plain decoding: 1.00).

    python benchmarks/auto_probe.py                 # mean and worst over 10 seeds
    python benchmarks/auto_probe.py --seeds 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from schedule_sim import DENSE, MOE, best_fixed, flat, predicted, simulate

RATES = (0.0, 0.3, 0.6, 0.8, 0.9)


def curves() -> dict:
    """The cost curves, by name."""
    return {
        "MoE, MLX SwitchGLU": predicted(MOE, "mlx_qmm"),
        "MoE, grouped verify": predicted(MOE, "few_row"),
        "dense 27B, few-row": predicted(DENSE, "few_row"),
        "flat 1.1": flat(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    print("| curve | blocks 2 / 4 / 8 / 16 in plain steps |")
    print("|---|---|")
    for name, t in curves().items():
        print(f"| {name} | " + " / ".join(f"{t(b) / t(1):.2f}" for b in (2, 4, 8, 16)) + " |")
    print()
    print(
        "| curve | acceptance | best fixed block | auto, first request of 256 tokens | auto, 8 requests of 128 |"
    )
    print("|---|---|---|---|---|")
    for name, t in curves().items():
        for rate in RATES:
            block, best = best_fixed(t, rate)
            one = [simulate(t, rate, 256, 1, s).speed for s in range(args.seeds)]
            many = [simulate(t, rate, 128, 8, s).speed for s in range(args.seeds)]
            row = {"curve": name, "rate": rate, "best_block": block, "best": best}
            row |= {"first": statistics.mean(one), "first_worst": min(one)}
            row |= {"sequence": statistics.mean(many), "sequence_worst": min(many)}
            rows.append(row)
            print(
                f"| {name} | {rate} | {block}: {best:.2f} | {row['first']:.2f} (worst "
                f"{row['first_worst']:.2f}) | {row['sequence']:.2f} (worst {row['sequence_worst']:.2f}) |"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
