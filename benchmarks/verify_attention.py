"""What an 8-row verify costs at long context on this backend, and what splitting its
attention into row chunks (model/verify_attention.py) does to it.

    python benchmarks/verify_attention.py [--context 7000] [--rows 8] [--chunk 4] [--reps 5]

The demo target's KV caches are filled with random keys and values of ``--context``
positions (attention's cost depends on the shapes alone, so no prefill is needed), then
an ``--rows``-row forward is timed on them and trimmed back, alternating: plain, and with
every attention wrapped to run in chunks of ``--chunk`` rows. The same at 64 positions
gives the part of the verify that grows with the context.
"""

import argparse
import statistics
import time

import dflash_mlx  # first: the CPU backend's BLAS before MLX


def _fill(model, context: int):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    for layer, c in zip(model.layers, cache):
        a = layer.self_attn
        hkv, d = a.n_kv_heads, round(float(a.scale) ** -2)
        k = mx.random.normal((1, hkv, context, d), key=mx.random.key(1))  # [B, Hkv, S, D]
        c.update_and_fetch(k, k * 0.5)
    mx.eval([c.state for c in cache])
    return cache


def _time(model, cache, rows: int, reps: int) -> float:
    import mlx.core as mx

    ids = mx.array([[17 + i for i in range(rows)]])
    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        mx.eval(model(ids, cache=cache))
        times.append(time.perf_counter() - t)
        for c in cache:
            c.trim(rows)
    return statistics.median(times[1:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=7000)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    from dflash_mlx.model import verify_attention as va

    pair, _ = dflash_mlx.load("demo")
    model = pair.target
    a = model.model.layers[0].self_attn
    print(f"heads {a.n_heads}/{a.n_kv_heads}, fused_rows {va.fused_rows(a.n_heads, a.n_kv_heads)}")
    n = va.wrap_layers(model.model.layers, rows=args.chunk)
    wrappers = [la.self_attn for la in model.model.layers]
    print(f"{n} attention layers wrapped, {args.chunk}-row chunks; {args.rows}-row forward, ms:")
    for context in (64, args.context):
        cache = _fill(model, context)
        got = {"plain": [], "chunked": []}
        for _ in range(2):  # alternate, so drift hits both
            for name, rows in (("plain", 1 << 30), ("chunked", args.chunk)):
                for w in wrappers:  # more rows than the verify: the module itself runs
                    object.__setattr__(w, "rows", rows)
                got[name].append(_time(model, cache, args.rows, args.reps))
        med = {k: statistics.median(v) for k, v in got.items()}
        print(
            f"context {context:6}: plain {med['plain']:8.1f}  chunked {med['chunked']:8.1f}"
            f"  ({med['chunked'] / med['plain']:.2f}x)"
        )


if __name__ == "__main__":
    main()
