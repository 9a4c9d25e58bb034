"""How often context-lookup drafts (dflash_mlx/lookup.py) and the drafter's are accepted, on
the target's own greedy continuation (docs/algorithm.md §3.5).

    python benchmarks/lookup_acceptance.py [--prompts builtin|FILE.jsonl] [-m 96] [--block 8]

At every anchor of every continuation the drafter drafts teacher-forced (top-1, one batched
pass) and the lookup proposes from the committed tokens before the anchor. Prints the mean
drafts accepted per cycle for the drafter, the lookup alone, the rules that pick one of the
two, and the best of the two; then, by match length, the count, both means and the lookup's
conditional acceptance per position (the source of ``lookup.PRIORS``).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

# The package before MLX: MLX then binds the system OpenBLAS and the few-row kernel
# (imported after MLX, MLX keeps its wheel's reference BLAS).
import dflash_mlx  # noqa: F401

# isort: split
import mlx.core as mx
import numpy as np


def drafter_top1(model, ids, cont, block):
    """Teacher-forced top-1 drafts [anchors, block - 1] at every anchor of the continuation."""
    from dflash_mlx.model.drafter import block_mask, embed_block
    from dflash_mlx.model.selector import top_candidates

    d, adapter = model.drafter, model.adapter
    seq = list(ids) + list(cont)
    anchors = np.arange(len(ids) - 1, len(seq) - 1)
    _, feats = adapter(mx.array(seq)[None], None)
    kv = d.context_kv(d.project_context(feats), 0)
    out = []
    for s in range(0, len(anchors), 32):
        a = anchors[s : s + 32]
        blk = np.full((len(a), block), d.args.mask_token_id, dtype=np.uint32)
        blk[:, 0] = np.array(seq)[a]
        mask = mx.array(block_mask(a, len(seq), block, d.args.sliding_window))
        emb = embed_block(adapter.embed, mx.array(blk), d.args, d.fc.weight.dtype)
        ctx = [(mx.repeat(k, len(a), 0), mx.repeat(v, len(a), 0)) for k, v in kv]
        h = d(emb, ctx, mx.array(a.astype(np.int32)), block, mask)[:, 1:]
        _, cand = top_candidates(model.draft_logits(h), 1)
        out.append(np.array(model.to_target(cand)[..., 0]))
    return anchors, np.concatenate(out)


def accepted(drafts, truth) -> int:
    """Leading drafts equal to the truth."""
    n = 0
    for x, y in zip(drafts, truth):
        if x != y:
            break
        n += 1
    return n


def main(argv=None) -> None:
    from mlx_lm.generate import generate_step

    from dflash_mlx import load
    from dflash_mlx.bench.prompts import CHAT, CODE
    from dflash_mlx.bench.runner import encode_prompt
    from dflash_mlx.decoding.lookup import Lookup

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="demo")
    p.add_argument("--prompts", default="builtin")
    p.add_argument("-m", "--max-tokens", type=int, default=96)
    p.add_argument("--block", type=int, default=8)
    a = p.parse_args(argv)
    model, tok = load(a.model, warmup=False)
    if a.prompts == "builtin":
        prompts = CODE + CHAT
    else:
        with open(a.prompts) as f:
            prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    L = a.block - 1
    rules = defaultdict(list)
    by_n = defaultdict(list)
    for text in prompts:
        ids = encode_prompt(tok, text, False)
        gen = generate_step(mx.array(ids), model.target, max_tokens=a.max_tokens)
        cont = [int(t) for t, _ in gen]
        seq = ids + cont
        anchors, top1 = drafter_top1(model, ids, cont, a.block)
        for anchor, drafts in zip(anchors, top1):
            truth = seq[anchor + 1 : anchor + 1 + L]
            copied, n = Lookup(seq[: anchor + 1]).propose(L)
            da, la = accepted(list(drafts), truth), accepted(copied, truth)
            rules["drafter"].append(da)
            rules["lookup alone"].append(la)
            rules["lookup at any match, else drafter"].append(la if n else da)
            rules["lookup at a match >= 2, else drafter"].append(la if n >= 2 else da)
            rules["best of the two"].append(max(da, la))
            by_n[n].append((la, da))
    print(f"{len(prompts)} prompts x {a.max_tokens} tokens, block {a.block}: drafts accepted")
    for name, v in rules.items():
        print(f"  {name:40s} {np.mean(v):.3f}")
    print("match  anchors  lookup  drafter  lookup acceptance per position")
    for n in sorted(by_n):
        v = np.array(by_n[n])
        la = v[:, 0]
        rates = [(la > k).sum() / max((la >= k).sum(), 1) for k in range(L)]
        print(
            f"{n:5d} {len(v):8d} {la.mean():7.2f} {v[:, 1].mean():8.2f}  "
            + " ".join(f"{r:.2f}" for r in rates)
        )


if __name__ == "__main__":
    main()
