"""The sampling law holds per row in a batch: rows with different settings (temperature,
filters, penalties, selector, block) and so different acceptance, decoded together."""

import mlx.core as mx
import numpy as np
import pytest
from laws import exact_law, tv
from mlx_lm.sample_utils import make_logits_processors
from tiny_models import eight_token_pair

from dflash_mlx.decoding.acceptance import SamplingParams
from dflash_mlx.decoding.batch import BatchDecoder, Row
from dflash_mlx.decoding.batch_auto import Option
from dflash_mlx.decoding.costs import CostTable
from dflash_mlx.decoding.schedule import Scheduler

# (prompt, temperature, top_p, top_k, presence, selector, block) per row
ROWS = [
    ([2, 5, 1, 7], 1.0, 1.0, 0, 0.0, True, 4),
    ([3, 3, 6], 0.8, 0.9, 5, 0.0, True, 2),
    ([1, 7, 2, 2, 4], 1.0, 1.0, 0, 1.5, False, 3),
    ([6], 0.6, 1.0, 4, 0.0, True, None),
]
# The same settings after prompts that end in a bigram seen before: copied drafts at once.
COPYING = [(r[0][-2:] + [4] + r[0][-2:] if len(r[0]) > 1 else [6, 6, 6],) + r[1:] for r in ROWS]


def random_plan(rng, rows):
    """Per row a random block 1..4 (plain rows beside drafting ones) and copy flag: what
    an ``auto`` batch may plan, drawn so that every mix is verified."""
    return [Option(int(rng.integers(1, 5)), bool(rng.integers(0, 2)), 0.0) for _ in rows]


def sample_batches(
    model, rows, n, trials, seed, lookup=False, copied=None, planned=False, copies=1
):
    """trials batches of ``copies`` rows of each setting in ``rows``; per setting the n-token
    sequences (``trials * copies``: each row its own key, so independent draws) and the
    drafts accepted (``copied`` counts the cycles that verified copied drafts; ``planned``:
    every cycle decodes a random plan, the rows being auto rows)."""
    samples, accepted = [[] for _ in rows], [0] * len(rows)
    key, rng = mx.random.key(seed), np.random.default_rng(seed)
    for _ in range(trials):
        dec = BatchDecoder(model, 4)
        out = {}
        for i, (prompt, temp, top_p, top_k, pres, sel, block) in enumerate(rows * copies):
            procs = make_logits_processors(presence_penalty=pres or None)
            key, sub = mx.random.split(key)
            params = SamplingParams(temp, top_p, 0.0, top_k, procs)
            sched = Scheduler(CostTable(4), [0.25] * 3) if planned else None
            dec.join(Row(i, prompt, params, n, block, sel, sub, lookup, sched))
            out[i] = []
        while dec.joining or len(dec):
            for _ in range(len(rows)):  # a setting's worth of rows joins each cycle
                got = dec.prefill_step()
                if got:
                    out[got[0].uid] += got[1].tokens
            # planned: a random plan, or (every other cycle or so) each row's own block
            plan = random_plan(rng, dec.rows) if planned and rng.integers(0, 3) else None
            for row, cyc in dec.step(plan):
                out[row.uid] += cyc.tokens
                accepted[row.uid % len(rows)] += cyc.accepted
                if copied is not None:
                    copied[row.uid % len(rows)] += cyc.lookup > 0
                if row.generated >= n:
                    dec.remove(row.uid)
        for i in out:
            samples[i % len(rows)].append(tuple(out[i][:n]))
    return samples, accepted


@pytest.fixture(scope="module")
def hybrid_eight(tmp_path_factory):
    return eight_token_pair(tmp_path_factory.mktemp("h8"), "qwen3_5")


@pytest.mark.parametrize("mode", ["lookup", "planned"])
def test_each_row_of_a_batch_samples_its_own_target_law(small_vocab_pair, hybrid_eight, mode):
    """Rows of fixed blocks drafting or verifying drafts copied from their context (lookup),
    and auto rows decoding random per-row plans (planned: a third of the cycles each row's
    own block, the others some rows plain, some drafted, some copied, of different widths,
    padded to the widest). Rows without lookup draft as these do where nothing matches.
    The planned rows decode a hybrid target (Gated DeltaNet and attention layers): each
    row's recurrent state is rewound by its own acceptance, its attention trimmed."""
    model = hybrid_eight if mode == "planned" else small_vocab_pair
    n, trials, copies = 4, 1000, 5  # 200 batches of 5 rows of each setting: 1000 draws each
    lookup = True
    rows = COPYING
    copied = [0] * len(rows)
    planned = mode == "planned"
    samples, accepted = sample_batches(
        model, rows, n, trials // copies, 3, lookup, copied, planned, copies
    )
    law_holds(model, rows, n, trials, samples, accepted, copied, lookup)


def law_holds(model, rows, n, trials, samples, accepted, copied, lookup) -> None:
    """Each setting's draws follow its exact law: every position's marginal and the pair
    of positions 1-2 (no impossible pair drawn); drafts were accepted and copied."""
    assert all(len(s) == trials for s in samples)
    assert (sum(copied) > trials // 4) == lookup, copied  # rows did verify copies
    for i, (prompt, temp, top_p, top_k, pres, _, block) in enumerate(rows):
        law = exact_law(model, prompt, n, temp, top_p, top_k, pres)
        if block != 1:
            assert accepted[i] > trials // 8, (i, accepted[i])  # drafts were accepted
        for pos in range(n):
            exact = np.zeros(8)
            for seq, pr in law.items():
                exact[seq[pos]] += pr
            emp = np.bincount([s[pos] for s in samples[i]], minlength=8) / trials
            assert tv(emp, exact) < 0.07, (i, pos, emp, exact)
        pairs = {}
        for seq, pr in law.items():
            pairs[seq[1:3]] = pairs.get(seq[1:3], 0) + pr
        seen = {s[1:3] for s in samples[i]}
        keys = sorted(set(pairs) | seen)
        emp2 = [sum(s[1:3] == k for s in samples[i]) / trials for k in keys]
        assert tv(emp2, [pairs.get(k, 0) for k in keys]) < 0.12, i
        assert seen <= set(pairs), i  # no impossible pair drawn
    assert len(set(accepted)) > 1  # the rows' acceptance differed
