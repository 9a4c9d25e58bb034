"""``dflash chat``: the command and its interactive loop.

The whole message history is re-sent each turn with one ``PromptCache`` kept for the
session, so a new turn prefills only its own tokens. When the next turn would not fit in the
context, the oldest turns are dropped (the system prompt stays). Ctrl-C stops an answer at
the next cycle boundary, or a prefill at its next chunk (the caches stay consistent), and
keeps the session; a second Ctrl-C stops at once and starts a fresh cache. Ctrl-D or /exit
leaves.
"""

from __future__ import annotations

import select
import sys
from dataclasses import replace

import typer

from ..decoding.prompt import check_system_prompt
from ..errors import DFlashError
from ..settings import GenerationConfig
from . import common as c
from . import streams
from .options import MODEL, ModelOptions, decoding, expand
from .stats import answer_stats
from .terminal import StopFlag, rerender_markdown

HELP = """commands:
  /help            this list
  /reset           forget the conversation (keeps the system prompt)
  /system <text>   set the system prompt and start over (/system alone clears it)
  /stats           statistics of the last answer and the session
  /exit            leave (also Ctrl-D)
a line ending in \\ continues on the next line; pasted multi-line text is one message.
Ctrl-C stops the current answer."""


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
        system: str | None = None,
        show_stats: bool = True,
        stdin=None,
        stdout=None,
        markdown: bool = True,
    ):
        from rich.console import Console

        from ..decoding.prompt import context_length, with_default_stops

        self.model, self.tok, self.name = model, tokenizer, name
        self.gen = replace(gen, stop=with_default_stops(gen.stop, tokenizer))
        self.context = context_length(model)
        self.system = system
        self.show_stats = show_stats
        self.markdown = markdown
        self.stdin = stdin or sys.stdin
        self.out = stdout or sys.stdout
        self.con = Console(file=self.out, highlight=False, soft_wrap=True)
        self.history: list[dict[str, str]] = []
        self.cache = model.make_cache()
        # Token-exact transcript (template text and ids through the last answer), so the
        # next turn appends to exactly what the cache holds, as mlx-lm's chat does.
        self.prev_text: str | None = None
        self.prev_ids: list[int] = []
        self.last = None
        self.turns = 0
        self.total_generated = 0
        self.total_prefilled = 0
        self.tty = self.stdin.isatty()
        if self.tty:
            try:  # importing readline gives input() line editing and history
                import readline  # noqa: F401
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

    def _read(self) -> str | None:
        """One message (None at end of input); handles trailing backslashes and pastes.

        Lines that follow at once are a paste (one message), except when input is already
        waiting as the prompt appears: typed while the answer streamed, each line is its own
        message or command, as typed.
        """
        lines: list[str] = []
        prompt = ">>> "
        typed_ahead = self._more_pending()
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
            if not typed_ahead and self._more_pending():
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
        if getattr(self.tok, "chat_template", None) is None:  # the default chat format
            return None, encode_prompt(self.tok, msgs)
        try:
            full = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        except template_errors():
            return None, encode_prompt(self.tok, msgs)
        if self.prev_text is not None and isinstance(full, str) and full.startswith(self.prev_text):
            tail = self.tok.encode(full[len(self.prev_text) :], add_special_tokens=False)
            return full, self.prev_ids + list(tail)
        return full, encode_prompt(self.tok, msgs)

    def messages(self) -> list[dict[str, str]]:
        sys_msg = [{"role": "system", "content": self.system}] if self.system else []
        return sys_msg + self.history

    def stats_text(self) -> str:
        r = self.last
        if r is None:
            return "no answers yet"
        return (
            answer_stats(r) + f"\nsession:     {self.turns} answers, {self.total_generated} "
            f"tokens generated, {self.total_prefilled} prefilled, {len(self.cache.tokens)} "
            f"tokens in cache, peak memory {r.peak_memory:.2f} GB"
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
            try:
                check_system_prompt(
                    self.tok, arg.strip(), self.context, "that system prompt", "type it again"
                )
            except DFlashError as e:  # the system prompt and the conversation stay as they were
                self._error(str(e))
                return True
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
        """Answer one message: fit the conversation in the context, stream, keep the stats."""
        from ..decoding.prompt import check_chars, check_text

        try:
            check_text(text, "that message", "type it again")
            check_chars(self.tok, len(text), self.context)
        except DFlashError as e:
            self._error(str(e))
            return
        self.history.append({"role": "user", "content": text})
        try:
            fitted = self._fit()
        except DFlashError as e:  # a prompt the checks refuse drops the message, not the session
            self.history.pop()
            self._error(str(e))
            return
        if fitted is None:
            return
        full, ids = fitted
        last, pieces, answer_ids, stopped = self._stream(ids)
        if last is None:  # stopped before the first token: the message was never answered
            self.history.pop()
            self.con.print(
                "[yellow]\\[stopped][/yellow] [dim]before the answer began; the message was "
                "dropped and the session continues[/dim]"
            )
            return
        # type-ahead was echoed under the answer: the rows to redraw are unknown, keep them
        if self.markdown and not stopped and not self._more_pending():
            rerender_markdown(self.out, self.con, "".join(pieces))
        reply = self.tok.decode(answer_ids) if answer_ids else "".join(pieces)
        self.history.append({"role": "assistant", "content": reply})
        if full is not None:
            self.prev_text, self.prev_ids = full + reply, ids + answer_ids
        self.last = last
        self.turns += 1
        self.total_generated += last.generation_tokens
        self.total_prefilled += last.prompt_processed
        if stopped:
            self.con.print("[yellow]\\[stopped][/yellow] [dim]the session continues[/dim]")
        if self.show_stats:
            self.con.print(f"[dim]{self._stats_line(last)}[/dim]")

    def _stats_line(self, r) -> str:
        line = f"{r.prompt_processed} new prompt tokens · {r.generation_tokens} tokens"
        if r.cycles:  # a rate and tau need at least one verify cycle to mean anything
            line += f" at {r.generation_tps:.1f} tok/s · tau {r.tau:.2f}"
        return line

    def _error(self, message: str) -> None:
        self.out.flush()
        print(f"error: {message}", file=sys.stderr, flush=True)

    def _fit(self):
        """(template text, ids) of the conversation, its oldest turns dropped while it and
        room for an answer do not fit in the context; None (message dropped) when the
        message alone does not fit."""
        full, ids = self.prompt_ids()
        ctx = self.context
        if ctx is None:
            return full, ids
        reserve = min(self.gen.max_tokens, ctx // 2)
        saved, dropped = list(self.history), 0
        while len(ids) + reserve > ctx and len(self.history) > 1:
            pair = len(self.history) > 2 and self.history[1]["role"] == "assistant"
            del self.history[: 2 if pair else 1]
            dropped += 1
            # The conversation no longer starts as the cache does: re-tokenize it whole;
            # the cache keeps only the common prefix (the system prompt) and prefills the rest.
            self.prev_text, self.prev_ids = None, []
            full, ids = self.prompt_ids()
        if len(ids) >= ctx:  # even alone it does not fit: keep the conversation as it was
            self.history = saved[:-1]
            self._error(self._too_long(len(ids), ctx, saved[-1]))
            return None
        if dropped:
            turns = "turn" if dropped == 1 else "turns"
            self.con.print(
                f"[dim]dropped the {dropped} oldest {turns} to fit the {ctx}-token context[/dim]"
            )
        return full, ids

    def _too_long(self, n: int, ctx: int, message: dict) -> str:
        """Why a message that is the whole conversation (n tokens) does not fit: the system
        prompt's fault when the message alone would."""
        from ..decoding.prompt import conversation_tokens

        alone = conversation_tokens(self.tok, [message])
        if self.system and alone is not None and alone < ctx:
            return (
                f"this message and the system prompt make a prompt of {n} tokens (the "
                f"message alone: {alone}); this model's context is {ctx} tokens; shorten "
                "the system prompt (/system) or the message"
            )
        return (
            f"this message makes a prompt of {n} tokens; this model's context is {ctx} "
            "tokens; shorten the message"
        )

    def _stream(self, ids: list[int]):
        """Stream one answer: (last response or None, text pieces, ids, stopped)."""
        from ..decoding.state import Interrupted
        from ..generation import stream_generate

        pieces: list[str] = []
        answer_ids: list[int] = []
        last, stopped = None, False
        self.cache.interrupt.clear()
        gen = stream_generate(self.model, self.tok, ids, config=self.gen, prompt_cache=self.cache)
        try:
            with StopFlag(on_first=self.cache.interrupt.set) as flag:
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
        except Interrupted:  # the first Ctrl-C, during the prefill: the cache is consistent
            stopped = True
        except KeyboardInterrupt:
            # Stopped mid-cycle: the caches may be half-updated, so start a fresh one.
            stopped = True
            self.cache = self.model.make_cache()
        finally:
            gen.close()
        self.out.write("\n")
        self.out.flush()
        return last, pieces, answer_ids, stopped

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
            except UnicodeDecodeError as e:
                self._error(f"that input is not valid UTF-8 ({e.reason}); type it again")
                continue
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


# the decoding options, with this command's defaults
SETTINGS = decoding("chat", "Tokens per answer.")


@expand()
def chat(
    src: ModelOptions = MODEL,
    cfg: GenerationConfig = SETTINGS,
    system: str | None = c.SYSTEM,
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Print the loaded paths."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No per-turn stats line."),
    no_markdown: bool = typer.Option(
        False, "--no-markdown", help="Keep answers as streamed (no markdown rendering)."
    ),
):
    """Chat in the terminal; caches persist across turns. /help lists the commands."""
    streams.require_stdout("chat")
    if streams.stdin_closed():
        raise DFlashError("stdin is closed (<&-), and chat reads your messages from it")
    m, tok = c.load_pair(src, False, verbose, cfg)
    from ..decoding.prompt import notice_default_format

    notice_default_format(tok)  # no chat template: say once which format stands in
    session = ChatSession(
        m, tok, m.name, cfg, system=system, show_stats=not quiet, markdown=not no_markdown
    )
    if system:
        check_system_prompt(tok, system, session.context, "the --system text")
    session.loop()
