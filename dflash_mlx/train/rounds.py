"""Training rounds that compound: each round self-distils answers to prompts no earlier round
used, trains the shipped drafter further on everything at hand, evaluates it on a fixed
held-out set and replaces the shipped drafter only when held-out tau improved.

Usage::

    python -m dflash_mlx.train.rounds run --round 1 --minutes 120 [--work .work/rounds]
    python -m dflash_mlx.train.rounds distill --round 1 --minutes 50 --workers 2

What must survive a fresh machine is in git: the drafter (``dflash_mlx/demo/drafter``), its
ledger (``train_data/ledger.json``, also the model card's table) and the answers' token ids
(``train_data/rNN.npz``, ``train_data/heldout.npz``). Features and top-k log-probabilities
live in ``--work`` and are rebuilt from the token ids by a teacher-forced prefill
(``rebuild``) when that folder is gone.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from dflash_mlx.errors import DFlashError
from dflash_mlx.train.checks import (
    YEAR_MINUTES,
    Parser,
    Stop,
    entry,
    finished_shards,
    need_shards,
    number,
    out_dir,
    stop_code,
    whole,
)

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "train_data"
LEDGER = DATA / "ledger.json"
ROUND0_PROMPTS = 3000  # the first run (round 0) used the first ~2,700 training prompts
ROUND_PROMPTS = (1200, 2400)  # prompts reserved for round 1, and for each round after it
MAX_NEW = 512  # answer budget of rounds >= 1 (round 0 capped answers at 192)
HELDOUT_MAX_NEW = 192  # the fixed held-out set keeps round 0's budget, so tau stays comparable
VOCAB_CAP = 8192  # draft vocabulary of a drafter that has none yet (docs/algorithm.md §2.6)
DEMO = REPO / "dflash_mlx" / "demo" / "drafter"
HELDOUT_PROMPTS = 96  # held-out answers per evaluation (train.drafter.TrainConfig.eval_seqs)
WORK = REPO / ".work" / "rounds"


def round_prompts(r: int, tokenizer=None) -> list:
    """The prompts reserved for round r (r >= 1); no two rounds share a prompt.

    Round r takes its own slice of the training pool (``prompts.pool``, which only grows at
    its end): 1,200 prompts for round 1, 2,400 for each later round.
    """
    from dflash_mlx.train.prompts import pool

    first, later = ROUND_PROMPTS
    start = ROUND0_PROMPTS + (first + (r - 2) * later if r > 1 else 0)
    return pool("train", tokenizer)[start : start + (later if r > 1 else first)]


def round_dir(work: Path, r: int) -> Path:
    """The working folder of round r (its ``train/`` shards)."""
    return Path(work) / f"r{r:02d}"


def distill_worker(work: Path, r: int, deadline: float) -> None:
    """One distillation process: helps finish the fixed held-out set (its first
    ``HELDOUT_PROMPTS`` prompts), then claims shards of round r until the deadline or until
    every shard is done."""
    from dflash_mlx.loading.loader import load_target
    from dflash_mlx.train.common import default_layer_ids, default_target
    from dflash_mlx.train.distill import run
    from dflash_mlx.train.prompts import build_prompts

    target, tok = load_target(default_target())
    ids = default_layer_ids(len(target.layers))
    common = {"batch": 24, "shard_size": 48, "deadline": deadline}
    run(
        target,
        tok,
        Path(work) / "heldout",
        ids,
        "heldout",
        HELDOUT_MAX_NEW,
        prompts=build_prompts("heldout")[:HELDOUT_PROMPTS],
        **common,
    )
    run(
        target,
        tok,
        round_dir(work, r),
        ids,
        "train",
        MAX_NEW,
        prompts=round_prompts(r, tok),
        **common,
    )


def distill(work: Path, r: int, minutes: float, workers: int = 2) -> None:
    """Run ``workers`` single-threaded, niced distillation processes for ``minutes`` and
    wait for them (shards are claimed, so the processes share the work)."""
    deadline = time.time() + minutes * 60
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")  # one thread each
    cmd = [
        sys.executable,
        "-m",
        "dflash_mlx.train.rounds",
        "_worker",
        "--round",
        str(r),
        "--work",
        str(work),
        "--deadline",
        str(deadline),
    ]
    t0, procs = time.time(), []
    try:
        for _ in range(workers):
            procs.append(subprocess.Popen(["nice", "-n", "19"] + cmd, env=env))
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt as e:
        kept = f"finished shards are kept in {round_dir(work, r)}"
        raise Stop(stop_code(e), kept) from None
    finally:  # interrupted: the workers release their shards and stop too
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            p.wait()
        log_path = round_dir(work, r) / "distill.json"
        runs = json.loads(log_path.read_text()) if log_path.exists() else []
        runs.append({"wall_s": round(time.time() - t0, 1), "workers": workers})
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(json.dumps(runs))
    if any(codes):
        raise DFlashError(
            f"distillation workers exited with {codes}; see their messages above, fix the "
            "cause and rerun (finished shards are kept)"
        )


def distill_seconds(work: Path, r: int) -> tuple:
    """(wall seconds, process-seconds) round r's distillation has taken so far."""
    log_path = round_dir(work, r) / "distill.json"
    runs = json.loads(log_path.read_text()) if log_path.exists() else []
    return sum(x["wall_s"] for x in runs), sum(x["wall_s"] * x["workers"] for x in runs)


