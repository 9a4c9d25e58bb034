"""``dflash chat`` under ``mlx.launch`` (docs/distributed.md): the terminal is rank 0's; each
turn (its prompt ids, settings, thinking budget and images) and each reset goes out to the
other ranks, which decode it in step with rank 0 and stop at the same cycle (``follow``)."""

from __future__ import annotations

import signal
from contextlib import nullcontext

from ..errors import DFlashError


class ChatLead:
    """Rank 0's side of a chat across ranks (``ChatSession.lead``).

    Args:
        channel, dog: from ``distributed.follow.start`` (dog None: a broken link raises).
    """

    def __init__(self, channel, dog):
        self.channel, self.dog = channel, dog

    def stream(self, gen, ids: list[int], cfg, budget, prompt=None, vision=None):
        """Send the turn; ``gen``'s responses, with the other ranks told after each one
        whether to go on.

        Args:
            ids: the conversation's text ids (the thinking gate reads them). prompt, vision:
                the engine's prompt and its ``VisionPrompt`` when the turn has images.
        """
        from ..distributed import follow, wire

        turn = {"op": "turn", "ids": list(ids), "cfg": wire.config_dict(cfg), "budget": budget}
        if vision is not None:
            turn |= {"prompt": list(prompt), "images": wire.images_of(vision)}
            if turn["images"] is None:
                raise DFlashError(follow.IMAGES_ACROSS)
        self.channel.send(turn)
        return follow.lead_stream(self.channel, gen, getattr(self.dog, "broke", None))

    def pin(self, cfg):
        """This turn's settings with a seed (a fresh one unless ``--seed`` set it): every
        rank samples with the same keys."""
        import os

        from ..distributed import wire

        return wire.seeded(cfg, int.from_bytes(os.urandom(4), "little"))

    def reset(self) -> None:
        """The session starts a fresh cache: so do the other ranks."""
        self.channel.send({"op": "reset"})

    def quit(self) -> None:
        """The session ends: so do the other ranks."""
        self.channel.send({"op": "quit"})

    def stopped_mid_cycle(self) -> None:
        """A second Ctrl-C stopped rank 0 inside a cycle: the other ranks wait in its
        collectives, so every rank ends (does not return)."""
        self.dog.fail("rank 0 was stopped inside a cycle (a second Ctrl-C)")


def start(group, m, cfg):
    """(the settings, ``ChatLead`` on rank 0 or (channel, watchdog) elsewhere) of a chat
    across ranks; every rank calls it after loading. ``auto`` follows rank 0's choices in
    each turn's decode (``distributed.policy``).

    Args:
        group: the launched group. m: the loaded pair. cfg: the command's settings.
    """
    from ..distributed import follow

    channel, dog = follow.start(group)
    return cfg, (ChatLead(channel, dog) if group.rank() == 0 else (channel, dog))


def follow_chat(channel, dog, m, tok) -> None:
    """A rank other than 0: decode rank 0's turns in step with it until it quits."""
    from ..distributed import follow, wire
    from ..generation import stream_generate
    from .thinking import processors

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is rank 0's to act on
    cache = m.make_cache()
    with follow.guarded(dog) if dog is not None else nullcontext():
        while True:
            cmd = channel.recv()
            if cmd["op"] == "quit":
                return
            if cmd["op"] == "reset":
                cache = m.make_cache()
                continue
            ids, cfg = cmd["ids"], wire.config_of(cmd["cfg"])
            procs = processors(tok, ids, cmd["budget"])
            prompt, extra = ids, {}
            if cmd.get("images"):  # rank 0's files: the same prompt made again here
                prompt = cmd["prompt"]
                extra = {"images": wire.vision_of(m, prompt, cmd["images"])}
            gen = stream_generate(
                m, tok, prompt, config=cfg, prompt_cache=cache, logits_processors=procs, **extra
            )
            try:
                follow.follow_stream(channel, gen)
            except DFlashError:
                pass  # rank 0 met the same refusal and said it
