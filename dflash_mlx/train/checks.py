"""What the training entry points check before any work starts, and how they end.

``distill``, ``drafter`` and ``rounds`` parse their options with :class:`Parser` (a bad value
is one ``error:`` line, exit 2), check their folders here (``out_dir``, ``need_shards``,
``check_features``) and run under :func:`entry`: a :class:`DFlashError` or an ``OSError``
ends in one ``error:`` line and exit 2, never a traceback; Ctrl-C exits 130 and SIGTERM 143,
with one line saying what was kept (:class:`Stop`). A save runs :func:`shielded`, so a
signal that arrives meanwhile waits until the files are whole.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import signal
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from dflash_mlx.errors import DFlashError

USAGE_EXIT = 2
YEAR_MINUTES = 525600.0  # the longest --minutes taken: a longer budget is a typo
EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}


class Stop(KeyboardInterrupt):
    """Ctrl-C (exit 130) or SIGTERM (exit 143), with what was kept (``saved``). A
    KeyboardInterrupt, so code that handles Ctrl-C handles SIGTERM the same way."""

    def __init__(self, code: int = 130, saved: str = ""):
        super().__init__(code, saved)
        self.code, self.saved = code, saved


def stop_code(e: KeyboardInterrupt) -> int:
    """The exit code an interruption asks for: 143 for SIGTERM, else 130 (Ctrl-C)."""
    return e.code if isinstance(e, Stop) else 130


def _err(msg) -> None:
    print("error: " + " ".join(str(msg).split()), file=sys.stderr, flush=True)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one ``error:`` line (exit 2), not usage + error."""

    def error(self, message):
        """argparse's hook for a bad command line."""
        _err(f"{message}; see `{self.prog} --help`")
        sys.exit(USAGE_EXIT)


