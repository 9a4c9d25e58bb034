"""The demo drafter's training ledger (``train_data/ledger.json``, one row per round) and its
model card (``dflash_mlx/demo/drafter/README.md``), rendered from the ledger."""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LEDGER = REPO / "train_data" / "ledger.json"
CARD = REPO / "dflash_mlx" / "demo" / "drafter" / "README.md"

CARD_HEAD = """---
license: apache-2.0
base_model: HuggingFaceTB/SmolLM2-135M-Instruct
library_name: mlx
tags: [speculative-decoding, dflash, dflash2, mlx, drafter]
---

# DFlash 2 drafter for SmolLM2-135M-Instruct (the dflash-mlx demo pair)

A block-parallel speculative-decoding drafter for
[SmolLM2-135M-Instruct](https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct)
(Apache-2.0), trained on 2 CPU cores by self-distillation: the target's own greedy answers.
`dflash run --model demo` loads it; the output is exactly the target's.

- **Shape:** 2 layers at width 576 (9 heads, 3 KV heads, SwiGLU MLP 1536), block 8, reads
  target layers [1, 8, 14, 20, 27]; DFlash 2 two-tap conv and a path selector of rank 32 over
  the top-16 candidates; mask token `<empty_output>`. It borrows the target's embedding and
  tied LM head.
- **Format:** dflash-mlx's released-drafter format (docs/format.md §2), BF16 safetensors,
  plus the optional `draft_vocab` tensor (§2.4): the {vocab} target ids it was trained to
  score, which is what it scores when decoding.
- **Licence:** Apache-2.0 (as its target).

## How it was trained

Round 0 (the first run): `python -m dflash_mlx.train.distill` (2,688 greedy answers of up to
192 tokens) then `python -m dflash_mlx.train.drafter --minutes 140` from scratch. Every later
round is one command, resumable, that self-distils answers (up to 512 tokens, with the
target's top-32 log-probabilities) to prompts no earlier round used, trains the shipped
drafter further on all data at hand (hard cross-entropy on the greedy token + cross-entropy
against the renormalised top-32, position weight gamma 4, the selector's lattice loss),
evaluates it on the fixed held-out set, and replaces this drafter only when held-out tau
improved:

```bash
python -m dflash_mlx.train.rounds run --round N --minutes 120
```

The answers' token ids are committed (`train_data/rNN.npz`, `train_data/heldout.npz`);
features are rebuilt from them by a prefill when the working folder is gone.

## Quantized (`--draft-quant`)

`--draft-quant 4` / `8` (`load(draft_quant=...)`) quantizes the attention and MLP
projections at load with MLX's affine quantization (group 64; docs/format.md §2.5), and
`dflash convert --draft-quant 4` writes it pre-quantized (24.5 MB -> 14.4 MB; 17.9 MB at 8
bits: the fc, conv and selector projections and the codebooks stay 16-bit). The output is
unchanged; what it costs in held-out teacher-forced tau (the fixed set below, top-1 /
selector / top-16 oracle, `benchmarks/draft_quant_tau.py`, CPU backend, float32 compute):

| layers | over its {vocab}-id draft vocabulary | over the full vocabulary |
| --- | --- | --- |
| bf16 (as shipped) | 1.82 / 1.88 / 2.99 | 1.84 / 1.91 / 3.15 |
| 8-bit | 1.82 / 1.88 / 2.99 | 1.84 / 1.91 / 3.15 |
| 4-bit | 1.84 / 1.88 / 2.98 | 1.87 / 1.92 / 3.16 |

At 4 bits the selector's tau moves by +0.1% (1.8828 vs 1.8802; +0.4% over the full
vocabulary): within the noise of 384 held-out blocks. On the CPU backend `auto` keeps the
drafter dense (quantized matmuls are slower there); on a GPU beside a quantized target it
picks 4 bits.

## Window (`sliding_window` 512)

Shipped with a 2,048-row sliding window; set to 512 on 2026-12-02 (config only, same
weights). It was trained on prompts of ~100-700 tokens and does not use rows further back:
held-out long prompts' teacher-forced tau (`benchmarks/long_context_causes.py --heldout`,
2 prompts per length, CPU, quiet machine) by the window the drafter attends over:

| prompt tokens | 2,048 | 1,024 | 512 | 256 |
| --- | --- | --- | --- | --- |
| ~550 | 1.456 | 1.456 | 1.482 | 1.544 |
| ~1,850 | 1.167 | 1.211 | 1.307 | 1.316 |
| ~3,550 | 1.237 | 1.395 | 1.491 | 1.518 |

Prompts under 512 tokens draft exactly as before. A retraining writes the trainer's
default window (2,048) again: set it back to 512 unless it trained on longer contexts.

## Ledger

Held-out tau is teacher-forced on the fixed held-out set (96 answers, 4 anchors each, block
8): top-1 drafting / the selector's walk / the top-16 oracle. Bench tau is `dflash bench
--model demo -n 12 -m 96 --block-size 8` on the built-in prompts (never trained on).

| round | new tokens | total tokens | steps | CPU-min | held-out tau (top-1 / selector / oracle) | bench tau | shipped |
| --- | --- | --- | --- | --- | --- | --- | --- |
"""


def load() -> list:
    """The ledger's rows (empty before the first round)."""
    return json.loads(LEDGER.read_text()) if LEDGER.exists() else []


def append(row: dict) -> list:
    """Add (or replace) the row of ``row["round"]`` and save; returns the rows."""
    rows = [r for r in load() if r["round"] != row["round"]] + [row]
    rows.sort(key=lambda r: r["round"])
    LEDGER.parent.mkdir(parents=True, exist_ok=True)
    LEDGER.write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def _tau(ev) -> str:
    if not ev:
        return "-"
    return f"{ev['tau_argmax']:.2f} / {ev['tau_selector']:.2f} / {ev['tau_oracle']:.2f}"


def render(rows: list, vocab) -> str:
    """The model card's text for these ledger rows."""
    lines = [CARD_HEAD.rstrip("\n").replace("{vocab}", f"{vocab:,}" if vocab else "no")]
    for r in rows:
        bench = r.get("bench_tau")
        lines.append(
            f"| {r['round']} | {r.get('new_tokens', 0):,} | {r.get('total_tokens', 0):,} | "
            f"{r.get('steps', 0):,} | {r.get('cpu_minutes', 0):.0f} | {_tau(r.get('heldout'))} | "
            f"{'-' if bench is None else f'{bench:.2f}'} | {'yes' if r.get('shipped') else 'no'} |"
        )
    notes = [r["note"] for r in rows if r.get("note")]
    if notes:
        lines.append("")
        lines += [f"- Round {r['round']}: {r['note']}" for r in rows if r.get("note")]
    return "\n".join(lines) + "\n"


def write_card(vocab) -> Path:
    """Render the model card from the ledger into the shipped drafter's folder."""
    CARD.write_text(render(load(), vocab))
    return CARD
