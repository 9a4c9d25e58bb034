"""What of a ``dflash chat`` conversation goes into the prompt: the messages, their ids
appended to the previous transcript's where the template allows, the oldest turns dropped
when the next answer would not fit in the context."""

from __future__ import annotations


class Conversation:
    """The prompt side of ``chat.ChatSession`` (a mixin: it reads the session's ``model``, ``tok``,
    ``system``, ``history``, ``context``, ``gen``, ``think``, ``prev_text`` / ``prev_ids``,
    ``pending`` / ``pictures`` (images) and writes through ``con`` and ``_error``)."""

    def prompt_ids(self) -> tuple:
        """(template text, ids) of the whole conversation so far, ready for an answer.

        The ids are the previous transcript's ids followed by the tokens of the new
        template text only; when the template rewrites earlier turns (some strip reasoning
        from old answers) the whole text is tokenized afresh.
        """
        from ..generation import encode_prompt, template_errors
        from .thinking import template_kwargs

        msgs, kw = self.messages(), template_kwargs(self.think)
        if getattr(self.tok, "chat_template", None) is None:  # the default chat format
            return None, encode_prompt(self.tok, msgs)
        try:
            full = self.tok.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=True, **(kw or {})
            )
        except template_errors():
            return None, encode_prompt(self.tok, msgs, template_kwargs=kw)
        if self.prev_text is not None and isinstance(full, str) and full.startswith(self.prev_text):
            tail = self.tok.encode(full[len(self.prev_text) :], add_special_tokens=False)
            return full, self.prev_ids + list(tail)
        return full, encode_prompt(self.tok, msgs, template_kwargs=kw)

    def engine_prompt(self, ids: list[int], cfg) -> tuple:
        """(the engine's prompt, its image keywords): ``ids`` alone without images; with
        them, the conversation prepared by the engine's entry with the same template
        variables (``/think``) as the text, decoded as it is (the processor runs once)."""
        images = self.images()
        if not images:
            return ids, {}
        from ..generation import request_ids
        from .thinking import template_kwargs

        kw = {"images": images, "template_kwargs": template_kwargs(self.think)}
        vids, _, vision = request_ids(self.model, self.tok, self.messages(), cfg, **kw)
        return vids, {"images": vision}

    def user_turn(self, text: str) -> dict:
        """The next user message: the images ``/image`` attached first, then ``text``."""
        if not self.pending:
            return {"role": "user", "content": text}
        parts = [{"type": "image"} for _ in self.pending] + [{"type": "text", "text": text}]
        msg = {"role": "user", "content": parts}
        self.pictures[id(msg)] = (msg, self.pending)  # held: its id stays its own
        self.pending = []
        return msg

    def images(self) -> list:
        """The pictures of the conversation's messages, in reading order."""
        return [p for m in self.history for p in self.pictures.get(id(m), (None, []))[1]]

    def unsend(self) -> None:
        """Drop the last user message; its pictures go back to the next one."""
        msg = self.history.pop()
        self.pending = list(self.pictures.pop(id(msg), (None, []))[1]) + self.pending

    def _image(self, path: str) -> None:
        """/image PATH: check the file and attach it to the next message."""
        from ..errors import DFlashError
        from .common import read_images, require_vision

        if not path:
            self.con.print("usage: /image PATH (attaches it to your next message)", markup=False)
            return
        try:
            pic = read_images([path])[0]
            require_vision(self.model)
        except DFlashError as e:  # the session goes on without it
            self._error(str(e))
            return
        self.pending.append(pic)
        self.con.print(
            f"[dim]image {pic.width}x{pic.height} {pic.format} attached to your next "
            f"message ({len(self.pending)} waiting)[/dim]"
        )

    def messages(self) -> list[dict[str, str]]:
        sys_msg = [{"role": "system", "content": self.system}] if self.system else []
        return sys_msg + self.history

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
