"""The tokenizer ``load()`` returns always runs with its model, whatever tokens the installed
transformers adds to it: a ``qwen3_5`` checkpoint whose embedding has exactly its tokenizer
file's vocabulary, loaded through transformers' class for that family (which adds
``<|endoftext|>`` after the file's ids), decodes through the Python API, the CLI, the server
and a prompt cache, with greedy parity. Another model's tokenizer is still refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from cli_helpers import cli_env
from mlx_lm.generate import generate_step
from tiny_models import CHAT_TEMPLATE, CORPUS, build_drafter, build_target, train_tokenizer

from dflash_mlx import load, stream_generate
from dflash_mlx.errors import DFlashError

# No "<|endoftext|>" in the file: Qwen3_5Tokenizer adds it past the file's ids; the extra
# special token below makes the loaded tokenizer larger than the embedding under any version.
SPECIALS = ["<|mask|>", "<|im_start|>", "<|im_end|>"]
PROMPT = "def parse_args(argv):"


@pytest.fixture(scope="module")
def extended(tmp_path_factory) -> tuple[Path, Path]:
    """(target, drafter) dirs: a tiny qwen3_5 whose vocabulary is its tokenizer file's."""
    root = tmp_path_factory.mktemp("extended")
    target = root / "target"
    target.mkdir()
    tok = train_tokenizer([CORPUS], 320, SPECIALS)
    tok.save(str(target / "tokenizer.json"))
    cfg = {
        "eos_token": "<|im_end|>",
        "chat_template": CHAT_TEMPLATE,
        "additional_special_tokens": ["<|extra|>"],
    }
    (target / "tokenizer_config.json").write_text(json.dumps(cfg))
    build_target(target, "qwen3_5", tokenizer=False, vocab_size=tok.get_vocab_size())
    build_drafter(root / "drafter", target, block_size=8)
    return target, root / "drafter"


@pytest.fixture(scope="module")
def pair(extended):
    target, drafter = extended
    return load(str(target), drafter=str(drafter), quiet=True)


def _greedy(model, tok, prompt, **kw) -> list[int]:
    return [t for r in stream_generate(model, tok, prompt, max_tokens=24, **kw) for t in r.tokens]


def test_the_tokenizer_load_returned_is_larger_than_the_embedding_and_decodes(pair):
    model, tok = pair
    assert len(tok._tokenizer) > model.adapter.vocab_size  # the case of the regression
    ids = tok.encode(PROMPT)
    ref = [t for t, _ in generate_step(mx.array(ids), model.target, max_tokens=24)]
    for block in (2, 8):
        assert _greedy(model, tok, ids, block_size=block) == ref
    text = "".join(r.text for r in stream_generate(model, tok, PROMPT, max_tokens=8))
    assert isinstance(text, str)


def test_a_prompt_cache_and_the_same_tokenizer_loaded_again_pass(pair, extended):
    from mlx_lm.utils import load_tokenizer

    model, tok = pair
    cache = model.make_cache()
    first = _greedy(model, tok, PROMPT, prompt_cache=cache)
    assert _greedy(model, tok, PROMPT + " return", prompt_cache=cache)
    again = load_tokenizer(extended[0])  # not the same object: its ids mean the same tokens
    assert _greedy(model, again, PROMPT) == first


def test_another_models_tokenizer_is_refused_naming_both(pair, pairs):
    model, _ = pair
    _, foreign = pairs("qwen3", "d2")  # another corpus's merges: the same text, other ids
    with pytest.raises(DFlashError, match=r"is not this model's .* gives '.*' id \d+") as e:
        _greedy(model, foreign, PROMPT)
    assert model.target_path in str(e.value)
    assert "pass the tokenizer load() returned" in str(e.value)


def test_the_cli_runs_the_pair(extended):
    target, drafter = extended
    cmd = [sys.executable, "-m", "dflash_mlx.cli", "run", "--model", str(target)]
    cmd += ["--drafter", str(drafter), "--max-tokens", "6", "--temp", "0", PROMPT]
    out = subprocess.run(
        cmd, check=False, capture_output=True, text=True, env=cli_env(), timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert "error" not in out.stderr.lower()


def test_the_server_answers_with_the_pair(pair):
    import threading
    import urllib.request

    from dflash_mlx.server.app import make_server

    model, tok = pair
    httpd = make_server(model, tok, "extended", port=0)
    threads = [
        threading.Thread(target=httpd.serve_forever, args=(0.02,), daemon=True),
        threading.Thread(target=httpd.engine.run, daemon=True),
    ]
    for t in threads:
        t.start()
    try:
        for extra in ({}, {"response_format": {"type": "json_object"}}):  # grammar: all ids
            body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6, **extra}
            req = urllib.request.Request(
                f"http://127.0.0.1:{httpd.server_address[1]}/v1/chat/completions",
                json.dumps(body).encode(),
                {"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=120) as r:
                got = json.loads(r.read())
            assert got["choices"][0]["message"]["content"] is not None
            assert got["usage"]["completion_tokens"] >= 1
    finally:
        httpd.engine.stop()
        httpd.shutdown()
        for t in threads:
            t.join(30)
        httpd.server_close()
