"""``dflash bench``: speed, tau and the blog's diagnostics on one set of prompts.

For each prompt, in one process: plain autoregressive decoding with mlx-lm, DFlash with the
selector off (the DFlash 1 path) and on. Per block position it reports Recall@1 / Recall@16
under teacher forcing on the target's own continuation, the conditional acceptance of both
DFlash runs, and the oracle tau (docs/algorithm.md §5). A greedy run also says, per prompt,
whether each method's tokens equal plain decoding's and where they first differ
(``parity.py``; docs/algorithm.md §4.2.1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from .. import ops
from ..decoding.acceptance import SamplingParams
from ..decoding.loop import DecodeOptions, decode
from ..decoding.stats import CycleStats
from ..distributed import link
from ..distributed import policy as across
from ..generation import encode_prompt
from ..model.drafter import block_mask, embed_block
from ..model.selector import top_candidates
from ..settings import AUTO, check_block_size
from . import experts
from .datasets import load_prompts  # noqa: F401  (scripts import it from here)
from .parity import parity_report
from .prefix import context_rows, copied, prefilled

METHODS = ("autoregressive", "dflash1", "dflash2", "dflash2+lookup", "auto")


@dataclass
class PromptResult:
    """Measurements of one prompt."""

    tokens: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)  # decode time after prefill
    stats: dict[str, CycleStats] = field(default_factory=dict)  # each DFlash run's cycles
    recall: dict[str, np.ndarray] = field(default_factory=dict)  # hits per position
    anchors: int = 0
    oracle_run: float = 0.0  # summed leading top-K hits
    top1_run: float = 0.0
    continuation: list[int] = field(default_factory=list)
    outputs: dict[str, list[int]] = field(default_factory=dict)  # each method's tokens
    experts: dict[str, dict] = field(default_factory=dict)  # a MoE target's (moe.py take)
    collectives: dict[str, int] = field(default_factory=dict)  # under the link hook only


def _autoregressive(model, ids, max_tokens, temp, seed, res: PromptResult, kv=None, cache=None):
    from mlx_lm.generate import generate_step, generation_stream
    from mlx_lm.sample_utils import make_sampler

    if seed is not None:
        mx.random.seed(seed)
    out, t_first = [], None
    # From a shared prefix (``prefix.prefilled``): mlx-lm runs the last prompt token only.
    kw = {} if cache is None else {"prompt_cache": cache.target}
    prompt = mx.array(ids if cache is None else ids[len(cache.tokens) :])
    experts.count(model)
    for tok, _ in generate_step(
        prompt, model.target, max_tokens=max_tokens, sampler=make_sampler(temp), **_kv(kv), **kw
    ):
        out.append(int(tok))
        if t_first is None:
            t_first = time.perf_counter()
    # mlx-lm leaves its next step in flight on its own stream; on a sharded target its
    # collectives would run beside the next method's (docs/distributed.md)
    mx.synchronize(generation_stream)
    res.tokens["autoregressive"] = len(out)
    res.seconds["autoregressive"] = time.perf_counter() - t_first
    experts.count(model, res, "autoregressive")
    res.continuation = res.outputs["autoregressive"] = out


def _kv(kv) -> dict:
    """mlx-lm's KV quantization keywords of ``DecodeOptions.kv`` (none when it is None)."""
    names = ("kv_bits", "kv_group_size", "quantized_kv_start")
    return {} if kv is None else dict(zip(names, kv, strict=True))


