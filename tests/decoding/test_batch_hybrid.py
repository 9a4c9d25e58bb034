"""A hybrid target (Gated DeltaNet + attention) in a batch: each row's recurrent state is
rewound to what that row accepted, so every row commits exactly its tokens alone, on each
way a rewind runs (the verify's recorded states, the recurrence run again, the mixer
replayed). Its greedy parity with real drafts is test_batch.py's, its sampling law
test_batch_sampling.py's "planned" one."""

import pytest
from oracle import BatchOracle
from references import reference
from test_batch import PROMPTS, drive

from dflash_mlx.model import tape


@pytest.mark.parametrize("path", ["recorded", "recomputed", "replayed"])
def test_hybrid_rows_rewound_by_their_own_counts_stay_exact(pairs, path, monkeypatch):
    """Rows accept different counts in one cycle (an oracle drafter wrong at a different
    block row per request): each row's states are rewound by its own count."""
    model, tok = pairs("qwen3_5", "d2")
    recs = [r for r in model.adapter.recorders if r is not None]
    if path == "recomputed":  # the verify keeps no per-step states: the rewind recomputes
        monkeypatch.setattr(tape, "RECORD_BYTES", 0)
    if path == "replayed":
        for r in recs:
            object.__setattr__(r, "_taped", False)
    kinds = set()
    rewind = type(recs[0]).rewind

    def seen(self, cache, snap, keep):
        last = self._last
        states = getattr(last, "states", ())
        kinds.add((type(last).__name__, None if states == () else states is not None))
        return rewind(self, cache, snap, keep)

    monkeypatch.setattr(type(recs[0]), "rewind", seen)
    ids = [tok.encode(p) for p in PROMPTS]
    refs = [reference(model, p, 48) for p in ids]
    wrong, real, log = {0: (), 1: (2,), 2: (3, 5), 3: (1,)}, model.drafter, []
    seqs = [p + r for p, r in zip(ids, refs)]

    def setup(dec):
        model.drafter = BatchOracle(real, dec, seqs, wrong)

    try:
        got = drive(model, ids, 40, 8, joins=[0, 1, 1, 5], log=log, setup=setup)
    finally:
        model.drafter = real
        for r in recs:
            object.__setattr__(r, "_taped", True)
    for i in range(len(ids)):
        assert got[i] == refs[i][:40]
    assert any(len(set(acc)) > 1 for acc in log)  # rows did keep different counts
    want = {"recorded": ("Tape", True), "recomputed": ("Tape", False), "replayed": ("tuple", None)}
    assert kinds == {want[path]}, kinds
