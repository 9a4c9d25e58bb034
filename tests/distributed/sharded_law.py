"""The sampling law on a sharded target, for the two-rank tests: a rank's report (the
target's exact law of the first tokens, enumerated on the sharded target, and DFlash
samples of them) and the pytest side's check of it (chi-square on the speculative
positions)."""

import math
from pathlib import Path

import numpy as np

TRIALS = 200  # DFlash samples of the first N tokens
N = 3


def build(root: Path, kind: str) -> Path:
    """root/v8 (an 8-token target of ``kind``) and root/d_v8 (its DFlash 2 drafter, block 4)."""
    from tiny_models import build_drafter, build_target

    build_target(root / "v8", kind, tokenizer=False, vocab_size=8, seed=5)
    build_drafter(root / "d_v8", root / "v8", dflash2=True, block_size=4, seed=7)
    return root


def report(root: Path, group, mode: str) -> dict:
    """On every rank: the pair in root sharded by ``mode``, its exact law and samples."""
    import time

    import mlx.core as mx
    from laws import draw, exact_law
    from mlx_lm.utils import load_model

    from dflash_mlx import distributed
    from dflash_mlx.decoding.acceptance import SamplingParams
    from dflash_mlx.decoding.state import DFlashModel
    from dflash_mlx.model.checkpoint import load_drafter
    from dflash_mlx.model.target import TargetAdapter

    target = load_model(root / "v8", lazy=True)[0]
    mode = distributed.shard(target, group, mode)
    drafter = load_drafter(root / "d_v8", mx.float32)
    pair = DFlashModel(target, drafter, TargetAdapter(target, drafter.args.target_layer_ids))
    distributed.connect(pair, group, mode)
    prompt = [1, 2, 3]
    exact = exact_law(pair, prompt, N, 1.0, 1.0, 0, 0.0)
    t0 = time.perf_counter()
    samples, accepted = draw(pair, prompt, SamplingParams(1.0, 1.0, 0.0, 0), N, TRIALS, True, 5)
    return {
        "law": [[list(k), float(v)] for k, v in exact.items()],
        "samples": [list(s) for s in samples],
        "accepted": accepted,
        "draw_s": time.perf_counter() - t0,
    }


def _chi_square(samples: list[int], exact: np.ndarray) -> tuple[float, float]:
    """(statistic, critical value at p = 0.001) of samples against the exact law; bins
    expected to hold fewer than 5 draws are merged into one."""
    n = len(samples)
    seen = np.bincount(samples, minlength=len(exact))[: len(exact)]
    big = exact * n >= 5
    obs = [*seen[big], seen[~big].sum()]
    exp = [*(exact[big] * n), exact[~big].sum() * n]
    if exp[-1] == 0:
        assert obs[-1] == 0, "a token the law rules out was drawn"
        obs, exp = obs[:-1], exp[:-1]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    df = len(obs) - 1
    z = 3.09  # the normal quantile at 0.999, through Wilson-Hilferty
    return stat, df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def check(ranks: list[dict]) -> None:
    """Every rank drew the same samples, drafts were accepted, and the samples at the
    positions speculation produced (2 and 3), alone and as a pair, follow the law."""
    law = ranks[0]
    assert all(r["samples"] == law["samples"] for r in ranks)
    assert law["accepted"] > TRIALS // 4  # the drafts were taken, not only bonus tokens
    exact = {tuple(k): p for k, p in law["law"]}
    samples = [tuple(s) for s in law["samples"]]
    for pos in (1, 2):
        marginal = np.zeros(8)
        for seq, p in exact.items():
            marginal[seq[pos]] += p
        stat, crit = _chi_square([s[pos] for s in samples], marginal)
        assert stat < crit, (pos, stat, crit)
    pairs = sorted({seq[1:3] for seq in exact})
    joint = np.array([sum(p for seq, p in exact.items() if seq[1:3] == k) for k in pairs])
    index = {k: i for i, k in enumerate(pairs)}
    assert all(s[1:3] in index for s in samples)  # no pair the law rules out
    stat, crit = _chi_square([index[s[1:3]] for s in samples], joint)
    assert stat < crit, ("pair", stat, crit)