def whole(low: int):
    """An argparse ``type``: an integer >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low} (got {value})")
        return value

    return parse


def number(low: float, high: float = math.inf, open_low: bool = True):
    """An argparse ``type``: a finite number above ``low`` (or at least it, with
    ``open_low=False``) and at most ``high``."""
    bound = f"> {low:g}" if open_low else f">= {low:g}"
    bound += f" and <= {high:g}" if high < math.inf else ""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        low_ok = value > low if open_low else value >= low
        if not (math.isfinite(value) and low_ok and value <= high):
            raise argparse.ArgumentTypeError(f"must be a finite number {bound} (got {text})")
        return value

    return parse


def out_dir(path: Path, flag: str) -> Path:
    """Create an output folder if needed and make sure a file can be written in it.

    Args:
        path: the folder. flag: its option, for the message (``--out``).

    Raises:
        DFlashError: it is a file, cannot be created, or is not writable.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise DFlashError(f"{flag} {path} is a file, not a folder; pass a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        why = e.strerror or str(e)
        raise DFlashError(f"{flag} {path} cannot be written ({why}); pass a writable folder")
    return path


def finished_shards(split_dir: Path) -> list:
    """The finished shards of a split folder (a shard being written has a ``.`` in its
    name: ``shard_0003.tmp``)."""
    split_dir = Path(split_dir)
    if not split_dir.is_dir():
        return []
    return sorted(d for d in split_dir.glob("shard_*") if d.is_dir() and "." not in d.name)


def need_shards(split_dir: Path, fix: str) -> None:
    """Refuse a split folder without finished shards.

    Args:
        split_dir: e.g. ``DATA/train``. fix: how to make them, for the message.
    """
    if not finished_shards(split_dir):
        what = "no such folder" if not Path(split_dir).exists() else "no finished shards"
        raise DFlashError(f"{split_dir}: {what}; {fix}")


def check_features(roots: list, held: Path, target) -> list:
    """Refuse shards another target made: their layers must exist in ``target`` and every
    shard's feature rows must be ``len(layer_ids) * hidden_size`` wide.

    Args:
        roots: train split folders (the first holds ``meta.json``). held: held-out folder.
        target: the mlx-lm target.

    Returns:
        the recorded ``layer_ids``.
    """
    meta_path = Path(roots[0]) / "meta.json"
    try:
        ids = [int(i) for i in json.loads(meta_path.read_text())["layer_ids"]]
    except (OSError, ValueError, KeyError, TypeError):
        raise DFlashError(f"{meta_path} is missing or unreadable; distil into that folder again")
    n_layers, hidden = target.args.num_hidden_layers, target.args.hidden_size
    if not ids or min(ids) < 0 or max(ids) >= n_layers:
        raise DFlashError(
            f"{meta_path} records target layers {ids}, but this target has {n_layers}; "
            "pass the --target the answers were distilled with"
        )
    for d in [s for r in [*roots, held] for s in finished_shards(r)]:
        width = np.load(d / "feats.npy", mmap_mode="r").shape[-1]
        if width != len(ids) * hidden:
            raise DFlashError(
                f"{d} holds features {width} wide, but this target's are "
                f"{len(ids)} x {hidden}; pass the --target the answers were distilled with"
            )
    return ids


def check_resume(out: Path, resume: bool) -> None:
    """Refuse ``--resume`` with nothing saved in ``out``, and a fresh run that would write
    over a saved run or over a drafter that is not a training run's.

    Args:
        out: the run's folder. resume: whether ``--resume`` was passed.
    """
    out = Path(out)
    state = out / "train_state" / "state.json"
    if resume and not state.exists():
        raise DFlashError(
            f"nothing to resume: {out} holds no saved run (train_state/state.json); "
            "run without --resume to start a fresh one"
        )
    if resume:
        return
    if state.exists():
        raise DFlashError(
            f"{out} holds a saved run (train_state/); pass --resume to continue it, or "
            "another --out to start a fresh one"
        )
    if (out / "config.json").exists() or (out / "model.safetensors").exists():
        raise DFlashError(f"{out} holds a drafter this run would overwrite; pass another --out")


def mask_token_id(tokenizer, token: str, vocab_size: int) -> int:
    """The id of the mask token; refuses a token the tokenizer does not have."""
    vocab = tokenizer.get_vocab()
    tid = vocab.get(token)
    if tid is None or not 0 <= tid < vocab_size:
        special = [t for t in getattr(tokenizer, "all_special_tokens", []) if t in vocab][:4]
        hint = f" (its special tokens include {', '.join(special)})" if special else ""
        raise DFlashError(
            f"--mask-token {token!r} is not a token of the target's tokenizer; "
            f"pass one it has, ideally one it never emits{hint}"
        )
    return int(tid)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def shielded():
    """Hold Ctrl-C and SIGTERM while the block runs (a save), then raise the one that came
    (a :class:`Stop`). Outside the main thread signals cannot arrive here: a no-op."""
    if not _main_thread():
        yield
        return
    got = []
    old = {s: signal.signal(s, lambda n, _f: got.append(n)) for s in EXIT}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    if got:
        raise Stop(EXIT[got[0]])


def _terminate(_signum, _frame):
    raise Stop(143)


def _interrupted(e: KeyboardInterrupt, hint: str) -> int:
    """Say what an interruption kept (one line); its exit code."""
    code, saved = stop_code(e), getattr(e, "saved", "")
    word = "terminated" if code == 143 else "interrupted"
    kept = (f"{saved}; {hint}" if hint else saved) if saved else "nothing was saved"
    print(f"{word}: {kept}", file=sys.stderr, flush=True)
    return code


def entry(hint: str = "", smaller: str = ""):
    """Decorate a ``main(argv)``: errors become one ``error:`` line and exit 2, Ctrl-C and
    SIGTERM one line saying what was kept and exit 130 / 143.

    Args:
        hint: what to run to continue after an interruption that kept something.
        smaller: the options that size the work, named when memory runs out.
    """

    def wrap(main):
        @functools.wraps(main)
        def run(argv=None):
            old = signal.signal(signal.SIGTERM, _terminate) if _main_thread() else None
            try:
                return main(argv)
            except KeyboardInterrupt as e:
                sys.exit(_interrupted(e, hint))
            except DFlashError as e:
                _err(e)
            except OSError as e:
                where = f" ({e.filename})" if e.filename else ""
                _err(f"{e.strerror or e}{where}; check the path and the disk")
            except MemoryError:
                _err(f"out of memory; lower {smaller or 'the sizes'} or free some memory")
            finally:
                if old is not None:
                    signal.signal(signal.SIGTERM, old)
            sys.exit(USAGE_EXIT)

        return run

    return wrap
