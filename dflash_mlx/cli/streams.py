"""The standard streams of a ``dflash`` process: closed ones are reopened on /dev/null at
start (else the next file opened lands on fd 0..2: MLX then fails to read a checkpoint, or
the text is written into it), and a write that fails ends in one ``error:`` line."""

from __future__ import annotations

import errno
import io
import os
import sys

from ..errors import DFlashError

NAMES = {0: "stdin", 1: "stdout", 2: "stderr"}
# (a closed pipe, EPIPE, is typer's: a silent exit 1, as `| head` expects)
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EBADF}
closed: set = set()  # the standard fds this process started without


def reopen_closed() -> None:
    """Put /dev/null on every standard fd that is closed, and give Python a stream for it."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            closed.add(fd)
            got = os.open(os.devnull, os.O_RDWR)
            if got != fd:  # a lower fd was free only if it was closed too: already handled
                os.dup2(got, fd)
                os.close(got)
    for fd in closed:
        name = NAMES[fd]
        if getattr(sys, name) is None:
            mode = "r" if fd == 0 else "w"
            setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, mode, closefd=False)))


def require_stdout(command: str) -> None:
    """Refuse to run a command whose output would be lost because stdout is closed.

    Raises:
        DFlashError: stdout was closed at start.
    """
    if 1 in closed:
        raise DFlashError(
            f"stdout is closed, so `dflash {command}` has nowhere to write; "
            "redirect it to a file or >/dev/null instead of >&-"
        )


def stdin_closed() -> bool:
    """True when the process started with stdin closed (``<&-``)."""
    return 0 in closed


def write_error(e: OSError) -> str:
    """The one-line message for a write to stdout that failed (a full disk, a bad device),
    after which the unwritten text is dropped so that the exit does not fail again."""
    try:
        if sys.stdout.fileno() == 1:  # the process's own stdout, not an embedding's stream
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.close(devnull)
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        pass
    reason = e.strerror or errno.errorcode.get(e.errno or 0, str(e))
    return f"cannot write to stdout ({reason}); free some space or write to another file"
