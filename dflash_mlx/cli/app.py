"""The ``dflash`` command line: run, chat, models, serve, bench, doctor, convert, roofline.

Only typer and light modules are imported at start-up: MLX, mlx-lm, huggingface_hub and the
engine are imported inside the commands, so ``dflash --help`` stays instant. Every bad input
ends with one line on stderr (``error: <problem>; <fix>``) and exit code 2, never a traceback.
"""

from __future__ import annotations

import sys

import typer
from typer.core import TyperGroup

try:  # typer >= 0.26 vendors click
    from typer._click import exceptions as _cx
except ImportError:  # pragma: no cover - older typer
    from click import exceptions as _cx

from .. import __version__
from ..errors import DFlashError
from .bench import bench
from .chat import chat
from .convert import convert
from .doctor import doctor
from .models import models
from .roofline import roofline
from .run import run
from .serve import serve
from .streams import WRITE_ERRNOS, reopen_closed, write_error

USAGE_EXIT = 2


def _err(msg: str) -> None:
    msg = " ".join(str(msg).split())
    print(f"error: {msg}", file=sys.stderr, flush=True)


def _interrupted() -> None:
    print("\ninterrupted", file=sys.stderr, flush=True)
    sys.exit(130)


def _os_error(e: OSError) -> str:
    """One line for an OSError that escaped a command: a failed write to an open stream
    (stdout full or gone: no file name; files the commands write name themselves), or I/O."""
    if e.filename is None and e.errno in WRITE_ERRNOS:
        return write_error(e)
    where = f" ({e.filename})" if e.filename else ""
    return f"{e.strerror or e}{where}; check the file and the disk"


class _Group(TyperGroup):
    """Typer group whose errors are one line on stderr with exit code 2."""

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        if not standalone_mode:  # an embedding caller handles errors itself
            return super().main(*args, standalone_mode=False, **kwargs)
        reopen_closed()
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except _cx.NoArgsIsHelpError as e:
            print(e.ctx.get_help())
            sys.exit(0)
        except _cx.UsageError as e:
            cmd = e.ctx.command_path if e.ctx is not None else "dflash"
            msg = e.format_message().rstrip(".")
            _err(f"{msg}; see `{cmd} --help`")
            sys.exit(USAGE_EXIT)
        except _cx.ClickException as e:
            _err(e.format_message())
            sys.exit(e.exit_code if e.exit_code else 1)
        except DFlashError as e:
            _err(str(e))
            sys.exit(USAGE_EXIT)
        except (typer.Abort, KeyboardInterrupt, EOFError):
            _interrupted()
        except OSError as e:  # stdout full or gone, or a file that failed under us
            _err(_os_error(e))
            sys.exit(USAGE_EXIT)
        if isinstance(rv, int) and rv:
            if rv == 130:
                _interrupted()
            sys.exit(rv)
        sys.exit(0)


app = typer.Typer(
    cls=_Group,
    name="dflash",
    help="DFlash 2 speculative decoding on MLX: lossless, faster local LLM inference.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool):
    if value:
        print(f"dflash-mlx {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
):
    """DFlash 2 speculative decoding on MLX: lossless, faster local LLM inference.

    Examples: dflash run --model Qwen3.8-27B "Write a haiku" · dflash chat --model demo ·
    dflash models
    """


for _command in (run, chat, models, serve, bench, doctor, convert, roofline):
    app.command()(_command)


def main(argv=None, prog_name: str = "dflash"):
    """Run the command line (``argv`` defaults to sys.argv[1:])."""
    app(args=argv, prog_name=prog_name)