def shard_dirs(split_dir: Path) -> list:
    """The finished shards of a split folder."""
    return finished_shards(split_dir)


def distil_first(work: Path, r: int) -> str:
    """How to make round r's answers, for a message."""
    fix = f"distil them first: python -m dflash_mlx.train.rounds distill --round {r}"
    return fix + (f" --work {work}" if Path(work) != WORK else "")


def need_data(work: Path, r: int) -> list:
    """The train split folders of rounds 1..r that hold answers; refuses none at all, or
    no held-out answers (``rounds distill`` makes both, and ``run`` too).

    Args:
        work: the working folder. r: the round.
    """
    roots = [round_dir(work, i) / "train" for i in range(1, r + 1)]
    roots = [d for d in roots if shard_dirs(d)]
    fix = distil_first(work, r)
    if not roots:
        raise DFlashError(f"{work}: no answers of rounds 1..{r} (rNN/train/shard_*); {fix}")
    need_shards(Path(work) / "heldout" / "heldout", fix)
    return roots


def export(split_dir: Path, dest: Path) -> int:
    """Write the token ids of every finished shard (prompt + answer per sequence) to one
    compressed file for git; returns the answer tokens it holds."""
    toks, lens, plens = [], [], []
    for d in shard_dirs(split_dir):
        t, st = np.load(d / "tokens.npy"), np.load(d / "starts.npy")
        ends = np.append(st[1:], len(t))
        toks += [t[a:b] for a, b in zip(st, ends)]
        lens += (ends - st).tolist()
        plens += np.load(d / "prompt_lens.npy").tolist()
    if not toks:
        return 0
    dest.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        dest,
        tokens=np.concatenate(toks).astype(np.int32),
        lengths=np.array(lens, np.int32),
        prompt_lens=np.array(plens, np.int32),
    )
    return int(sum(lens) - sum(plens))


def rebuild(src: Path, split_dir: Path, log=print) -> None:
    """Rebuild a split's shards (features, teacher, top-k) from committed token ids when
    the working folder is gone, by a teacher-forced prefill (``distill.featurize``)."""
    from dflash_mlx.loading.loader import load_target
    from dflash_mlx.model.target import TargetAdapter
    from dflash_mlx.train.claims import claim
    from dflash_mlx.train.common import default_layer_ids, default_target
    from dflash_mlx.train.distill import featurize, write_shard

    if shard_dirs(split_dir) or not Path(src).exists():
        return
    z = np.load(src)
    cuts = np.cumsum(z["lengths"])[:-1]
    seqs = np.split(z["tokens"], cuts)
    target, _ = load_target(default_target())
    ids = default_layer_ids(len(target.layers))
    adapter = TargetAdapter(target, ids)
    split_dir.mkdir(parents=True, exist_ok=True)
    (split_dir / "meta.json").write_text(json.dumps({"layer_ids": ids, "rebuilt_from": src.name}))
    t0 = time.time()
    for k in range(0, len(seqs), 48):
        path = split_dir / f"shard_{k // 48:04d}"
        if claim(path):
            write_shard(path, featurize(adapter, seqs[k : k + 48]), z["prompt_lens"][k : k + 48])
    log(f"rebuilt {split_dir} from {src.name}: {len(seqs)} answers, {time.time() - t0:.0f} s")


