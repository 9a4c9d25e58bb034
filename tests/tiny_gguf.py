"""A tiny llama GGUF file with a trained BPE vocabulary, written on the fly."""

import json

import mlx.core as mx
import numpy as np
from tiny_models import CHAT_TEMPLATE, CORPUS, SPECIALS, train_tokenizer


def _tiny_vocab(tmp_path):
    tok = train_tokenizer([CORPUS], 300, SPECIALS)
    model = json.loads(tok.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return [t for t, _ in vocab], merges


def write_tiny_gguf(path, tmp_path, layers=2, hidden=32, heads=4, kv=2, ffn=64):
    tokens, merges = _tiny_vocab(tmp_path)
    V = len(tokens)
    rng = np.random.default_rng(0)
    hd = hidden // heads

    def w(*shape):
        return mx.array(rng.normal(0, 0.2, shape).astype(np.float32))

    arrays = {"token_embd.weight": w(V, hidden), "output_norm.weight": mx.ones((hidden,))}
    for i in range(layers):
        p = f"blk.{i}."
        arrays |= {
            p + "attn_q.weight": w(heads * hd, hidden),
            p + "attn_k.weight": w(kv * hd, hidden),
            p + "attn_v.weight": w(kv * hd, hidden),
            p + "attn_output.weight": w(hidden, heads * hd),
            p + "ffn_gate.weight": w(ffn, hidden),
            p + "ffn_up.weight": w(ffn, hidden),
            p + "ffn_down.weight": w(hidden, ffn),
            p + "attn_norm.weight": mx.ones((hidden,)),
            p + "ffn_norm.weight": mx.ones((hidden,)),
        }
    u32 = lambda v: mx.array(v, dtype=mx.uint32)
    types = [3 if t in SPECIALS else 1 for t in tokens]
    meta = {
        "general.architecture": "llama",
        "llama.embedding_length": u32(hidden),
        "llama.block_count": u32(layers),
        "llama.attention.head_count": u32(heads),
        "llama.attention.head_count_kv": u32(kv),
        "llama.feed_forward_length": u32(ffn),
        "llama.rope.freq_base": mx.array(10000.0),
        "llama.attention.layer_norm_rms_epsilon": mx.array(1e-5),
        "llama.context_length": u32(256),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": mx.array(types, dtype=mx.int32),
        "tokenizer.ggml.eos_token_id": u32(tokens.index("<|im_end|>")),
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }
    mx.save_gguf(str(path), arrays, meta)
    return arrays, meta
