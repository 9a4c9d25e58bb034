"""The Python API checks its inputs at the door (``dflash_mlx/inputs.py``): a wrong type is
one DFlashError in the API's own names, never a traceback, and nothing is taken for what it
is not (a str as five one-character prompts, bytes or floats as token ids, a short configs
list silently dropping prompts). Threads sharing one model take turns step by step."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from refusals import refused

from dflash_mlx import generation
from dflash_mlx.batching import BatchGenerator, batch_generate
from dflash_mlx.generation import generate
from dflash_mlx.settings import GenerationConfig

KW = {"max_tokens": 6, "block_size": 4, "raw": True}


@pytest.fixture(scope="module")
def pair(pairs):
    return pairs("qwen3", "d2")


@pytest.mark.parametrize(
    "prompt,needles",
    [
        (None, ["prompt must be a str, a list of token ids", "(got None)"]),
        (123, ["(got int 123)"]),
        (iter([5, 6]), ["(got list_iterator)", "list(...)"]),
        (b"hello", ["prompt is bytes", ".decode('utf-8')"]),
        ([1.7, 2.2], ["prompt[0] is float 1.7", "token ids are ints"]),
        ([5, True], ["prompt[1] is bool True"]),
        ({"role": "user", "content": "hi"}, ["one message", "[message]"]),
        ([{"role": "user"}], ["prompt[0] has no 'content'"]),
        ([{"role": "user", "content": None}], ["prompt[0] has no 'content'"]),
        ([{"role": "user", "content": 5}], ["prompt[0]['content'] is int 5"]),
        ([{"content": "hi"}], ["prompt[0] has role None"]),
        ([{"role": "user", "content": "x"}, "y"], ["prompt[1] is str 'y'", "only dicts"]),
        (np.zeros((2, 2), np.int32), ["2-D array"]),
    ],
)
def test_a_prompt_of_another_type_is_one_clear_error(pair, prompt, needles):
    model, tok = pair
    refused(lambda: generate(model, tok, prompt, **KW), *needles)
    gen = BatchGenerator(model, tok)
    refused(lambda: gen.insert(prompt, **KW), *needles)
    assert len(gen) == 0


def test_token_ids_may_be_numpy_ints_a_tuple_or_an_array(pair):
    model, tok = pair
    ids = tok.encode("def parse_args(")
    want = generate(model, tok, ids, **KW)
    assert generate(model, tok, tuple(ids), **KW) == want
    assert generate(model, tok, [np.int64(t) for t in ids], **KW) == want
    assert generate(model, tok, np.array(ids, np.uint32), **KW) == want
    refused(lambda: generate(model, tok, ids + [10**6], **KW), "outside this model's vocabulary")


def test_system_config_settings_and_cache_are_checked(pair):
    model, tok = pair
    refused(lambda: generate(model, tok, "hi", system=5, **KW), "system must be a str or None")
    bad_cfg = {"max_tokens": 4}
    refused(lambda: generate(model, tok, "hi", config=bad_cfg), "config must be a GenerationConfig")
    refused(
        lambda: generate(model, tok, "hi", max_token=4), "unknown setting 'max_token'", "max_tokens"
    )
    refused(lambda: generate(model, tok, "hi", prompt_cache=[], **KW), "model.make_cache()")
    refused(lambda: generate(model, tok, "hi", prefill_step_size=None, **KW), "prefill_step_size")


@pytest.mark.parametrize(
    "prompts,needles",
    [
        ("hello", ["prompts is one text", "[prompt]"]),
        (b"hello", ["prompts is one text"]),
        (None, ["prompts must be a list of prompts (got None)"]),
        (123, ["(got int 123)"]),
        (iter(["a", "b"]), ["(got list_iterator)", "list(...)"]),
        ([1, 2, 3], ["prompts[0] must be a str", "(got int 1)"]),
        (["a", b"b"], ["prompts[1] is bytes"]),
        (["a", [{"role": "user"}]], ["prompts[1][0] has no 'content'"]),
    ],
)
def test_batch_prompts_are_a_list_of_prompts(pair, prompts, needles):
    model, tok = pair
    refused(lambda: batch_generate(model, tok, prompts, **KW), *needles)


def test_configs_are_one_per_prompt_or_a_single_config(pair):
    model, tok = pair
    prompts = ["def parse_args(", "import os", "class Foo"]
    refused(
        lambda: batch_generate(model, tok, prompts, configs=[None], **KW),
        "configs has 1 entry for 3 prompts",
    )
    refused(
        lambda: batch_generate(model, tok, prompts[:1], configs=[None, None], **KW), "2 entries"
    )
    refused(lambda: batch_generate(model, tok, prompts, configs={"a": 1}, **KW), "configs must be")
    refused(
        lambda: batch_generate(model, tok, prompts, configs=[None, {}, None], **KW), "configs[1] is"
    )
    one = GenerationConfig(max_tokens=5, block_size=4)
    out = batch_generate(model, tok, tuple(prompts), configs=one, raw=True)
    assert len(out.texts) == 3
    assert out.texts == [generate(model, tok, p, config=one, raw=True) for p in prompts]
    mixed = batch_generate(model, tok, prompts, config=one, configs=[None, one, None], raw=True)
    assert mixed.texts == out.texts


@pytest.mark.parametrize("value", [None, 0, -1, 2.0, True, "4"])
def test_max_batch_is_an_int_of_one_or_more(pair, value):
    model, tok = pair
    refused(lambda: batch_generate(model, tok, ["a"], max_batch=value, **KW), "max_batch must be")
    refused(lambda: BatchGenerator(model, tok, max_batch=value), "max_batch must be")


def test_max_batch_may_be_a_numpy_int(pair):
    model, tok = pair
    assert len(batch_generate(model, tok, ["a", "b"], max_batch=np.int64(1), **KW).texts) == 2


def test_a_hybrid_batch_refuses_a_bad_prompt_at_insert(pairs):
    model, tok = pairs("qwen3_5", "d2")
    gen = BatchGenerator(model, tok)
    refused(lambda: gen.insert([10**6], max_tokens=4), "outside this model's vocabulary")
    assert len(gen) == 0


# ----------------------------------------------------------------------------- threads


def test_threads_sharing_a_model_take_turns_and_each_gets_its_own_answer(pair):
    model, tok = pair
    jobs = [
        ("def parse_args(", {"max_tokens": 40, "block_size": 4}),
        ("import os\nfor i in", {"max_tokens": 40}),
        ("class Foo:", {"max_tokens": 30, "block_size": 8, "temperature": 0.8, "seed": 3}),
    ]
    want = [generate(model, tok, p, raw=True, **kw) for p, kw in jobs]
    got, errors = [None] * len(jobs), []

    def work(i):
        try:
            p, kw = jobs[i]
            for _ in range(2):
                got[i] = generate(model, tok, p, raw=True, **kw)
            if "temperature" not in kw:  # a batch row samples its own law: greedy only
                assert batch_generate(model, tok, [p], raw=True, **kw).texts == [got[i]]
        except Exception as e:  # noqa: BLE001  reported below, with the thread's name
            errors.append(f"{i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert got == want


def test_each_decode_step_holds_the_model_lock_and_releases_it_between_steps(pair, monkeypatch):
    model, tok = pair
    real, held = generation.decode, []

    def other_thread_can_lock() -> bool:
        box = []

        def probe():
            ok = model.lock.acquire(blocking=False)
            box.append(ok)
            if ok:
                model.lock.release()

        t = threading.Thread(target=probe)
        t.start()
        t.join()
        return box[0]

    def watched(*a, **k):
        for c in real(*a, **k):
            held.append(not other_thread_can_lock())  # inside a step
            yield c

    monkeypatch.setattr(generation, "decode", watched)
    pieces = generation.stream_generate(model, tok, "def parse_args(", **KW)
    free = [other_thread_can_lock() for _ in pieces]  # between steps
    assert held and all(held) and all(free)


EXIT_SCRIPT = """
import sys, threading
from dflash_mlx import generate, load
model, tok = load(sys.argv[1], drafter=sys.argv[2])
threads = [threading.Thread(target=generate, args=(model, tok, "def parse_args("),
                            kwargs={"max_tokens": 12, "block_size": 4, "raw": True})
           for _ in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("done")
"""


def test_a_process_whose_threads_decoded_exits_cleanly(tiny_dir):
    """MLX frees a thread's streams and compile cache at process exit, after Python has
    finalised, unless the thread clears them itself: the process used to abort (exit 134,
    "terminate called without an active exception") after two threads had decoded."""
    import subprocess
    import sys

    from cli_helpers import REPO_ROOT, cli_env

    args = [sys.executable, "-c", EXIT_SCRIPT, str(tiny_dir / "qwen3"), str(tiny_dir / "d2_qwen3")]
    for _ in range(2):
        r = subprocess.run(
            args, check=False, capture_output=True, text=True, env=cli_env(), cwd=REPO_ROOT
        )
        assert r.returncode == 0 and r.stdout.strip() == "done", r.stderr[-2000:]