def train_round(work: Path, r: int, minutes: float, log=print) -> dict:
    """Train the shipped drafter further on every round's data at hand (resumable), with
    its draft vocabulary (the shipped one, else the data's most frequent labels).

    Returns:
        the training summary (``train.drafter.train``), ``first`` being the shipped
        drafter's own held-out figures.
    """
    from dflash_mlx.loading.loader import load_target
    from dflash_mlx.model.checkpoint import load_drafter
    from dflash_mlx.model.draft_vocab import calibrated_vocab
    from dflash_mlx.train.common import default_target
    from dflash_mlx.train.data import ShardSet
    from dflash_mlx.train.drafter import TrainConfig, train

    roots = need_data(work, r)
    target, tok = load_target(default_target())
    shipped = load_drafter(DEMO)
    vocab = shipped.draft_vocab
    if vocab is None:  # the first round with one: calibrated on this data's answers
        V = target.args.vocab_size
        vocab = calibrated_vocab(ShardSet(roots).label_counts(V), VOCAB_CAP, tok, V)
    out = round_dir(work, r) / "drafter"
    cfg = TrainConfig(minutes=minutes, lr=1e-3, warmup=30, vocab_cap=VOCAB_CAP, eval_every_s=600)
    shape = {"mask_token_id": shipped.args.mask_token_id, "rope_theta": target.args.rope_theta}
    resume = (out / "train_state" / "state.json").exists()
    held = Path(work) / "heldout" / "heldout"
    return train(target, (roots, held), out, cfg, shape, resume, log, DEMO, vocab)


def publish_if_better(work: Path, r: int, summary: dict) -> bool:
    """Replace the shipped drafter with round r's best evaluated one when its held-out
    selector tau beats the shipped drafter's."""
    first, best = summary.get("first"), summary["best"]
    if first is None or best["tau_selector"] <= first["tau_selector"]:
        return False
    src = round_dir(work, r) / "drafter" / "best"
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(src / name, DEMO / name)
    return True


def run_round(
    work: Path, r: int, minutes: float, workers: int, share: float = 0.45, log=print
) -> dict:
    """A whole round: distil (``share`` of the time; rerun with 0 to go straight on),
    commit token ids, train, evaluate, publish, record the ledger row and the model card."""
    from dflash_mlx.train import ledger

    work = Path(work)
    t0 = time.time()
    rebuild(DATA / "heldout.npz", work / "heldout" / "heldout", log)
    for i in range(1, r):  # earlier rounds' data, rebuilt from their token ids if gone
        rebuild(DATA / f"r{i:02d}.npz", round_dir(work, i) / "train", log)
    if share > 0:
        distill(work, r, share * minutes, workers)
    new = export(round_dir(work, r) / "train", DATA / f"r{r:02d}.npz")
    export(work / "heldout" / "heldout", DATA / "heldout.npz")
    left = max(minutes - (time.time() - t0) / 60, 1.0)
    summary = train_round(work, r, left, log)
    d_wall, d_proc = distill_seconds(work, r)
    shipped = publish_if_better(work, r, summary)
    total = sum(int(x.get("new_tokens", 0)) for x in ledger.load() if x["round"] != r) + new
    row = {
        "round": r,
        "new_tokens": new,
        "total_tokens": total,
        "steps": summary["step"],
        "cpu_minutes": round((d_proc + 2 * summary["wall_s"]) / 60, 1),
        # the round's own drafter: its best evaluation after training started
        "heldout": summary["best"] if summary["best"]["step"] else summary["final"],
        "best_step": summary["best"]["step"],
        "baseline": summary["first"],
        "shipped": shipped,
        "distill_tok_s": round(new / max(d_wall, 1e-9), 1),
        "train_blocks_s": summary["blocks_per_s"],
        "vocab": summary["vocab"],
    }
    ledger.append(row)
    ledger.write_card(summary["vocab"])
    log(json.dumps(row))
    return row


@entry(hint="rerun the same command to continue")
def main(argv=None) -> None:
    """Command-line entry point (see the module docstring).

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).
    """
    p = Parser(prog="python -m dflash_mlx.train.rounds", description=__doc__.split("\n")[0])
    p.add_argument("command", choices=["run", "distill", "train", "export", "_worker"])
    p.add_argument("--round", type=whole(1), required=True)
    p.add_argument("--minutes", type=number(0, YEAR_MINUTES), default=120.0)
    p.add_argument("--workers", type=whole(1), default=2)
    p.add_argument("--work", type=Path, default=WORK)
    p.add_argument("--deadline", type=number(0), default=None, help="(_worker) a time.time()")
    p.add_argument(
        "--distill-share", type=number(0, 1, open_low=False), default=0.45, help="of --minutes"
    )
    a = p.parse_args(argv)
    out_dir(a.work, "--work")
    if a.command == "_worker":
        distill_worker(a.work, a.round, a.deadline)
    elif a.command == "distill":
        distill(a.work, a.round, a.minutes, a.workers)
    elif a.command == "export":
        split = round_dir(a.work, a.round) / "train"
        need_shards(split, distil_first(a.work, a.round))
        print(export(split, DATA / f"r{a.round:02d}.npz"))
        export(Path(a.work) / "heldout" / "heldout", DATA / "heldout.npz")
    elif a.command == "train":
        print(json.dumps(train_round(a.work, a.round, a.minutes)))
    else:
        run_round(a.work, a.round, a.minutes, a.workers, a.distill_share)


if __name__ == "__main__":
    main()
