"""One voice (docs/distributed.md): rank 0 owns the terminal or the HTTP server and decides;
the other ranks follow it, making the same engine calls in the same order, so that every
rank's batch, caches and decode issue the same collectives.

Rank 0 sends each command as JSON bytes over the group's own ``all_sum`` (its length first;
the other ranks add zeros), on the decode's stream, so commands and the model's collectives
stay in one order on every rank. For ``dflash serve`` the engine wraps its prompt-cache pool
and its ``BatchGenerator`` (``LeadPool`` / ``LeadBatch``): every take, give, insert and
remove is logged and sent with the next step, and ``follow_batches`` replays them.
``lead_stream`` / ``follow_stream`` do the same for one stream of cycles (``dflash chat``).
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import os
import time
from contextlib import contextmanager

import mlx.core as mx
import numpy as np

from ..errors import DFlashError
from .wire import config_dict, config_of, images_of, rebuilt, recipe, seeded, vision_of


class Channel:
    """Rank 0's commands to the other ranks, over ``group``'s ``all_sum``.

    Args:
        group: the launched ``mx.distributed.Group``.
    """

    def __init__(self, group):
        self.group, self.rank, self.size = group, group.rank(), group.size()
        self.sending_since: float | None = None  # rank 0 in ``send`` since (``faults``)

    def _sum(self, a: mx.array) -> mx.array:
        from .link import agreed_sum

        return agreed_sum(a, self.group)

    def _exchange(self, data: bytes) -> bytes:
        n = int(self._sum(mx.array([len(data)], dtype=mx.int32)).item())
        if n == 0:
            return b""
        buf = np.frombuffer(data, np.uint8) if data else np.zeros(n, np.uint8)
        return bytes(np.array(self._sum(mx.array(buf))))

    def send(self, cmd: dict) -> None:
        """Rank 0: send one command (JSON-able) to every other rank."""
        self.sending_since = time.monotonic()
        try:
            self._exchange(json.dumps(cmd, separators=(",", ":")).encode())
        finally:
            self.sending_since = None

    def recv(self) -> dict:
        """Another rank: the next command of rank 0."""
        return json.loads(self._exchange(b"").decode())


def start(group):
    """(channel, watchdog) of a command run across ranks: every rank calls it at the same
    point, after loading. Rank 0's normal exit tells the others it was no fault. The
    channel's ``seed`` is rank 0's random seed, the same on every rank (``seeded``).

    Args:
        group: the launched ``mx.distributed.Group``.
    """
    from . import faults

    channel = Channel(group)
    dog = faults.watch(channel)
    atexit.register(dog.close)
    channel.seed = int.from_bytes(os.urandom(4), "little") % 2**31
    if channel.rank == 0:
        channel.send({"seed": channel.seed})
    else:
        channel.seed = channel.recv()["seed"]
    return channel, dog


@contextmanager
def guarded(dog):
    """Inside: a collective that fails (MLX's ring: "connection to a peer was lost") ends
    the rank through ``dog`` (one ``error:`` line naming the rank), not with a traceback."""
    try:
        yield
    except RuntimeError as e:
        dog.broke(e)


class Lead:
    """Rank 0's log of engine calls, sent with the next step (or reset, or quit).

    Args:
        channel: the group's ``Channel``. dog: its ``faults.Watchdog`` (a broken link ends
            the process through it), or None (the error is raised).
    """

    def __init__(self, channel: Channel, dog=None):
        self.channel, self.dog, self.ops = channel, dog, []
        self.on_break = None if dog is None else dog.broke
        self._handles = itertools.count()
        self.handles: dict[int, int] = {}  # id(cache) -> the handle every rank knows it by

    def send(self, last: list) -> None:
        """Send the logged calls and ``last``; a broken link ends the process
        (``faults``)."""
        ops, self.ops = [*self.ops, last], []
        try:
            self.channel.send({"ops": ops})
        except RuntimeError as e:
            self.broke(e)

    def broke(self, err: BaseException):
        """The group broke under a collective: hand it to ``on_break`` (it does not return)."""
        if self.on_break is None:
            raise err
        self.on_break(err)

    def pool(self, pool) -> LeadPool:
        """``pool`` wrapped so that its takes and gives are followed."""
        return LeadPool(pool, self)

    def batch(self, gen) -> LeadBatch:
        """``gen`` (a new ``BatchGenerator``) wrapped so that its calls are followed."""
        self.ops.append(["reset"])
        return LeadBatch(gen, self)

    def hello(self, fields: dict) -> None:
        """Tell the other ranks how to build their pool and batch (rank 0's choices)."""
        self.channel.send(fields)

    def quit(self) -> None:
        """The server is done: the other ranks leave their loop."""
        self.send(["quit"])


class LeadPool:
    """A ``PromptPool`` whose takes and gives every rank repeats (same entries, same
    evictions, same reused prefix: the check that the pools did not part)."""

    def __init__(self, pool, lead: Lead):
        self._pool, self._lead = pool, lead
        if pool.disk is not None:
            pool.agree = agreement(lead.channel)

    def __getattr__(self, name):
        return getattr(self._pool, name)

    def take(self, ids: list[int]):
        """As ``PromptPool.take``; logged with the prefix it reused. With a disk tier (each
        rank's own, which may hold other entries) every rank takes at once and they agree
        on what their tiers restored (``agreement``)."""
        h = next(self._lead._handles)
        disk = self._pool.disk is not None
        if disk:
            self._lead.send(["take", list(ids), h, None])
        try:
            cache = self._pool.take(ids)
        except RuntimeError as e:  # MLX's ring, in the agreement
            self._lead.broke(e)
        self._lead.handles[id(cache)] = h
        if not disk:
            self._lead.ops.append(["take", list(ids), h, len(cache.tokens)])
        return cache

    def give(self, cache, keep: bool = True) -> None:
        """As ``PromptPool.give``; logged."""
        h = self._lead.handles.pop(id(cache))
        self._pool.give(cache, keep)
        self._lead.ops.append(["give", h, bool(keep)])


class LeadBatch:
    """A ``BatchGenerator`` whose inserts, removes and steps every rank repeats."""

    def __init__(self, gen, lead: Lead):
        self._gen, self._lead = gen, lead

    def __getattr__(self, name):
        return getattr(self._gen, name)

    def insert(self, ids: list[int], config, *, cache=None, processors=(), images=None) -> int:
        """As ``BatchGenerator.insert`` with rank 0's seed (``seeded``); ``auto`` follows
        rank 0's plans in the batch itself (``policy.FollowPlans``); each logits
        processor goes as its ``recipe``, from which every rank builds its own; a prompt's
        images go as their files' bytes and the rendered text, from which every rank makes
        the same ``VisionPrompt`` (a file is 0.1-2 MB; its processed pixels ~10x that).

        Raises:
            DFlashError: a processor without a recipe; images without their bytes
                (``IMAGES_ACROSS``); or what ``insert`` refuses.
        """
        pics = None if images is None else images_of(images)
        if images is not None and pics is None:
            raise DFlashError(IMAGES_ACROSS)
        recipes = [recipe(p) for p in processors]
        seed = int.from_bytes(os.urandom(4), "little")
        cfg = seeded(config, seed)
        uid = self._gen.insert(ids, cfg, cache=cache, processors=processors, images=images)
        h = None if cache is None else self._lead.handles[id(cache)]
        op = ["insert", list(ids), config_dict(cfg), h, recipes]
        if pics is not None:
            op.append(pics)
        self._lead.ops.append(op)
        return uid

    def remove(self, uid: int) -> None:
        """As ``BatchGenerator.remove``; logged."""
        self._gen.remove(uid)
        self._lead.ops.append(["remove", uid])

    def step(self):
        """Send the logged calls, then step: every rank steps the same batch."""
        self._lead.send(["step"])
        try:
            return self._gen.step()
        except RuntimeError as e:  # MLX's ring: "connection to a peer was lost"
            self._lead.broke(e)


# serve and chat send a request's image files with its ids (``wire.images_of``); a prompt
# prepared from images without their bytes (a PIL image given as it is) cannot go
IMAGES_ACROSS = (
    "images without their files' bytes do not reach the other processes; pass image files "
    "or bytes under mlx.launch"
)


class Parted(DFlashError):
    """A follower's state no longer matches rank 0's."""


def agreement(channel: Channel):
    """``PromptPool.agree`` across ranks: every rank's (tokens reused from memory, tokens
    restored from its own disk tier) in one ``all_sum``; a restore counts only when every
    rank restored as many (a rank whose folder cannot be written, or lost an entry, has
    fewer), so the ranks never part over their disks.

    Raises:
        Parted: (another rank than 0) its memory reused another prefix than rank 0's.
    """

    def agree(n: int, k: int) -> bool:
        rows = np.zeros((channel.size, 2), np.int32)  # [rank, (memory, disk)]
        rows[channel.rank] = (n, k)
        got = np.array(channel._sum(mx.array(rows)))
        if got[channel.rank, 0] != got[0, 0]:
            raise Parted(
                f"rank {channel.rank}'s prompt cache reused {n} tokens where rank 0's reused "
                f"{got[0, 0]}; restart every rank"
            )
        agreed = bool((got[:, 1] == got[0, 1]).all())
        if not agreed and channel.rank == 0 and not said:
            said.append(True)  # once: the other ranks' own warnings are muted
            ranks = ", ".join(f"rank {r} {int(v)}" for r, v in enumerate(got[:, 1]))
            logging.getLogger("dflash_mlx.server").warning(
                "the ranks' prompt-cache folders restored different prefixes (%s tokens), so "
                "none is used; a rank whose folder cannot be written or lost its entries "
                "keeps the others from restoring (said once)",
                ranks,
            )
        return agreed

    said: list = []
    return agree


def follow_batches(channel: Channel, pool, make_batch) -> None:
    """Another rank's serving loop: replay rank 0's pool and batch calls until it quits.

    Args:
        channel: the group's ``Channel``. pool: this rank's ``PromptPool`` (rank 0's
            budget). make_batch: a new ``BatchGenerator``.

    Raises:
        Parted: this rank's pool reused another prefix than rank 0's.
    """
    gen, caches = make_batch(), {}
    if getattr(pool, "disk", None) is not None:
        pool.agree = agreement(channel)
    while True:
        for op, *args in channel.recv()["ops"]:
            if op == "take":
                ids, h, n = args
                caches[h] = pool.take(ids)
                if n is not None and len(caches[h].tokens) != n:  # None: agreed in take
                    raise Parted(
                        f"rank {channel.rank}'s prompt cache reused {len(caches[h].tokens)} "
                        f"tokens where rank 0's reused {n}; restart every rank"
                    )
            elif op == "give":
                pool.give(caches.pop(args[0]), args[1])
            elif op == "insert":
                ids, fields, h, recipes, *pics = args
                procs = [rebuilt(r, gen.tokenizer) for r in recipes]
                cache = None if h is None else caches[h]
                vision = vision_of(gen.model, ids, *pics) if pics else None
                gen.insert(ids, config_of(fields), cache=cache, processors=procs, images=vision)
            elif op == "remove":
                gen.remove(args[0])
            elif op == "step":
                gen.step()
            elif op == "reset":
                gen = make_batch()
            elif op == "quit":
                return


def lead_stream(channel: Channel, gen, on_break=None):
    """Rank 0: yield ``gen``'s responses, telling the other ranks after each one whether
    to go on (the consumer asked for the next) or stop (it broke off)."""
    try:
        for r in gen:
            try:
                yield r
            except GeneratorExit:  # the consumer broke off at a cycle boundary
                channel.send({"op": "stop"})
                raise
            channel.send({"op": "next"})
    except RuntimeError as e:  # MLX's ring: "connection to a peer was lost"
        if on_break is None:
            raise
        on_break(e)


def follow_stream(channel: Channel, gen) -> None:
    """Another rank: run ``gen`` in step with rank 0's ``lead_stream``."""
    try:
        for _ in gen:
            if channel.recv()["op"] == "stop":
                return
    finally:
        gen.close()