def _dflash(
    model,
    ids,
    max_tokens,
    block,
    temp,
    seed,
    selector,
    name,
    res,
    lookup=False,
    tree=True,
    kv=None,
    cache=None,
):
    key = mx.random.key(seed if seed is not None else 0)
    stats, out, t_first = CycleStats(block), [], None
    sel = selector and model.drafter.has_selector
    auto = name == "auto"
    sched = None
    if auto:  # under mlx.launch: every rank warms up alike and takes rank 0's choices
        tuning = across.ensure(model, model.group)
        sched = tuning.scheduler(temp == 0, sel, lookup=lookup, context=len(ids))
    experts.count(model)
    for c in decode(
        model,
        ids,
        model.make_cache() if cache is None else cache,
        SamplingParams(temperature=temp),
        DecodeOptions(
            max_tokens=max_tokens,
            block_size=block,
            use_selector=selector,
            key=key,
            policy=across.follow(sched, model.group),
            lookup=lookup,
            tree=tree,
            kv=kv,
        ),
    ):
        out += c.tokens
        if t_first is None:
            t_first = time.perf_counter()
            continue
        stats.add(c)
    res.tokens[name] = min(len(out), max_tokens)
    res.outputs[name] = out[:max_tokens]
    res.seconds[name] = time.perf_counter() - t_first
    experts.count(model, res, name)
    res.stats[name] = stats
    if sched is not None:
        model.tuning.finish(sched)


def _recall(model, ids, block, top_k, res: PromptResult, chunk: int = 32, prefix=None):
    """Teacher-forced Recall@1 / Recall@K per block position on the target's continuation
    (with ``prefix``, ``prefix.prefilled``'s cache, the prompt is not run again)."""
    drafter, adapter = model.drafter, model.adapter
    seq = list(ids) + res.continuation
    P, L = len(ids), block - 1
    anchors = np.arange(P, len(seq) - L)  # anchor at absolute position a, labels a+1..a+L
    hits1, hitsk = np.zeros(L), np.zeros(L)
    for k in ("1", str(top_k)):  # a continuation shorter than a block has no anchor
        res.recall.setdefault(k, np.zeros(L))
    if len(anchors) == 0:
        return
    rows = None if prefix is None else context_rows(model, prefix, list(ids), res.continuation)
    if rows is None:
        _, feats = adapter(mx.array(seq)[None], None)
        rows = drafter.context_kv(drafter.project_context(feats), 0), 0
    kv, start = rows  # context rows of positions start .. T - 1
    T = len(seq)
    win = drafter.args.sliding_window
    for s in range(0, len(anchors), chunk):
        a = anchors[s : s + chunk]
        N = len(a)
        blk = np.full((N, block), drafter.args.mask_token_id, dtype=np.uint32)
        blk[:, 0] = np.array(seq)[a]
        mask = mx.array(block_mask(a - start, T - start, block, win))
        emb = embed_block(adapter.embed, mx.array(blk), drafter.args, drafter.fc.weight.dtype)
        h = drafter(
            emb,
            [(mx.repeat(k, N, 0), mx.repeat(v, N, 0)) for k, v in kv],
            mx.array(a.astype(np.int32)),
            block,
            mask,
        )[:, 1:]
        _, cand = top_candidates(model.draft_logits(h), top_k)
        cand = model.to_target(cand)  # [N, L, K] target ids
        labels = mx.array(np.array(seq)[a[:, None] + 1 + np.arange(L)[None]].astype(np.uint32))
        ok1 = np.array(cand[..., 0] == labels)
        okk = np.array((cand == labels[..., None]).any(-1))
        hits1 += ok1.sum(0)
        hitsk += okk.sum(0)
        res.top1_run += np.cumprod(ok1, 1).sum()
        res.oracle_run += np.cumprod(okk, 1).sum()
    res.anchors += len(anchors)
    res.recall["1"] = res.recall.get("1", 0) + hits1
    res.recall[str(top_k)] = res.recall.get(str(top_k), 0) + hitsk


