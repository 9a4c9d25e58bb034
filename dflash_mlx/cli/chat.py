"""``dflash chat``: the command and its interactive loop.

The whole message history is re-sent each turn with one ``PromptCache`` kept for the
session, so a new turn prefills only its own tokens. Ctrl-C stops an answer at the next
cycle boundary (the caches stay consistent) and keeps the session; a second Ctrl-C stops at
once and starts a fresh cache. Ctrl-D or /exit leaves.
"""

from __future__ import annotations

import math
import re
import select
import shutil
import signal
import sys
from typing import Dict, List, Optional

import typer

from ..errors import DFlashError
from ..settings import GenerationConfig
from . import common as c
from .stats import sparkline

HELP = """commands:
  /help            this list
  /reset           forget the conversation (keeps the system prompt)
  /system <text>   set the system prompt and start over (/system alone clears it)
  /stats           statistics of the last answer and the session
  /exit            leave (also Ctrl-D)
a line ending in \\ continues on the next line; pasted multi-line text is one message.
Ctrl-C stops the current answer."""


_MARKDOWN = re.compile(r"(^|\n)(#{1,6} |```|\s*[-*] |\s*\d+\. |> )|\*\*[^*\n]+\*\*|`[^`\n]+`")


def looks_like_markdown(text: str) -> bool:
    """True when text uses markdown worth rendering (headings, fences, lists, bold, code)."""
    return bool(_MARKDOWN.search(text))


def rows_used(text: str, width: int) -> Optional[int]:
    """Terminal rows that text printed from column 0 (plus a final newline) occupies, or
    None when that cannot be known (control characters, tabs)."""
    from rich.cells import cell_len

    if any(ord(ch) < 32 and ch != "\n" for ch in text) or "\x7f" in text:
        return None
    width = max(int(width), 1)
    return sum(max(1, math.ceil(cell_len(line) / width)) for line in text.split("\n"))


class _StopFlag:
    """SIGINT handler for the duration of an answer: the first Ctrl-C asks to stop at the
    next cycle, a second one interrupts immediately."""

    def __init__(self):
        self.hit = 0
        self._old = None

    def __enter__(self):
        self.hit = 0
        try:
            self._old = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread
            self._old = None
        return self

    def _handle(self, signum, frame):
        self.hit += 1
        if self.hit > 1:
            raise KeyboardInterrupt

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
        return False


