"""Bad input on the command line ends in one `error:` line and exit code 2, never a
traceback: stdin or files that are not UTF-8, prompts past the context, `serve` startup
errors. Also: `max_tokens` clamped to the room the context leaves, said in one line."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
from cli_helpers import REPO_ROOT, build_pair, cli_env
from typer.testing import CliRunner

from dflash_mlx.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A pair whose target has a 256-token context and no chat template."""
    return build_pair(tmp_path_factory.mktemp("clismall"), chat_template=False, context=256)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("DFLASH_API_KEY", raising=False)


def invoke(*args, input=None):
    return runner.invoke(app, [str(a) for a in args], input=input)


def model_args(root):
    return ["--model", root / "target", "--drafter", root / "drafter"]


def one_error_line(r, needle: str) -> str:
    assert r.exit_code == 2, (r.exit_code, r.stdout, r.stderr, r.exception)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert needle in lines[0], lines[0]
    assert "Traceback" not in r.stdout + r.stderr and r.stdout == ""
    return lines[0]


def test_stdin_that_is_not_utf8_is_one_line(small):
    r = invoke("run", *model_args(small), "-m", 4, "-", input=b"def f(\xff\xfe):")
    line = one_error_line(r, "stdin is not valid UTF-8 (byte 0xff at offset 6)")
    assert "iconv" in line
    r = invoke("run", *model_args(small), "-m", 4, input=b"\xc3(")  # a pipe, no "-"
    one_error_line(r, "stdin is not valid UTF-8 (byte 0xc3 at offset 0)")
    r = invoke("run", *model_args(small), "-m", 2, "-q", "-", input=b"\xef\xbb\xbfhello")
    assert r.exit_code == 0, r.stderr  # a byte-order mark is dropped, not an error


def test_a_prompt_argument_that_is_not_utf8_is_one_line(small):
    r = invoke("run", *model_args(small), "-m", 4, "def f(\udcff):")  # how argv carries 0xff
    one_error_line(r, "the prompt argument is not valid UTF-8 (byte 0xff at character 6)")
    r = invoke("run", *model_args(small), "-m", 4, "--system", "\udce9", "hi")
    one_error_line(r, "the system prompt is not valid UTF-8 (byte 0xe9")


def test_stdin_not_utf8_in_a_real_process(small):
    args = ["run", *map(str, model_args(small)), "-m", "4", "-"]
    p = subprocess.run(
        [sys.executable, "-m", "dflash_mlx.cli", *args],
        input=b"def f(\xff\xfe):",
        capture_output=True,
        env=cli_env(),
        cwd=REPO_ROOT,
        check=False,
    )
    err = p.stderr.decode()
    assert p.returncode == 2 and p.stdout == b"" and "Traceback" not in err
    assert err.startswith("error: stdin is not valid UTF-8") and err.count("\n") == 1


def test_a_prompt_longer_than_the_context_is_refused_in_one_line(small):
    r = invoke("run", *model_args(small), "-m", 4, "-", input="print(i) " * 200)
    one_error_line(r, "tokens; this model's context is 256 tokens; shorten the prompt")


def test_a_megabyte_on_stdin_is_refused_quickly(small):
    t = time.perf_counter()
    r = invoke("run", *model_args(small), "-m", 4, "-", input="x = 1\n" * 170_000)
    one_error_line(r, "the prompt is 1020000 characters, at least")
    assert time.perf_counter() - t < 20


def test_max_tokens_is_clamped_to_the_room_left_in_one_line(small):
    prompt = "print(i) " * 20
    r = invoke("run", *model_args(small), "-m", 1000, "--json", "-", input=prompt)
    assert r.exit_code == 0, r.stderr
    (note,) = r.stderr.strip().splitlines()
    assert note.startswith("note: --max-tokens 1000 lowered to ") and "256-token context" in note
    q = invoke("run", *model_args(small), "-m", 1000, "-q", "-", input=prompt)
    assert q.exit_code == 0 and q.stderr == ""


def test_a_dataset_file_that_is_not_utf8_is_one_line(small, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    r = invoke("bench", *model_args(small), "--dataset", bad, "-m", 4)
    one_error_line(r, "bad.jsonl:2 is not valid UTF-8 (byte 0xe9)")


def test_serve_startup_errors_are_one_line_before_loading(tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    nowhere = ["--model", tmp_path / "no-such-model"]  # never reached: the port fails first
    try:
        r = invoke("serve", *nowhere, "--port", port)
        one_error_line(r, f"cannot listen on 127.0.0.1:{port} (Address already in use)")
    finally:
        busy.close()
    r = invoke("serve", *nowhere, "--host", "bogus.invalid")
    one_error_line(r, "cannot listen on bogus.invalid:8080")
    r = invoke("serve", *nowhere, "--host", "a" * 300)
    one_error_line(r, "cannot listen on aaa")
    for port in ("65536", "-1"):
        one_error_line(invoke("serve", *nowhere, "--port", port), "--port must be in 0..65535")
    one_error_line(invoke("serve", *nowhere, "--max-batch", "0"), "--max-batch must be at least 1")


def test_serve_refuses_an_api_key_clients_cannot_send(tmp_path):
    nowhere = ["--model", tmp_path / "no-such-model"]  # never reached: the key fails first
    for key in ("clé", "ключ", "a\tb"):
        one_error_line(invoke("serve", *nowhere, "--api-key", key), "must be printable ASCII")
    for key in ("", " key"):
        one_error_line(invoke("serve", *nowhere, "--api-key", key), "--api-key is empty or")


def test_serve_refuses_a_bad_origin_or_grace_before_loading(tmp_path):
    nowhere = ["--model", tmp_path / "no-such-model"]  # never reached: the option fails first
    r = invoke("serve", *nowhere, "--allow-origin", "localhost:3000")
    one_error_line(r, "--allow-origin 'localhost:3000' is not an origin")
    for grace in ("-1", "nan", "1e300"):
        r = invoke("serve", *nowhere, "--shutdown-grace", grace)
        one_error_line(r, "--shutdown-grace must be in 0..3600 seconds")