def run_bench(
    model,
    tokenizer,
    prompts: list[str],
    *,
    max_tokens: int = 128,
    block_size: int | None = None,
    temperature: float = 0.0,
    seed: int | None = 0,
    raw: bool = True,
    progress=None,
    lookup: bool = True,
    tree: bool = True,
    kv: tuple[int, int, int] | None = None,
    latency: bool = False,
    auto: bool = True,
) -> dict:
    """Measure every method on every prompt; return the report dict (see ``summarize``).

    Each prompt is prefilled once; every method decodes from a copy of that cache, so the
    timings and the greedy parity check compare decoding alone (``prefix.py``).

    Args:
        model, tokenizer: from ``load``. prompts: texts. max_tokens: per prompt.
        block_size: runtime block size (default: the checkpoint's). temperature: sampling.
        seed: makes sampling reproducible. raw: skip the chat template (code prompts).
        progress: optional callable(done, total) after each prompt.
        lookup: also run "dflash2+lookup" (copied drafts), and ``auto`` with them; False: neither.
        tree: greedy DFlash cycles also verify the first draft's siblings (``tree.py``).
        kv: (kv_bits, kv_group_size, quantized_kv_start) for every method, mlx-lm's too
            (each method then prefills the prompt itself).
        latency: add ``latency_split`` of the first prompt (one more profiled decode).
        auto: also run ``auto`` (across ranks rank 0 decides its blocks: ``distributed.policy``).
    """
    check_block_size(block_size, model.block_size)
    block = model.block_size if block_size in (None, AUTO) else block_size
    top_k = model.drafter.args.selector_top_k
    results, lengths, split = [], [], None
    warm = encode_prompt(tokenizer, prompts[0], raw)[:8]  # compile / warm caches once
    _dflash(model, warm, 4, block, temperature, seed, True, "warm", PromptResult())
    for i, text in enumerate(prompts):
        ids = encode_prompt(tokenizer, text, raw)
        lengths.append(len(ids))
        # with ``kv`` each method prefills itself: mlx-lm quantizes at a prompt-set point
        prefix = prefilled(model, ids) if kv is None else None
        args = (max_tokens, block, temperature, seed, lookup, tree, kv, prefix, auto)
        res = _methods(model, ids, *args)
        if latency and i == 0:
            own = copied(prefix) if prefix is not None else None
            split = latency_split(model, ids, max_tokens, block, temperature, tree=tree, cache=own)
        _recall(model, ids, block, top_k, res, prefix=prefix)
        results.append(res)
        if progress:
            progress(i + 1, len(prompts))
    rep = summarize(results, block, top_k, model, prompts, max_tokens, temperature)
    rep["config"].update(lookup=lookup, tree=tree, prompt_tokens=round(float(np.mean(lengths))))
    rep["parity"] = parity_report([r.outputs for r in results], temperature, tokenizer.decode)
    if split is not None:
        rep["latency_split"] = split
    return rep


def _methods(
    model, ids, max_tokens, block, temp, seed, lookup, tree, kv, prefix, auto=True
) -> PromptResult:
    """Every method on one prompt, each from its own copy of ``prefix`` (when given)."""
    res = PromptResult()

    def own():
        return {"cache": None if prefix is None else copied(prefix)}

    def run(name, method, *a, **k):  # the collectives each method issued (link hook on)
        before = link.total()
        method(*a, **k, **own())
        if before is not None:
            res.collectives[name] = link.total() - before

    run("autoregressive", _autoregressive, model, ids, max_tokens, temp, seed, res, kv)
    args, kw = (model, ids, max_tokens, block, temp, seed), {"tree": tree, "kv": kv}
    run("dflash1", _dflash, *args, False, "dflash1", res, **kw)
    if model.drafter.has_selector:
        run("dflash2", _dflash, *args, True, "dflash2", res, **kw)
    if lookup:
        run("dflash2+lookup", _dflash, *args, True, "dflash2+lookup", res, lookup=True, **kw)
    if auto:
        run("auto", _dflash, *args, True, "auto", res, lookup=lookup, **kw)
    return res


def conv_seconds(drafter, block: int, reps: int = 10) -> float:
    """Seconds per cycle in the drafter's conv calls (both sides, all layers), timed alone,
    as decoding runs them (the compiled step's, ``convs``, once a CPU decode made one)."""
    if not drafter.has_selector:
        return 0.0
    x = mx.random.normal((1, block, drafter.args.hidden_size)).astype(drafter.fc.weight.dtype)
    mx.eval(x)
    step = getattr(drafter, "_compiled_step", None)

    def once():
        if step is not None and hasattr(step, "convs"):
            mx.eval(step.convs(x))
            return
        outs = []
        for layer in drafter.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                u, d1 = conv.prepare(x, block)
                outs.append(conv.finish(u, d1, block))
        mx.eval(outs)

    once()
    t = time.perf_counter()
    for _ in range(reps):
        once()
    return (time.perf_counter() - t) / reps


