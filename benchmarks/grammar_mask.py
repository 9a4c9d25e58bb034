"""Per-token cost of a grammar mask on this machine: llguidance, xgrammar and outlines-core on
the demo target's tokenizer (SmolLM2, 49k tokens), walking a valid answer token by token.

    python benchmarks/grammar_mask.py [--repeat 3] [--json]

Each step computes the next-token mask and then consumes the token, which is what the
grammar logits processor does per verify row (dflash_mlx/grammar.py). Libraries that are
not installed are skipped (xgrammar needs torch at import time; outlines-core builds a
whole-vocabulary index up front). Compile is the one-off cost per schema.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import dflash_mlx  # noqa: F401  (first: it loads the system BLAS before MLX)

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"},
        "notes": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["city", "unit", "days", "notes"],
    "additionalProperties": False,
}
ANSWER = {
    "city": "Paris, the capital of France",
    "unit": "celsius",
    "days": 12,
    "notes": ["bring an umbrella", "it may snow in the mountains"],
}


def demo_tokenizer():
    """The demo target's tokenizer (from its GGUF metadata; the weights are not loaded)."""
    import mlx.core as mx

    from dflash_mlx.loading.gguf import build_tokenizer, packaged_gguf

    _, meta = mx.load(str(packaged_gguf()), return_metadata=True)
    return build_tokenizer(meta)


def bench_llguidance(hf, ids, repeat):
    import llguidance
    import llguidance.hf
    import numpy as np

    t = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(hf)
    t_tok = time.perf_counter() - t
    steps = []
    for _ in range(repeat):
        t = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
        m = llguidance.LLMatcher(lltok, grammar)
        t_compile = time.perf_counter() - t
        mask = np.zeros((1, (lltok.vocab_size + 31) // 32), dtype=np.int32)
        for tid in ids:
            t = time.perf_counter()
            m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            assert (mask[0, tid // 32] >> (tid % 32)) & 1, "the answer left the grammar"
            m.consume_token(tid)
            steps.append(time.perf_counter() - t)
    return t_tok, t_compile, steps


def bench_xgrammar(hf, ids, repeat):
    import numpy as np
    import xgrammar as xg

    t = time.perf_counter()
    info = xg.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
    compiler = xg.GrammarCompiler(info, cache_enabled=False)
    t_tok = time.perf_counter() - t
    steps = []
    for _ in range(repeat):
        t = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
        m = xg.GrammarMatcher(compiled, max_rollback_tokens=16)
        t_compile = time.perf_counter() - t
        mask = np.zeros((1, (len(hf) + 31) // 32), dtype=np.int32)
        for tid in ids:
            t = time.perf_counter()
            m.fill_next_token_bitmask(mask)
            assert (mask[0, tid // 32] >> (tid % 32)) & 1, "the answer left the grammar"
            m.accept_token(tid)
            steps.append(time.perf_counter() - t)
    return t_tok, t_compile, steps


def bench_outlines(hf, ids, repeat):
    import numpy as np
    import outlines_core as oc
    from outlines_core.json_schema import build_regex_from_schema

    t = time.perf_counter()
    # GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest from U+0100
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    to_byte = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}
    vocab = {}
    eos = hf.eos_token_id
    for tok, i in hf.get_vocab().items():
        if i != eos:  # byte-level BPE: each character of a token stands for one byte
            raw = bytes(to_byte[c] for c in tok) if all(c in to_byte for c in tok) else tok
            vocab.setdefault(raw, []).append(i)
    voc = oc.Vocabulary(eos, vocab)
    t_tok = time.perf_counter() - t
    steps = []
    for _ in range(repeat):
        t = time.perf_counter()
        index = oc.Index(build_regex_from_schema(json.dumps(SCHEMA)), voc)
        g = oc.Guide(index)
        t_compile = time.perf_counter() - t
        mask = np.zeros((1, (len(hf) + 31) // 32), dtype=np.int32)
        for tid in ids:
            t = time.perf_counter()
            g.write_mask_into(mask.ctypes.data, mask.size, 4)
            assert (mask[0, tid // 32] >> (tid % 32)) & 1, "the answer left the grammar"
            g.advance(tid)
            steps.append(time.perf_counter() - t)
    return t_tok, t_compile, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    tok = demo_tokenizer()
    hf = tok._tokenizer
    ids = hf.encode(json.dumps(ANSWER), add_special_tokens=False)
    rows = {}
    for name, fn in [
        ("llguidance", bench_llguidance),
        ("xgrammar", bench_xgrammar),
        ("outlines-core", bench_outlines),
    ]:
        try:
            t_tok, t_compile, steps = fn(hf, ids, args.repeat)
        except ImportError as e:
            rows[name] = {"skipped": f"not installed ({e})"}
            continue
        steps_us = sorted(s * 1e6 for s in steps)
        rows[name] = {
            "tokenizer_s": round(t_tok, 3),
            "compile_s": round(t_compile, 4),
            "median_us": round(statistics.median(steps_us), 1),
            "p90_us": round(steps_us[int(0.9 * len(steps_us))], 1),
            "max_us": round(steps_us[-1], 1),
        }
    if args.json:
        print(json.dumps({"vocab": len(hf), "answer_tokens": len(ids), "libs": rows}))
        return
    print(f"vocabulary {len(hf)} tokens, answer {len(ids)} tokens, {args.repeat} runs")
    print(f"{'library':<14} {'tokenizer s':>11} {'compile s':>10} {'median us':>10} {'p90 us':>8}")
    for name, r in rows.items():
        if "skipped" in r:
            print(f"{name:<14} skipped: {r['skipped']}")
            continue
        print(
            f"{name:<14} {r['tokenizer_s']:>11} {r['compile_s']:>10} "
            f"{r['median_us']:>10} {r['p90_us']:>8}"
        )


if __name__ == "__main__":
    main()
