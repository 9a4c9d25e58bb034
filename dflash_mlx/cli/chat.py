"""``dflash chat``: the command and its interactive loop.

The whole history is re-sent each turn with one ``PromptCache`` for the session, so a turn
prefills only its own tokens; the oldest turns are dropped when the next would not fit (the
system prompt stays). Ctrl-C stops an answer at the next cycle boundary, or a prefill at its
next chunk, and keeps the session; a second one stops at once with a fresh cache.
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
from .chat_context import Conversation
from .options import MODEL, ModelOptions, decoding, expand
from .stats import answer_stats
from .terminal import StopFlag, rerender_markdown
from .thinking import NO_THINK, THINKING_BUDGET, check_budget

HELP = """commands:
  /help            this list
  /reset           forget the conversation (keeps the system prompt)
  /system <text>   set the system prompt and start over (/system alone clears it)
  /stats           statistics of the last answer and the session
  /think [on|off]  thinking models: reason before answering or not (alone: switch)
  /image <path>    attach an image (PNG, JPEG, WebP, GIF) to your next message
  /exit            leave (also Ctrl-D)
a line ending in \\ continues on the next line; pasted multi-line text is one message.
Ctrl-C stops the current answer."""


class ChatSession(Conversation):
    """One terminal conversation over a loaded model (``lead``: under ``mlx.launch``, rank
    0's ``chat_ranks.ChatLead``, which sends each turn and reset to the other ranks).

    Args:
        model, tokenizer: from ``load``. name: shown in the banner.
        gen: the decoding settings of every answer. system: system prompt.
        show_stats: print a stats line after each answer. think: a thinking model's
            reasoning on or off (None: the template's default). thinking_budget: reasoning
            tokens before the template's closing marker is forced (None: no limit).
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
        think: bool | None = None,
        thinking_budget: int | None = None,
    ):
        from rich.console import Console

        from ..decoding.prompt import context_length, with_default_stops

        self.model, self.tok, self.name = model, tokenizer, name
        self.gen = replace(gen, stop=with_default_stops(gen.stop, tokenizer))
        self.context = context_length(model)
        self.system = system
        self.show_stats = show_stats
        self.think, self.budget = think, thinking_budget
        self.markdown = markdown
        self.stdin = stdin or sys.stdin
        self.out = stdout or sys.stdout
        self.con = Console(file=self.out, highlight=False, soft_wrap=True)
        self.history: list[dict] = []
        self.pending: list = []  # pictures /image attached to the next message
        self.pictures: dict[int, list] = {}  # id(history message) -> its pictures
        self.cache = model.make_cache()
        self.lead = None
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
        self.history, self.pictures, self.pending = [], {}, []
        self.cache = self.model.make_cache()
        self.prev_text, self.prev_ids = None, []
        if self.lead is not None:
            self.lead.reset()

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
        elif cmd == "/think":
            self._think(arg.strip().lower())
        elif cmd == "/image":
            self._image(arg.strip())
        else:
            self.con.print(f"unknown command {cmd}; /help lists the commands", markup=False)
        return True

    def _think(self, arg: str) -> None:
        """/think [on|off]: reasoning on or off from the next answer."""
        from ..server.reasoning import markers

        if arg not in ("", "on", "off"):
            self.con.print("usage: /think, /think on or /think off", markup=False)
            return
        self.think = (self.think is False) if arg == "" else arg == "on"
        state = "on" if self.think else "off"
        if markers(self.tok) is None:
            self.con.print(f"[dim]thinking {state}; this model has no thinking markers[/dim]")
        else:
            self.con.print(f"[dim]thinking {state} from the next answer[/dim]")

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
        self.history.append(self.user_turn(text))
        try:
            fitted = self._fit()
        except DFlashError as e:  # a prompt the checks refuse drops the message, not the session
            self.unsend()
            self._error(str(e))
            return
        if fitted is None:
            return
        full, ids = fitted
        try:
            last, shown, answer_ids, stopped = self._stream(ids)
        except DFlashError as e:  # the engine refused (e.g. images past the context)
            self.unsend()
            self._error(str(e))
            return
        pieces = shown.content
        if last is None:  # stopped before the first token: the message was never answered
            self.unsend()
            self.con.print(
                "[yellow]\\[stopped][/yellow] [dim]before the answer began; the message was "
                "dropped and the session continues[/dim]"
            )
            return
        # type-ahead was echoed under the answer: the rows to redraw are unknown, keep them
        if self.markdown and not stopped and not self._more_pending():
            rerender_markdown(self.out, self.con, "".join(pieces))
        reply = self.tok.decode(answer_ids) if answer_ids else "".join(pieces)
        said = {"role": "assistant", "content": reply}
        if shown.split is not None:  # the answer apart from its reasoning, as the API has it
            said["content"] = "".join(pieces)
            if shown.reasoning:
                said["reasoning_content"] = "".join(shown.reasoning)
        self.history.append(said)
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

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def _dim(self, text: str) -> None:
        self.con.print(text, style="dim", end="", markup=False, highlight=False)
        self.out.flush()

    def _stream(self, ids: list[int]):
        """Stream one answer (a thinking model's reasoning dim, before it): (last response
        or None, the ``thinking.Shown`` answer, ids, stopped)."""
        from ..decoding.state import Interrupted
        from ..generation import stream_generate
        from .thinking import Shown, processors

        shown = Shown(self.tok, ids, self._write, self._dim)
        answer_ids: list[int] = []
        last, stopped = None, False
        self.cache.interrupt.clear()
        procs = processors(self.tok, ids, self.budget)
        cfg = self.gen if self.lead is None else self.lead.pin(self.gen)  # a seed for all ranks
        prompt, extra = self.engine_prompt(ids, cfg)
        gen = stream_generate(
            self.model, self.tok, prompt, config=cfg, prompt_cache=self.cache,
            logits_processors=procs, **extra,
        )  # fmt: skip
        if self.lead is not None:  # a prefill stops at its end: every rank must run it all
            gen = self.lead.stream(gen, ids, cfg, self.budget, prompt, extra.get("images"))
        try:
            with StopFlag(on_first=None if self.lead else self.cache.interrupt.set) as flag:
                for r in gen:
                    last = r
                    answer_ids.extend(r.tokens)
                    shown.feed(r.text)
                    if flag.hit:
                        stopped = True
                        break
            shown.close()
        except Interrupted:  # the first Ctrl-C, during the prefill: the cache is consistent
            stopped = True
        except KeyboardInterrupt:
            # Stopped mid-cycle: the caches may be half-updated, so start a fresh one.
            if self.lead is not None:
                self.lead.stopped_mid_cycle()
            stopped = True
            self.cache = self.model.make_cache()
        finally:
            gen.close()
        self.out.write("\n")
        self.out.flush()
        return last, shown, answer_ids, stopped

    def loop(self) -> None:
        self.con.print(
            f"[bold]dflash chat[/bold] · {self.name} · "
            f"block {self.gen.block_size or self.model.block_size}"
            f" · /help for commands, {'/exit' if self.lead else 'Ctrl-D'} to leave"
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
    no_think: bool = NO_THINK,
    thinking_budget: int | None = THINKING_BUDGET,
):
    """Chat in the terminal; caches persist across turns. /help lists the commands."""
    streams.require_stdout("chat")
    budget = check_budget(thinking_budget)
    if streams.stdin_closed():
        raise DFlashError("stdin is closed (<&-), and chat reads your messages from it")
    m, tok = c.load_pair(src, False, verbose, cfg, sharded=True)
    from .. import distributed

    group, lead = distributed.group(), None
    if group is not None:
        from . import chat_ranks

        cfg, lead = chat_ranks.start(group, m, cfg)
        if group.rank() != 0:
            return chat_ranks.follow_chat(*lead, m, tok)
    from ..decoding.prompt import notice_default_format

    notice_default_format(tok)  # no chat template: say once which format stands in
    session = ChatSession(
        m, tok, m.name, cfg, system=system, show_stats=not quiet, markdown=not no_markdown,
        think=False if no_think else None, thinking_budget=budget,
    )  # fmt: skip
    if system:
        check_system_prompt(tok, system, session.context, "the --system text")
    session.lead = lead
    session.loop()
    if lead is not None:
        lead.quit()