STAGES = ("drafter", "conv", "selector", "verify", "acceptance", "rollback", "host")


def latency_split(
    model, ids, max_tokens, block, temperature, selector=True, tree=True, cache=None
) -> dict[str, float]:
    """Share of a cycle per stage (docs/algorithm.md §5), from one profiled run (from
    ``cache`` when given, e.g. a copy of the prompt's shared prefix)."""
    key = mx.random.key(0)
    split, cycles, t0 = {}, 0, None
    for c in decode(
        model,
        ids,
        model.make_cache() if cache is None else cache,
        SamplingParams(temperature=temperature),
        DecodeOptions(
            max_tokens=max_tokens,
            block_size=block,
            use_selector=selector,
            key=key,
            profile=True,
            lookup=False,
            tree=tree,
        ),
    ):
        if t0 is None:
            t0 = time.perf_counter()
            continue
        cycles += 1
        for k, v in c.timings.items():
            split[k] = split.get(k, 0.0) + v
    if not cycles:
        return {}
    total = (time.perf_counter() - t0) / cycles
    per = {k: v / cycles for k, v in split.items()}
    per["conv"] = min(conv_seconds(model.drafter, block), per.get("drafter", 0.0))
    per["drafter"] = per.get("drafter", 0.0) - per["conv"]
    per["host"] = max(total - sum(per.values()), 0.0)
    return {k: per.get(k, 0.0) / total for k in STAGES} | {"cycle_ms": 1e3 * total}


def summarize(results, block, top_k, model, prompts, max_tokens, temperature) -> dict:
    """Aggregate per-prompt results into the report (JSON-ready)."""
    methods = [m for m in METHODS if m in results[0].tokens]
    rep = {
        "config": {
            "prompts": len(prompts),
            "max_tokens": max_tokens,
            "block_size": block,
            "temperature": temperature,
            "top_k": top_k,
            "anchors": sum(r.anchors for r in results),
            "target": getattr(model, "target_path", ""),
            "drafter": getattr(model, "drafter_path", ""),
        },
        "blas": ops.backend_name(),
        # the ranks the target was sharded over (docs/distributed.md); one process: ranks 1
        "group": getattr(model, "group_info", None) or {"ranks": 1},
        "methods": {},
        "positions": {},
    }
    for m in methods:
        toks = sum(r.tokens[m] for r in results)
        secs = sum(r.seconds[m] for r in results)
        row = {"tokens": toks, "tok_per_s": (toks - len(results)) / max(secs, 1e-9)}
        if all(m in r.collectives for r in results):  # the link hook's count (a benchmark)
            row["collectives_per_token"] = sum(r.collectives[m] for r in results) / max(toks, 1)
        if m != "autoregressive":
            st = CycleStats(block)
            for r in results:
                st.merge(r.stats[m])
            row["tau"] = st.tau
            rep["positions"][f"acceptance_{m}"] = st.acceptance
            row["blocks"] = {str(b): n for b, n in st.histogram().items()}
            row["plain_share"] = st.plain_share
            row["copied_share"] = st.copied_share
        row["experts"] = experts.row(model, results, m)
        rep["methods"][m] = row
    base = rep["methods"]["autoregressive"]["tok_per_s"]
    for m, row in rep["methods"].items():
        row["speedup"] = row["tok_per_s"] / base if base else 0.0
    anchors = max(sum(r.anchors for r in results), 1)
    for k in ("1", str(top_k)):
        rep["positions"][f"recall@{k}"] = (
            sum(r.recall.get(k, 0) for r in results) / anchors
        ).tolist()
    rep["tau_top1_teacher_forced"] = 1 + sum(r.top1_run for r in results) / anchors
    rep["tau_oracle"] = 1 + sum(r.oracle_run for r in results) / anchors
    m = rep["methods"]
    if "dflash1" in m and "dflash2" in m:
        rep["selector_gain"] = m["dflash2"]["tau"] / m["dflash1"]["tau"] - 1
    return rep
