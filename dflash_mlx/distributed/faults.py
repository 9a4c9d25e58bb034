"""Faults across ranks (docs/distributed.md): when a rank dies or hangs, every other rank
exits within a bounded time with one ``error:`` line naming it; nothing waits forever.

MLX's ring backend raises ``connection to a peer was lost`` in a survivor's collective
when a peer's process ends, but does not say which peer, and waits forever on a peer that
hangs (stopped, or its machine gone). So each rank also keeps a small TCP heartbeat to
rank 0 (a star; rank 0's port goes out over the group's own ``all_sum``): a closed
connection names a rank that exited, ``HANG_S`` seconds of silence one that hangs, and
rank 0 tells the others which rank it lost. The beats are sent by a daemon thread (MLX
releases the GIL while a collective waits), which also ends the rank when ``mlx.launch``,
its parent, goes away. Ending is ``os._exit``: the main thread may be stuck in a collective.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time

BEAT_S = 1.0  # seconds between heartbeats
HANG_S = 10.0  # seconds of silence after which a rank is declared hung
CONNECT_S = 30.0  # seconds the ranks get to reach rank 0's heartbeat port at start
GRACE_S = 2.0  # seconds a normal end of rank 0 gets before its silence is a fault
# seconds rank 0 may wait in a command's send: the others wait for commands, so more means
# they are stuck elsewhere (their collectives parted from rank 0's) though alive
STALL_S = 60.0


def leader_host() -> str:
    """Rank 0's address as ``mlx.launch``'s hostfile has it (ring: "ip:port" lists; JACCL:
    objects with "ips"); 127.0.0.1 without one (one machine, or MPI)."""
    path = os.environ.get("MLX_HOSTFILE")
    try:
        with open(path) as f:
            first = json.load(f)[0]
        entry = first.get("ips", [None])[0] if isinstance(first, dict) else first[0]
        return str(entry).rsplit(":", 1)[0] if ":" in str(entry) else str(entry)
    except (OSError, TypeError, ValueError, IndexError, KeyError, AttributeError):
        return "127.0.0.1"


def _say(line: str) -> None:
    """One line on the process's own stderr (fd 2: other ranks' ``sys.stderr`` is muted)."""
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass


class Watchdog:
    """The heartbeat of one rank and the end of every rank when one is lost.

    Args:
        rank, size: this rank and the group's size.
        on_fault: called with the message before the process ends (``dflash serve`` answers
            its clients 503 there); it must return within a few seconds.
    """

    def __init__(self, rank: int, size: int, on_fault=None):
        self.rank, self.size, self.on_fault = rank, size, on_fault
        self.done = threading.Event()  # a normal end: silence is no longer a fault
        self.peers: dict[int, socket.socket] = {}
        self.gone: set[int] = set()  # ranks that ended normally ("bye")
        self._gate, self._fired = threading.Lock(), False
        self._parent = os.getppid()
        self.channel = None  # rank 0's ``follow.Channel``: a send that never ends is a fault

    # -- start
    def lead(self, send) -> None:
        """Rank 0: listen, send the port with ``send``, wait for every other rank."""
        host = leader_host()
        try:
            srv = socket.create_server((host, 0))
        except OSError:
            srv = socket.create_server(("", 0))
        send(srv.getsockname()[1])
        srv.settimeout(CONNECT_S)
        try:
            while len(self.peers) < self.size - 1:
                conn, _ = srv.accept()
                conn.settimeout(CONNECT_S)
                k = int(conn.recv(64).split(b"\n")[0].split()[1])
                self.peers[k] = conn
        except (OSError, ValueError, IndexError):
            missing = sorted(set(range(1, self.size)) - set(self.peers))
            self.fail(f"rank {missing[0]} of {self.size} did not reach rank 0's heartbeat")
        finally:
            srv.close()
        self._start()

    def follow(self, port: int) -> None:
        """Another rank: connect to rank 0's heartbeat ``port``."""
        try:
            sock = socket.create_connection((leader_host(), port), timeout=CONNECT_S)
            sock.sendall(f"rank {self.rank}\n".encode())
        except OSError as e:
            self.fail(f"rank 0 of {self.size} cannot be reached for its heartbeat ({e})")
        self.peers[0] = sock
        self._start()

    def _start(self) -> None:
        for k, sock in self.peers.items():
            threading.Thread(target=self._read, args=(k, sock), daemon=True).start()
        threading.Thread(target=self._beat, name="dflash-heartbeat", daemon=True).start()

    # -- running
    def _beat(self) -> None:
        while not self.done.wait(BEAT_S):
            if os.getppid() != self._parent:
                self.fail(f"rank {self.rank}'s launcher (mlx.launch) went away")
            since = getattr(self.channel, "sending_since", None)
            if since is not None and time.monotonic() - since > STALL_S:
                self.fail(
                    f"rank 0 waited {STALL_S:g} s for the other ranks to take its next "
                    "command (they are alive but their collectives parted from rank 0's)"
                )
            for sock in list(self.peers.values()):
                try:
                    sock.sendall(b".\n")
                except OSError:
                    pass  # its reader names the rank

    def _read(self, k: int, sock: socket.socket) -> None:
        sock.settimeout(HANG_S)
        buf = b""
        while True:
            try:
                data = sock.recv(4096)
            except TimeoutError:
                return self.lost(k, f"stopped answering for {HANG_S:g} s")
            except OSError:
                data = b""
            if not data:
                return self.lost(k, "exited")
            buf += data
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if line.startswith(b"lost "):  # rank 0 lost another rank
                    self.fail(line[5:].decode(errors="replace"))
                elif line == b"bye":
                    self.gone.add(k)

    def lost(self, k: int, why: str) -> None:
        """Rank ``k`` exited or hangs: tell the others (rank 0) and end this rank."""
        if k in self.gone or self.done.wait(GRACE_S if k == 0 else 0):
            return  # it ended normally, or this rank is ending anyway
        msg = f"rank {k} of {self.size} {why}"
        for j, sock in list(self.peers.items()):
            if j != k:
                try:
                    sock.sendall(f"lost {msg}\n".encode())
                except OSError:
                    pass
        self.fail(msg)

    def broke(self, err: BaseException) -> None:
        """A collective of this rank's main thread failed: give the heartbeat a moment to
        name the rank, then end with what MLX said."""
        deadline = time.monotonic() + HANG_S + BEAT_S
        while time.monotonic() < deadline and not self._fired:
            time.sleep(0.05)
        self.fail(f"the link to another rank failed ({err})")

    def fail(self, msg: str) -> None:
        """End this rank with ``error: msg`` (once; other threads that fail wait for it)."""
        with self._gate:
            if self._fired:
                while True:
                    time.sleep(1)
            self._fired = True
        if self.on_fault is not None:
            try:
                self.on_fault(msg)
            except Exception as e:  # noqa: BLE001 - ending is what matters now
                _say(f"note: answering the clients failed ({e})")
        try:  # rank 0's answer may have stopped mid-line on stdout
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        start = "\n" if self.rank == 0 and self.on_fault is None else ""
        _say(f"{start}error: {msg}; every rank stops (rank {self.rank} now)")
        os._exit(1)

    def close(self) -> None:
        """A normal end: stop beating and tell the others this is no fault."""
        self.done.set()
        for sock in list(self.peers.values()):
            try:
                sock.sendall(b"bye\n")
                sock.close()
            except OSError:
                pass


def watch(channel, on_fault=None) -> Watchdog:
    """Start this rank's heartbeat (every rank calls it, at the same point).

    Args:
        channel: the group's ``follow.Channel`` (rank 0's port goes out over it).
        on_fault: as for ``Watchdog``.
    """
    dog = Watchdog(channel.rank, channel.size, on_fault)
    dog.channel = channel
    if channel.rank == 0:
        dog.lead(lambda port: channel.send({"heartbeat": port}))
    else:
        dog.follow(int(channel.recv()["heartbeat"]))
    return dog
