"""Self-distillation data: the target's own greedy answers, with the features the drafter
reads, generated in batches and written in resumable shards.

Usage::

    python -m dflash_mlx.train.distill --out .work/distill [--split heldout] [--max-new 192]

Each shard directory holds, for its sequences concatenated: ``tokens`` (prompt + answer,
int32), ``teacher`` (the target's argmax after each fed token, i.e. the label of the next
position; int32), ``feats`` (float16 outputs of ``target_layer_ids`` for each fed token,
``[n, len(layer_ids) * H]``), ``topk_ids`` / ``topk_logp`` (the target's ``TOPK`` most likely
next tokens after each fed token and their log-probabilities, int32 / float16, for logit
distillation), and ``starts`` / ``prompt_lens`` per sequence. Every sequence
has one more token than it has features (its last token was never fed). A shard is written to
a temporary name and renamed, so an interrupted run resumes at the next missing shard: Ctrl-C
or SIGTERM frees the unfinished shard's claim, and a killed process's claim is recognised by
its pid (``claims``).
"""

from __future__ import annotations

import json
import shutil
import time
from functools import partial
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache

from dflash_mlx import ops
from dflash_mlx.errors import DFlashError
from dflash_mlx.model.target import TargetAdapter
from dflash_mlx.train.checks import Parser, Stop, entry, out_dir, stop_code, whole
from dflash_mlx.train.claims import OWNER, claim, heartbeat, holder, release, tmp_dir
from dflash_mlx.train.prompts import build_prompts

FP16_MAX = 65000.0
PREFILL_CHUNK = 128
MAX_PROMPT = 320  # tokens; a longer prompt (a huge docstring) would pad its whole batch
MAX_CHAT = 640  # tokens of a replayed two-turn chat (its first answer is up to 300)
TOPK = 32  # target log-probabilities kept per position (~200 bytes next to ~5.8 kB of features)


