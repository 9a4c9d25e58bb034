"""Where ``auto`` loses to plain decoding at long prompts: mlx-lm's ``generate_step``, our
decode loop told to decode plainly (runs of 32 steps, with and without the per-step lookup
check that may end a run), and ``auto``, in one process, alternating, greedy.

    python benchmarks/auto_plain_path.py                    # demo pair, 3,500 tokens
    python benchmarks/auto_plain_path.py --lengths 3500 7000 -n 64 --runs 3

If the always-plain loop matches mlx-lm while ``auto`` loses, the loss is in the speculative
cycles ``auto`` tries (probes, lookup blocks), not in its plain path. Prompts are the first
L tokens of ``auto_length.py``'s text (its prompt 0).
Compare the ratios, not the speeds: other load on the machine shows in the latter.
"""

from __future__ import annotations

import argparse
import json
import time

from auto_length import _plain, fresh, setup  # benchmarks/ is the script's own folder


class AlwaysPlain:
    """A block policy that decodes plainly, in runs of ``run`` steps; ``copy_pays``: the
    scheduler whose lookup check may end a run (None: never)."""

    tree = False

    def __init__(self, run: int, copy_pays=None):
        self.run, self._copy_pays = run, copy_pays

    def choose(self, budget, match=0):
        from dflash_mlx.decoding.policy import Choice

        return Choice(1)

    def plain_run(self) -> int:
        return self.run

    def copy_pays(self, match: int) -> bool:
        return bool(self._copy_pays and self._copy_pays(match))

    def record(self, *args) -> None:
        pass

    def observe(self, *args) -> None:
        pass


def _ours(model, ids, n, cache, policy) -> float:
    """tok/s after the first token of our decode loop under ``policy`` (lookup on)."""
    from dflash_mlx.decoding.acceptance import SamplingParams
    from dflash_mlx.decoding.loop import DecodeOptions, decode

    first, k = None, 0
    for c in decode(model, ids, cache, SamplingParams(), DecodeOptions(n, policy=policy)):
        first = first or time.perf_counter()
        k += len(c.tokens)
    return (k - 1) / (time.perf_counter() - first)


def measure(model, ids, n, runs, tuning) -> dict:
    """tok/s of each way over ``runs`` timed rounds (one untimed first) and auto's notes."""
    from mlx_lm.models.cache import make_prompt_cache

    pc = make_prompt_cache(model.target)
    caches = {k: model.make_cache() for k in ("plain loop", "plain loop + lookup", "auto")}
    probe = tuning.scheduler(True, True, lookup=True, context=len(ids))
    got, notes = {k: [] for k in ["mlx-lm", *caches]}, []
    for r in range(runs + 1):
        out, took = _plain(model, ids, n, pc)
        speeds = {"mlx-lm": (len(out) - 1) / took}
        speeds["plain loop"] = _ours(model, ids, n, caches["plain loop"], AlwaysPlain(32))
        policy = AlwaysPlain(32, probe.copy_pays)
        speeds["plain loop + lookup"] = _ours(model, ids, n, caches["plain loop + lookup"], policy)
        sched = tuning.scheduler(True, True, lookup=True, context=len(ids))
        speeds["auto"] = _ours(model, ids, n, caches["auto"], sched)
        tuning.finish(sched)
        if r:
            for k, v in speeds.items():
                got[k].append(v)
            notes.append({"summary": sched.summary(), "notes": sched.notes})
    mean = {k: sum(v) / len(v) for k, v in got.items()}
    return {
        "tok_per_s": {k: round(v, 2) for k, v in mean.items()},
        "vs_mlx_lm": {k: round(v / mean["mlx-lm"], 3) for k, v in mean.items()},
        "auto": notes,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--lengths", type=int, nargs="+", default=[3500])
    ap.add_argument("-n", "--max-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    model, base, ids = setup(a.model, max(a.lengths))
    tuning = fresh(base)
    rep = {}
    for n in a.lengths:
        rep[n] = got = measure(model, ids[:n], a.max_tokens, a.runs, tuning)
        print(f"{n:6d} tokens: " + json.dumps({k: got[k] for k in ("tok_per_s", "vs_mlx_lm")}))
        for row in got["auto"]:
            print(f"        auto {row['summary']}: " + " | ".join(row["notes"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rep, f, indent=1)


if __name__ == "__main__":
    main()
