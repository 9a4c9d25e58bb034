"""Terminal helpers of ``dflash chat``: Ctrl-C during an answer, and re-rendering an answer
as markdown once it is complete (when it is worth it and still on screen)."""

from __future__ import annotations

import math
import re
import shutil
import signal

_MARKDOWN = re.compile(r"(^|\n)(#{1,6} |```|\s*[-*] |\s*\d+\. |> )|\*\*[^*\n]+\*\*|`[^`\n]+`")


def looks_like_markdown(text: str) -> bool:
    """True when text uses markdown worth rendering (headings, fences, lists, bold, code)."""
    return bool(_MARKDOWN.search(text))


def rows_used(text: str, width: int) -> int | None:
    """Terminal rows that text printed from column 0 (plus a final newline) occupies, or
    None when that cannot be known (control characters, tabs)."""
    from rich.cells import cell_len

    if any(ord(ch) < 32 and ch != "\n" for ch in text) or "\x7f" in text:
        return None
    width = max(int(width), 1)
    return sum(max(1, math.ceil(cell_len(line) / width)) for line in text.split("\n"))


def rerender_markdown(out, con, shown: str) -> None:
    """Replace the streamed answer by its rendered markdown, when the terminal allows:
    out is a terminal and the whole answer is still on screen.

    Args:
        out: the text stream it was written to. con: a rich Console on out.
        shown: the answer as streamed.
    """
    if not (shown.strip() and looks_like_markdown(shown)):
        return
    isatty = getattr(out, "isatty", None)
    if not (isatty and isatty()):
        return
    size = shutil.get_terminal_size()
    n = rows_used(shown, size.columns)
    if n is None or n >= size.lines - 1:
        return
    from rich.markdown import Markdown

    out.write(f"\x1b[{n}F\x1b[J")  # back to the answer's first row, clear below
    out.flush()
    con.print(Markdown(shown))


class StopFlag:
    """SIGINT handler for the duration of an answer: the first Ctrl-C asks to stop at the
    next cycle (and calls ``on_first``, which stops a prefill at its next chunk), a second
    one interrupts immediately."""

    def __init__(self, on_first=None):
        self.hit = 0
        self._old = None
        self.on_first = on_first

    def __enter__(self):
        self.hit = 0
        try:
            self._old = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread
            self._old = None
        return self

    def _handle(self, signum, frame):
        self.hit += 1
        if self.hit == 1 and self.on_first is not None:
            self.on_first()
        if self.hit > 1:
            raise KeyboardInterrupt

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
        return False
