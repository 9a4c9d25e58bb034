"""Long prompts for ``dflash bench --context N``: each prompt preceded by a slice of Python's
own standard-library sources, cut so the whole prompt is N tokens.

The sources are read at run time from this Python's installation (the package's own
sources when the standard library ships without them), so nothing is copied into the
repository and a run on the same Python sees the same text. Prompt i starts at the i-th
source file, so prompts differ.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

from ..errors import DFlashError

# Large, long-lived standard-library modules (a missing one is skipped).
SOURCES = (
    "argparse.py",
    "difflib.py",
    "textwrap.py",
    "shutil.py",
    "inspect.py",
    "dataclasses.py",
    "tarfile.py",
    "typing.py",
    "statistics.py",
    "calendar.py",
    "tempfile.py",
    "pprint.py",
)
INTRO = "Here is part of a Python source file:\n\n```python\n"
OUTRO = "\n```\n\n"


def source_files() -> list[Path]:
    """The source files the slices come from: ``SOURCES`` in this Python's standard library,
    or this package's own modules when it ships without sources."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = [lib / name for name in SOURCES if (lib / name).is_file()]
    return files or sorted(Path(__file__).resolve().parents[1].rglob("*.py"))


def source_text(start: int, chars: int) -> str:
    """At least ``chars`` characters of source (fewer only when every file together has
    fewer), file after file from the ``start``-th."""
    files = source_files()
    parts, n = [], 0
    for i in range(len(files)):
        text = files[(start + i) % len(files)].read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        n += len(text)
        if n >= chars:
            break
    return "\n".join(parts)


def with_context(tokenizer, prompts: list[str], tokens: int, raw: bool) -> list[str]:
    """Each prompt preceded by source code, so that it encodes (as the bench encodes it) to
    ``tokens`` tokens (a token or two fewer where the tokenizer merges across the cut).

    Args:
        tokenizer: the model's tokenizer. prompts: the requests.
        tokens: the length of each prompt in tokens. raw: skip the chat template.

    Returns:
        the long prompts, in order.

    Raises:
        DFlashError: ``tokens`` leaves no room for source before a request.
    """
    return [_fit(tokenizer, p, tokens, raw, i) for i, p in enumerate(prompts)]


def _fit(tokenizer, request: str, tokens: int, raw: bool, start: int) -> str:
    """The request after a source slice cut to make ``tokens`` tokens in all."""
    from ..generation import encode_prompt

    def length(src: str) -> int:
        return len(encode_prompt(tokenizer, INTRO + src + OUTRO + request, raw))

    bare = length("")
    if bare >= tokens:
        raise DFlashError(
            f"--context {tokens} leaves no room for source before the prompt ({bare} tokens "
            f"without it); pass --context {bare + 64} or more"
        )
    ids = tokenizer.encode(source_text(start, 8 * tokens), add_special_tokens=False)
    n, best = tokens - bare, ""
    for _ in range(6):  # cutting tokens and decoding them rarely re-encodes to the same count
        src = tokenizer.decode(ids[:n])
        got = length(src)
        if got <= tokens and len(src) > len(best):
            best = src
        if got == tokens or n >= len(ids) and got < tokens:
            break
        n = max(0, min(n + tokens - got, len(ids)))
    return INTRO + best + OUTRO + request
