"""Closed or full standard streams: `dflash run/chat/bench` end in one `error:` line and
exit code 2 (no traceback), and a closed stdin does not swallow the next file opened."""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest
from cli_helpers import REPO_ROOT, build_pair, cli_env


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("streams"))


def dflash(pair, args: str, redirect: str):
    """Run `dflash <args>` on the tiny pair under a shell redirection; (rc, stdout, stderr)."""
    model = f"--model {pair / 'target'} --drafter {pair / 'drafter'}"
    cmd = f"exec {shlex.quote(sys.executable)} -m dflash_mlx.cli {args} {model} {redirect}"
    p = subprocess.run(
        ["bash", "-c", cmd],
        capture_output=True,
        env=cli_env(),
        cwd=REPO_ROOT,
        timeout=120,
        check=False,
    )
    return p.returncode, p.stdout.decode(), p.stderr.decode()


def one_error(rc, err, needle):
    assert rc == 2, (rc, err)
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("error: "), err
    assert needle in err, err


def test_run_without_a_prompt_and_stdin_closed_says_so(pair):
    rc, _, err = dflash(pair, "run -m 2", "<&-")
    one_error(rc, err, "no prompt: stdin is closed")


def test_run_with_a_prompt_and_stdin_closed_loads_and_answers(pair):
    # the checkpoint opened next used to land on fd 0, and MLX failed to read it
    rc, _out, err = dflash(pair, "run -m 2 -q hi", "<&-")
    assert rc == 0 and "Traceback" not in err and "error" not in err, err


@pytest.mark.parametrize("command", ["run -m 2 hi", "run -m 2 -q --json hi", "chat -m 2"])
def test_a_full_stdout_is_one_line(pair, command):
    rc, _, err = dflash(pair, command, ">/dev/full </dev/null")
    one_error(rc, err, "cannot write to stdout (No space left on device)")


@pytest.mark.parametrize("command", ["run -m 2 hi", "chat -m 2", "bench -m 2 -n 1"])
def test_a_closed_stdout_is_refused_before_loading(pair, command):
    rc, _, err = dflash(pair, command, ">&-")
    name = command.split()[0]
    one_error(rc, err, f"stdout is closed, so `dflash {name}` has nowhere to write")


def test_chat_with_stdin_closed_is_one_line(pair):
    rc, _, err = dflash(pair, "chat -m 2", "<&-")
    one_error(rc, err, "stdin is closed (<&-), and chat reads your messages from it")


def test_bench_with_a_full_stdout_is_one_line(pair):
    rc, _, err = dflash(pair, "bench -m 8 -n 1 -p hi", ">/dev/full")
    one_error(rc, err, "cannot write to stdout")
