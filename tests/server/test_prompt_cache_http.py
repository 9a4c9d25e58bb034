"""The prompt caches through the real server (a subprocess on the tiny pair): OpenAI's
``cached_tokens`` and Anthropic's ``cache_read_input_tokens`` report what a request reused,
``/v1/cache`` and ``/health`` report the pool, and with ``--prompt-cache-gb 0
--prompt-cache-dir`` every cache goes to disk and comes back from it."""

import pytest
from test_server import KEY, _http, _start, _stop

SYSTEM = " ".join(f"rule {i}: answer briefly and cite the file you read." for i in range(30))


@pytest.fixture(scope="module")
def served(tiny_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prompt_cache")
    pair = (tiny_dir / "qwen3", tiny_dir / "d2_qwen3")
    args = ("--api-key", KEY, "--prompt-cache-gb", "0", "--prompt-cache-dir", str(tmp / "pc"))
    proc, url, _ = _start(tmp, *pair, *args)
    yield url, tmp / "pc"
    _stop(proc)


def _chat(url, user):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    body = {"messages": messages, "max_tokens": 4, "temperature": 0}
    status, out = _http(url + "/v1/chat/completions", body)
    assert status == 200, out
    return out["usage"]


def test_requests_sharing_a_system_prompt_reuse_it_through_the_disk_tier(served):
    url, folder = served
    first = _chat(url, "Which file?")
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    second = _chat(url, "And which line?")
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert 50 < cached < second["prompt_tokens"]  # the system prompt, not the question
    body = {
        "model": "local",
        "system": SYSTEM,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "Name the column."}],
    }
    status, out = _http(url + "/v1/messages", body)
    assert status == 200, out
    assert out["usage"]["cache_read_input_tokens"] == cached  # the same system prompt
    status, stats = _http(url + "/v1/cache")
    assert status == 200 and stats["object"] == "prompt_cache"
    assert stats["entries"] == 0 and stats["max_bytes"] == 0  # memory keeps nothing
    assert stats["lookups"] == 3 and stats["hits"] == 2 and stats["in_use"] == 0
    disk = stats["disk"]
    assert disk["restored"] == 2 and disk["saved"] == 3 and disk["entries"] >= 1
    assert any(folder.glob("*/e-*/target.safetensors"))
    status, health = _http(url + "/health", key=None)
    assert status == 200 and health["prompt_cache"]["hits"] == 2


def test_the_cache_report_needs_the_key(served):
    url, _ = served
    status, out = _http(url + "/v1/cache", key="wrong")
    assert status == 401 and out["error"]["code"] == "invalid_api_key"
