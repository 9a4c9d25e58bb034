"""One rank of the pipeline tests (run by ``mlx.launch``), several checks in one launch:
for a dense (qwen2) and a hybrid (qwen3_5) pair loaded with ``shard="pipeline"``, plain
greedy decoding of the sharded target (mlx-lm) and DFlash greedy, the layers whose weights
this rank holds and the bytes it read while loading; then the sampling law of an 8-token
qwen2 pair on the pipelined target: its exact law of the first tokens and DFlash samples.
Writes rank<r>.json."""

import json
import struct
import sys
import time
from pathlib import Path

import dflash_mlx  # noqa: F401 - before MLX: it preloads the system OpenBLAS (Linux)

# isort: split
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step, generation_stream

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: laws.py, tiny_models.py
import sharded_law

from dflash_mlx import load, stream_generate
from dflash_mlx.decoding.steps import generation_stream as decode_stream
from dflash_mlx.loading.vocab import set_draft_vocab

out, root = Path(sys.argv[1]), Path(sys.argv[2])
group = mx.distributed.init()
rank = group.rank()


def read_bytes() -> int:
    """Bytes this process has read through read() so far (page cache included)."""
    return int(next(x for x in open("/proc/self/io") if x.startswith("rchar")).split()[1])


def layer_bytes(path: Path) -> dict[int, int]:
    """Bytes of each layer's tensors in a safetensors file, from its header."""
    raw = path.read_bytes()
    head = json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])
    sizes: dict[int, int] = {}
    for name, t in head.items():
        if ".layers." in name:
            i = int(name.split(".layers.")[1].split(".")[0])
            sizes[i] = sizes.get(i, 0) + t["data_offsets"][1] - t["data_offsets"][0]
    return sizes


def held_layers(target) -> list[int]:
    """The layer numbers of the target's parameters held on this rank."""
    names = [k for k, _ in tree_flatten(target.parameters()) if ".layers." in k]
    return sorted({int(k.split(".layers.")[1].split(".")[0]) for k in names})


def same_as_one_process(model, kind: str, ids: list[int]) -> list[bool]:
    """Whether the pipelined target's logits and drafter features equal, bit for bit,
    those of the same target whole in this process (a stage runs whole layers)."""
    from mlx_lm.utils import load_model

    from dflash_mlx.model.target import TargetAdapter

    whole = TargetAdapter(load_model(root / kind)[0], model.adapter.layer_ids)
    # our decode's last cycle may still have its taps' sums in flight on its own stream:
    # this forward's collectives (default stream) must not pair with them
    mx.synchronize(decode_stream())
    x = mx.array(ids)[None]
    got = model.adapter(x, model.adapter.make_cache())
    want = whole(x, whole.make_cache())
    return [bool(mx.array_equal(a, b).item()) for a, b in zip(got, want)]


def greedy(kind: str) -> dict:
    t0, before = time.perf_counter(), read_bytes()
    model, tok = load(str(root / kind), drafter=str(root / f"d2_{kind}"), shard="pipeline")
    res = {"read": read_bytes() - before, "load_s": time.perf_counter() - t0}
    res["held"] = held_layers(model.target)
    res["tree_ok"], res["hybrid"] = model.adapter.tree_ok, model.adapter.is_hybrid
    ids = tok.encode("def parse_args(argv):")
    plain = [int(t) for t, _ in generate_step(mx.array(ids), model.target, max_tokens=20)]
    # mlx-lm leaves its next step in flight on its own stream: let it finish first, or
    # its collectives would run beside the next decode's
    mx.synchronize(generation_stream)
    res["plain"] = plain
    for name, kw in {"b2": {"block_size": 2}, "b4": {"block_size": 4}}.items():
        for chain in (False, True):  # with the tree and lookup (the defaults), then without
            extra = {"tree": False, "lookup": False} if chain else {}
            got, t0 = [], time.perf_counter()
            for r in stream_generate(
                model, tok, ids, max_tokens=20, temperature=0.0, **kw, **extra
            ):
                got += r.tokens
            res[name + ("_chain" if chain else "")] = got
            res[f"{name}_s"] = time.perf_counter() - t0
    res["as_one"] = same_as_one_process(model, kind, ids)
    if kind == "qwen2":  # 8-bit KV caches: against mlx-lm's with the same flags
        kv = {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 0}
        res["plain_kv8"] = [
            int(t) for t, _ in generate_step(mx.array(ids), model.target, max_tokens=20, **kv)
        ]
        mx.synchronize(generation_stream)
        res["b4_kv8"] = [
            t
            for r in stream_generate(
                model, tok, ids, max_tokens=20, block_size=4, temperature=0, **kv
            )
            for t in r.tokens
        ]
    set_draft_vocab(model, tok, 64)  # the drafter scores 64 tokens: still lossless
    res["b4_vocab"] = [
        t
        for r in stream_generate(model, tok, ids, max_tokens=20, block_size=4, temperature=0.0)
        for t in r.tokens
    ]
    return res


report = {"size": group.size(), "rank": rank}
report["layer_bytes"] = layer_bytes(root / "qwen2" / "model.safetensors")
report["qwen3_5"] = greedy("qwen3_5")  # first: the imports it does are not counted below
report["qwen2"] = greedy("qwen2")
report["law"] = sharded_law.report(root, group, "pipeline")
(out / f"rank{rank}.json").write_text(json.dumps(report))