class ChatSession:
    """One terminal conversation over a loaded model.

    Args:
        model, tokenizer: from ``load``. name: shown in the banner.
        gen: the decoding settings of every answer. system: system prompt.
        show_stats: print a stats line after each answer.
    """

    def __init__(
        self,
        model,
        tokenizer,
        name: str,
        gen: GenerationConfig,
        system: Optional[str] = None,
        show_stats: bool = True,
        stdin=None,
        stdout=None,
        markdown: bool = True,
    ):
        from rich.console import Console

        self.model, self.tok, self.name, self.gen = model, tokenizer, name, gen
        self.system = system
        self.show_stats = show_stats
        self.markdown = markdown
        self.stdin = stdin or sys.stdin
        self.out = stdout or sys.stdout
        self.con = Console(file=self.out, highlight=False, soft_wrap=True)
        self.history: List[Dict[str, str]] = []
        self.cache = model.make_cache()
        # Token-exact transcript (template text and ids through the last answer), so the
        # next turn appends to exactly what the cache holds, as mlx-lm's chat does.
        self.prev_text: Optional[str] = None
        self.prev_ids: List[int] = []
        self.last = None
        self.turns = 0
        self.total_generated = 0
        self.total_prefilled = 0
        self.tty = self.stdin.isatty()
        if self.tty:
            try:
                import readline  # noqa: F401 - line editing and history for input()
            except ImportError:  # pragma: no cover
                pass

    # -- input
    def _more_pending(self) -> bool:
        if not self.tty:
            return False
        try:
            return bool(select.select([self.stdin], [], [], 0.02)[0])
        except (OSError, ValueError):
            return False

    def _read(self) -> Optional[str]:
        """One message (None at end of input); handles trailing backslashes and pastes."""
        lines: List[str] = []
        prompt = ">>> "
        while True:
            if self.tty:
                line = input(prompt)
            else:
                self.out.write(prompt)
                self.out.flush()
                line = self.stdin.readline()
                if not line:
                    raise EOFError
                line = line.rstrip("\n")
            if line.endswith("\\"):
                lines.append(line[:-1])
                prompt = "... "
                continue
            lines.append(line)
            if self._more_pending():
                prompt = ""
                continue
            return "\n".join(lines)

    # -- commands
    def reset(self) -> None:
        self.history = []
        self.cache = self.model.make_cache()
        self.prev_text, self.prev_ids = None, []

    def prompt_ids(self) -> tuple:
        """(template text, ids) of the whole conversation so far, ready for an answer.

        The ids are the previous transcript's ids followed by the tokens of the new
        template text only; when the template rewrites earlier turns (some strip reasoning
        from old answers) the whole text is tokenized afresh.
        """
        from ..generation import encode_prompt, template_errors

        msgs = self.messages()
        try:
            full = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        except template_errors():
            return None, encode_prompt(self.tok, msgs)
        if self.prev_text is not None and isinstance(full, str) and full.startswith(self.prev_text):
            tail = self.tok.encode(full[len(self.prev_text) :], add_special_tokens=False)
            return full, self.prev_ids + list(tail)
        return full, encode_prompt(self.tok, msgs)

    def messages(self) -> List[Dict[str, str]]:
        sys_msg = [{"role": "system", "content": self.system}] if self.system else []
        return sys_msg + self.history

    def stats_text(self) -> str:
        r = self.last
        if r is None:
            return "no answers yet"
        acc = " ".join(f"{round(100 * a)}" for a in r.acceptance)
        return (
            f"last answer: prefilled {r.prompt_processed} of {r.prompt_tokens} prompt tokens "
            f"({r.prompt_tokens - r.prompt_processed} from cache), {r.prompt_tps:.1f} tok/s\n"
            f"             generated {r.generation_tokens} tokens, {r.generation_tps:.1f} tok/s, "
            f"tau {r.tau:.2f} over {r.cycles} cycles\n"
            f"             acceptance {sparkline(r.acceptance)}  {acc} % by block position\n"
            f"session:     {self.turns} answers, {self.total_generated} tokens generated, "
            f"{self.total_prefilled} prefilled, {len(self.cache.tokens)} tokens in cache, "
            f"peak memory {r.peak_memory:.2f} GB"
        )

    def command(self, line: str) -> bool:
        """Run a slash command; False means leave."""
        cmd, _, arg = line.strip().partition(" ")
        cmd = cmd.lower()
        if cmd in ("/exit", "/quit", "/q"):
            return False
        if cmd in ("/help", "/?"):
            self.con.print(HELP, markup=False)
        elif cmd == "/reset":
            self.reset()
            self.con.print("[dim]conversation cleared[/dim]")
        elif cmd == "/system":
            self.system = arg.strip() or None
            self.reset()
            self.con.print(
                "[dim]system prompt "
                + ("set" if self.system else "cleared")
                + "; conversation cleared[/dim]"
            )
        elif cmd == "/stats":
            self.con.print(self.stats_text(), markup=False)
        else:
            self.con.print(f"unknown command {cmd}; /help lists the commands", markup=False)
        return True

    # -- one turn
    def answer(self, text: str) -> None:
        from ..generation import stream_generate

        self.history.append({"role": "user", "content": text})
        full, ids = self.prompt_ids()
        pieces: List[str] = []
        answer_ids: List[int] = []
        last = None
        stopped = False
        gen = stream_generate(self.model, self.tok, ids, config=self.gen, prompt_cache=self.cache)
        try:
            with _StopFlag() as flag:
                for r in gen:
                    last = r
                    answer_ids.extend(r.tokens)
                    if r.text:
                        pieces.append(r.text)
                        self.out.write(r.text)
                        self.out.flush()
                    if flag.hit:
                        stopped = True
                        break
        except KeyboardInterrupt:
            # Stopped mid-cycle: the caches may be half-updated, so start a fresh one.
            stopped = True
            self.cache = self.model.make_cache()
        finally:
            gen.close()
        self.out.write("\n")
        self.out.flush()
        if not stopped:
            self._render_markdown("".join(pieces))
        reply = self.tok.decode(answer_ids) if answer_ids else "".join(pieces)
        self.history.append({"role": "assistant", "content": reply})
        if full is not None:
            self.prev_text, self.prev_ids = full + reply, ids + answer_ids
        if last is not None:
            self.last = last
            self.turns += 1
            self.total_generated += last.generation_tokens
            self.total_prefilled += last.prompt_processed
        if stopped:
            self.con.print("[yellow]\\[stopped][/yellow] [dim]the session continues[/dim]")
        if self.show_stats and last is not None:
            self.con.print(
                f"[dim]{last.prompt_processed} new prompt tokens · {last.generation_tokens} "
                f"tokens at {last.generation_tps:.1f} tok/s · tau {last.tau:.2f}[/dim]"
            )

    def _render_markdown(self, shown: str) -> None:
        """Replace the streamed answer by its rendered markdown, when the terminal allows:
        stdout is a terminal and the whole answer is still on screen."""
        if not (self.markdown and shown.strip() and looks_like_markdown(shown)):
            return
        isatty = getattr(self.out, "isatty", None)
        if not (isatty and isatty()):
            return
        size = shutil.get_terminal_size()
        n = rows_used(shown, size.columns)
        if n is None or n >= size.lines - 1:
            return
        from rich.markdown import Markdown

        self.out.write(f"\x1b[{n}F\x1b[J")  # back to the answer's first row, clear below
        self.out.flush()
        self.con.print(Markdown(shown))

    def loop(self) -> None:
        self.con.print(
            f"[bold]dflash chat[/bold] · {self.name} · "
            f"block {self.gen.block_size or self.model.block_size}"
            f" · /help for commands, Ctrl-D to leave"
        )
        while True:
            try:
                line = self._read()
            except EOFError:
                self.out.write("\n")
                break
            except KeyboardInterrupt:
                self.out.write("\n")
                self.con.print("[dim](Ctrl-D or /exit to leave)[/dim]")
                continue
            if not line.strip():
                continue
            if line.lstrip().startswith("/") and "\n" not in line.strip():
                if not self.command(line):
                    break
                continue
            self.answer(line)
        self.out.flush()


