"""Acceptance cost of a draft vocabulary: held-out teacher-forced tau of the demo drafter
over the full vocabulary and over calibrated / merge-ranked subsets of several sizes.

    python benchmarks/draft_vocab_acceptance.py --work .work/rounds --round 1

Needs a round's shards (``train.rounds``): the calibration counts come from its training
answers, the evaluation from the fixed held-out set; prints one JSON line per vocabulary.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import dflash_mlx  # noqa: F401  (system BLAS first)


def main(argv=None) -> None:
    import mlx.core as mx

    from dflash_mlx.loading.loader import load_target
    from dflash_mlx.model.checkpoint import load_drafter
    from dflash_mlx.model.draft_vocab import calibrated_vocab, ranked_vocab
    from dflash_mlx.model.target import TargetAdapter
    from dflash_mlx.train.common import default_target
    from dflash_mlx.train.data import ShardSet, eval_anchors
    from dflash_mlx.train.evaluate import evaluate
    from dflash_mlx.train.rounds import DEMO, round_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, default=Path(".work/rounds"))
    p.add_argument("--round", type=int, default=1)
    p.add_argument("--drafter", type=Path, default=DEMO)
    p.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    a = p.parse_args(argv)
    target, tok = load_target(default_target())
    V = target.args.vocab_size
    drafter = load_drafter(a.drafter, mx.float32)
    adapter = TargetAdapter(target, drafter.args.target_layer_ids)
    counts = ShardSet(round_dir(a.work, a.round) / "train").label_counts(V)
    held = ShardSet(a.work / "heldout" / "heldout")
    picks, anchors = eval_anchors(held, 96, 4)
    held_counts = held.label_counts(V)
    runs = [("full", None)]
    for n in a.sizes:
        runs += [(f"calibrated {n}", calibrated_vocab(counts, n, tok, V))]
        runs += [(f"merge ranks {n}", ranked_vocab(tok, n, V))]
    for name, ids in runs:
        ev = evaluate(drafter, adapter, held, picks, anchors, ids)
        cover = 1.0 if ids is None else float(held_counts[ids].sum() / held_counts.sum())
        keys = ("tau_argmax", "tau_selector", "tau_oracle")
        print(
            json.dumps({"vocab": name, "coverage": round(cover, 4), **{k: ev[k] for k in keys}}),
            flush=True,
        )


if __name__ == "__main__":
    main()