def top_logprobs(logits: mx.array, k: int = TOPK):
    """The k most likely next tokens per row and their log-probabilities.

    Args:
        logits: [B, L, V].

    Returns:
        (ids [B, L, k] int32, log-probs [B, L, k] float16), best first.
    """
    logits = logits.astype(mx.float32)
    lse = ops.logsumexp(logits)
    part = mx.argpartition(-logits, k - 1, axis=-1)[..., :k]  # [B, L, k] unordered
    vals = mx.take_along_axis(logits, part, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    ids = mx.take_along_axis(part, order, axis=-1).astype(mx.int32)
    return ids, (mx.take_along_axis(vals, order, axis=-1) - lse).astype(mx.float16)


def _decode_rows(adapter: TargetAdapter, cache, first, eos, max_new: int):
    """Greedy decoding after a batched prefill; a row leaves the batch (``filter``) once it
    emits an EOS, so long answers never keep finished ones computing.

    Returns:
        (answers: B lists of ids, steps: per decode step (the rows it ran, in order, and
        their features [n, D] float16, top-k ids [n, k], top-k log-probs [n, k])).
    """
    B = len(first)
    gen = [[int(t)] for t in first]
    active = np.arange(B)
    tok, steps = mx.array(first.reshape(-1, 1)), []
    for _ in range(max_new - 1):
        keep = np.array([gen[b][-1] not in eos for b in active])
        if not keep.all():
            if not keep.any():
                break
            idx = mx.array(np.flatnonzero(keep))
            for c in cache:
                c.filter(idx)
            active, tok = active[keep], tok[idx]
        logits, feats = adapter(tok, cache)
        tok = mx.argmax(logits[:, -1:], axis=-1)
        ids, lp = top_logprobs(logits)
        feats = mx.clip(feats, -FP16_MAX, FP16_MAX).astype(mx.float16)
        mx.eval(tok, feats, ids, lp)
        steps.append((active, np.array(feats[:, 0]), np.array(ids[:, 0]), np.array(lp[:, 0])))
        for b, t in zip(active, np.array(tok)[:, 0].tolist()):
            gen[b].append(t)
    return gen, steps


def generate_batch(adapter: TargetAdapter, prompts, eos, max_new: int):
    """Greedy answers for a batch of tokenized prompts (left-padded), with features.

    Args:
        adapter: a TargetAdapter tapping the layers to record. prompts: lists of ids.
        eos: ids that end an answer. max_new: answer budget.

    Returns:
        list of (tokens, teacher, feats float16, topk ids, topk log-probs) per prompt,
        trimmed after its EOS.
    """
    L = max(len(p) for p in prompts)
    pad = [L - len(p) for p in prompts]
    x = mx.array([[0] * n + p for n, p in zip(pad, prompts)])
    cache = [BatchKVCache(pad) for _ in adapter.inner.layers]
    # Prefill in chunks: logits of a whole batch of long prompts would pass 2**31 elements.
    teach, feat_parts, tk_ids, tk_lp = [], [], [], []

    def record(logits, feats):
        feat_parts.append(mx.clip(feats, -FP16_MAX, FP16_MAX).astype(mx.float16))
        i, lp = top_logprobs(logits)
        tk_ids.append(i)
        tk_lp.append(lp)
        return feat_parts[-1], i, lp

    for c in range(0, L, PREFILL_CHUNK):
        logits, feats = adapter(x[:, c : c + PREFILL_CHUNK], cache)
        teach.append(mx.argmax(logits, axis=-1))
        mx.eval(teach[-1], *record(logits, feats))
    teach = np.array(mx.concatenate(teach, axis=1))  # [B, L]
    F, KI, KL = (np.array(mx.concatenate(a, axis=1)) for a in (feat_parts, tk_ids, tk_lp))
    gen, steps = _decode_rows(adapter, cache, teach[:, -1], eos, max_new)
    out = []
    for b, p in enumerate(prompts):
        g = gen[b]
        n = next((i + 1 for i, t in enumerate(g) if t in eos), len(g))
        tokens = np.array(p + g[:n], np.int32)
        # rows fed: the prompt (from its padding on), then answer tokens 0 .. n-2
        mine = [r for r in steps if b in r[0]][: n - 1]
        at = [int(np.searchsorted(r[0], b)) for r in mine]
        parts = [(F, KI, KL)[j][b, pad[b] :] for j in range(3)]
        rows = [
            np.concatenate([parts[j]] + [r[j + 1][i : i + 1] for r, i in zip(mine, at)])
            for j in range(3)
        ]
        T = np.concatenate([teach[b, pad[b] :], np.array(g[1:n], teach.dtype)])
        out.append((tokens, T, *rows))
    return out


def featurize(adapter: TargetAdapter, seqs, batch: int = 4):
    """Rebuild shard rows from token ids alone (committed answers) by a teacher-forced
    prefill: what ``generate_batch`` records, at prefill speed instead of decoding speed.

    Args:
        adapter: a TargetAdapter tapping the recorded layers. seqs: (prompt + answer) id lists.
        batch: sequences per forward (right-padded: padding never reaches earlier rows).

    Returns:
        list of (tokens, teacher, feats float16, topk ids, topk log-probs) per sequence.
    """
    out = []
    for b0 in range(0, len(seqs), batch):
        part = [np.asarray(s, np.int32) for s in seqs[b0 : b0 + batch]]
        L = max(len(s) for s in part) - 1
        x = np.zeros((len(part), L), np.int32)
        for i, s in enumerate(part):
            x[i, : len(s) - 1] = s[:-1]  # the last token is never fed
        logits, feats = adapter(mx.array(x), None)
        ids, lp = top_logprobs(logits)
        feats = mx.clip(feats, -FP16_MAX, FP16_MAX).astype(mx.float16)
        teach = mx.argmax(logits, axis=-1).astype(mx.int32)
        mx.eval(feats, ids, lp, teach)
        F, I, P, T = (np.array(a) for a in (feats, ids, lp, teach))
        for i, s in enumerate(part):
            n = len(s) - 1
            out.append((s, T[i, :n], F[i, :n], I[i, :n], P[i, :n]))
    return out


def write_shard(path: Path, seqs, prompt_lens) -> None:
    """Write one claimed shard atomically (into its temporary directory, then rename); a
    shard another process finished meanwhile is kept and this copy dropped."""
    tmp = tmp_dir(path)
    if path.exists():
        shutil.rmtree(tmp, ignore_errors=True)
        return
    tmp.mkdir(parents=True, exist_ok=True)
    lens = [len(s[0]) for s in seqs]
    np.save(tmp / "tokens.npy", np.concatenate([s[0] for s in seqs]))
    np.save(tmp / "teacher.npy", np.concatenate([s[1] for s in seqs]).astype(np.int32))
    np.save(tmp / "feats.npy", np.concatenate([s[2] for s in seqs]))
    if len(seqs[0]) > 3:
        np.save(tmp / "topk_ids.npy", np.concatenate([s[3] for s in seqs]).astype(np.int32))
        np.save(tmp / "topk_logp.npy", np.concatenate([s[4] for s in seqs]).astype(np.float16))
    np.save(tmp / "starts.npy", np.cumsum([0] + lens[:-1]).astype(np.int64))
    np.save(tmp / "prompt_lens.npy", np.array(prompt_lens, np.int32))
    (tmp / OWNER).unlink(missing_ok=True)
    tmp.rename(path)


def encode(tokenizer, prompt):
    """A prompt's ids in the chat format decoding uses (the template, or the default one
    when the tokenizer has none; a text is one user turn, a list is the messages), or None
    when it is too long to batch well."""
    from dflash_mlx.decoding.prompt import chat_ids

    chat = isinstance(prompt, list)
    messages = prompt if chat else [{"role": "user", "content": prompt}]
    ids = chat_ids(tokenizer, messages)
    return ids if len(ids) <= (MAX_CHAT if chat else MAX_PROMPT) else None


def _meta(out: Path, layer_ids, max_new: int) -> None:
    """Record the split's layers; refuse a folder whose shards recorded other layers (another
    target's answers would be mixed in)."""
    path = out / "meta.json"
    meta = {"layer_ids": [int(i) for i in layer_ids], "max_new": max_new}
    try:
        old = json.loads(path.read_text()).get("layer_ids") if path.exists() else None
    except (OSError, ValueError, AttributeError):
        old = None
    if old is not None and old != meta["layer_ids"] and any(out.glob("shard_*")):
        raise DFlashError(
            f"{out} holds answers recorded at target layers {old}, not {meta['layer_ids']} "
            "(another target?); pass another --out, or the target they came from"
        )
    path.write_text(json.dumps(meta))


def _shard(adapter, path: Path, ids: list, eos, max_new: int, batch: int, log) -> int:
    """Generate one claimed shard (``ids``: its prompts) and write it; its tokens."""
    t0 = time.time()
    order = np.argsort([len(i) for i in ids])  # similar lengths share a batch
    seqs = [None] * len(ids)
    for b0 in range(0, len(ids), batch):
        pick = order[b0 : b0 + batch]
        for i, r in zip(pick, generate_batch(adapter, [ids[i] for i in pick], eos, max_new)):
            seqs[i] = r
        heartbeat(path)
        log(f"{path.name}: batch {b0 // batch + 1}, {time.time() - t0:.0f} s")
    write_shard(path, seqs, [len(i) for i in ids])
    n = sum(len(s[0]) for s in seqs)
    log(f"{path.name}: {len(ids)} prompts, {n} tokens, {n / (time.time() - t0):.0f} tok/s")
    return n


def run(
    target,
    tokenizer,
    out: Path,
    layer_ids,
    split: str = "train",
    max_new: int = 192,
    batch: int = 48,
    shard_size: int = 192,
    limit: int | None = None,
    log=None,
    prompts: list | None = None,
    deadline: float | None = None,
) -> dict:
    """Generate every missing shard of a split; a shard another live process holds is
    left to it, a dead process's is redone (``claims``).

    Args:
        target, tokenizer: the mlx-lm target and its tokenizer. out: data folder.
        layer_ids: target layers to record. split: prompt split. max_new: answer budget.
        batch: prompts per generation batch. shard_size: prompts per shard.
        limit: use only the first ``limit`` prompts (smoke runs).
        prompts: the prompt texts (default: ``build_prompts(split)``).
        deadline: ``time.time()`` after which no new shard is started.
        log: line printer (default: print, flushed).

    Returns:
        {"tokens": new tokens, "seconds": wall time, "held": shards left to live holders}.

    Raises:
        Stop: on Ctrl-C / SIGTERM, after releasing the unfinished shard's claim.
    """
    log = log or partial(print, flush=True)
    out = Path(out) / split
    out.mkdir(parents=True, exist_ok=True)
    _meta(out, layer_ids, max_new)
    adapter = TargetAdapter(target, layer_ids)
    texts = (build_prompts(split) if prompts is None else prompts)[:limit]
    prompts = [ids for ids in (encode(tokenizer, p) for p in texts) if ids is not None]
    eos = sorted(set(tokenizer.eos_token_ids))
    total, t0, held = {"tokens": 0, "seconds": 0.0}, time.time(), []
    for s0 in range(0, len(prompts), shard_size):
        path = out / f"shard_{s0 // shard_size:04d}"
        if deadline is not None and time.time() > deadline:
            break
        if not claim(path):
            if not path.exists() and (who := holder(path)):
                held.append(f"{path.name} (pid {who.get('pid')} on {who.get('host')})")
            continue
        try:
            total["tokens"] += _shard(
                adapter, path, prompts[s0 : s0 + shard_size], eos, max_new, batch, log
            )
        except KeyboardInterrupt as e:
            release(path)
            raise Stop(stop_code(e), f"{path} was not finished and is free again") from None
    total["seconds"], total["held"] = time.time() - t0, held
    if held:
        log(f"{out}: left to the processes generating them: {', '.join(held)}")
    return total


@entry(hint="rerun the same command to resume", smaller="--batch")
def main(argv=None) -> None:
    """Command-line entry point (see the module docstring).

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).
    """
    from dflash_mlx.loading.loader import load_target
    from dflash_mlx.train.common import add_target_option, default_layer_ids, default_target

    p = Parser(prog="python -m dflash_mlx.train.distill", description=__doc__.split("\n")[0])
    add_target_option(p)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--split", choices=["train", "heldout"], default="train")
    p.add_argument("--max-new", type=whole(1), default=192, help="answer budget (tokens)")
    p.add_argument("--batch", type=whole(1), default=48, help="prompts per batch")
    p.add_argument("--limit", type=whole(1), default=None, help="only the first N prompts")
    a = p.parse_args(argv)
    out_dir(a.out, "--out")
    target, tok = load_target(a.target or default_target())
    ids = default_layer_ids(len(target.layers))
    total = run(target, tok, a.out, ids, a.split, a.max_new, a.batch, limit=a.limit)
    left = f"{len(total['held'])} left to other processes" if total["held"] else "all done"
    print(f"{a.out / a.split}: {total['tokens']} new tokens; shards {left}", flush=True)


if __name__ == "__main__":
    main()