def chat(
    model: str = c.MODEL,
    drafter: Optional[str] = c.DRAFTER,
    quant: Optional[str] = c.QUANT,
    max_tokens: int = c.max_tokens_option("chat", "Tokens per answer."),
    temp: float = c.TEMP,
    top_p: float = c.TOP_P,
    top_k: int = c.TOP_K,
    min_p: float = c.MIN_P,
    presence_penalty: float = c.PRESENCE,
    seed: Optional[int] = c.SEED,
    block_size: Optional[str] = c.BLOCK_SIZE,
    no_selector: bool = c.NO_SELECTOR,
    system: Optional[str] = c.SYSTEM,
    offline: bool = c.OFFLINE,
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Print the loaded paths."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No per-turn stats line."),
    no_markdown: bool = typer.Option(
        False, "--no-markdown", help="Keep answers as streamed (no markdown rendering)."
    ),
):
    """Chat in the terminal; caches persist across turns. /help lists the commands."""
    cfg = c.settings(
        max_tokens, temp, top_p, top_k, min_p, presence_penalty, seed, block_size, no_selector
    )
    m, tok = c.load_pair(model, drafter, quant, offline, False, verbose, cfg)
    if getattr(tok, "chat_template", None) is None:
        raise DFlashError(
            f"{m.name} has no chat template, so it cannot chat; use `dflash run` with a prompt"
        )
    session = ChatSession(
        m, tok, m.name, cfg, system=system, show_stats=not quiet, markdown=not no_markdown
    )
    session.loop()
