"""Acceptance cost of a quantized drafter: held-out teacher-forced tau of the demo drafter
dense and with its attention and MLP projections at 8 and 4 bits (``model/quantize.py``),
over its own draft vocabulary and over the full vocabulary.

    python benchmarks/draft_quant_tau.py --work .work/rounds

The fixed held-out set (``train_data/heldout.npz``) is rebuilt into ``--work`` by a prefill
of the demo target when its shards are not there; prints one JSON line per setting.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import dflash_mlx  # noqa: F401  (system BLAS first)


def main(argv=None) -> None:
    import mlx.core as mx

    from dflash_mlx.loading.loader import load_target
    from dflash_mlx.model import quantize
    from dflash_mlx.model.checkpoint import load_drafter
    from dflash_mlx.model.target import TargetAdapter
    from dflash_mlx.train.common import default_target
    from dflash_mlx.train.data import ShardSet, eval_anchors
    from dflash_mlx.train.evaluate import evaluate
    from dflash_mlx.train.rounds import DATA, DEMO, rebuild

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, default=Path(".work/rounds"))
    p.add_argument("--drafter", type=Path, default=DEMO)
    p.add_argument("--seqs", type=int, default=96, help="held-out answers (4 blocks each)")
    a = p.parse_args(argv)
    held_dir = a.work / "heldout" / "heldout"
    rebuild(DATA / "heldout.npz", held_dir)
    target, _ = load_target(default_target())
    held = ShardSet(held_dir)
    picks, anchors = eval_anchors(held, a.seqs, 4)
    for bits in (0, 8, 4):
        drafter = load_drafter(a.drafter, mx.float32)  # the CPU's compute dtype
        if bits:
            quantize.quantize(drafter, bits)
        adapter = TargetAdapter(target, drafter.args.target_layer_ids)
        for name, ids in (("draft vocab", drafter.draft_vocab), ("full", None)):
            ev = evaluate(drafter, adapter, held, picks, anchors, ids)
            keys = ("tau_argmax", "tau_selector", "tau_oracle")
            row = {"bits": bits or "bf16", "vocab": name, **{k: ev[k] for k in keys}}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
