"""How ``dflash serve`` stops. The first SIGTERM or Ctrl-C refuses new requests (503), answers
the queued ones 503 and gives the running ones ``--shutdown-grace`` seconds to finish; then
they are ended explicitly (a whole request: 503 in its API's shape; a stream: its API's error
event), never passed off as finished. A second signal ends them at once.

The signal handler only sets events and writes a line to stderr: a watcher thread does the
rest (a handler runs between two bytecodes of the worker, which may hold any lock)."""

from __future__ import annotations

import os
import signal
import threading
import time

SETTLE = 2.0  # seconds the answers' threads get to write their last bytes after the worker


class InFlight:
    """Counts the requests being answered; ``wait`` for them to end (bounded)."""

    def __init__(self):
        self.n, self.cond = 0, threading.Condition()

    def __enter__(self):
        with self.cond:
            self.n += 1

    def __exit__(self, *exc):
        with self.cond:
            self.n -= 1
            self.cond.notify_all()

    def wait(self, seconds: float) -> bool:
        """Whether every request ended within ``seconds``."""
        with self.cond:
            return self.cond.wait_for(lambda: self.n <= 0, seconds)


class Stopper:
    """The signals' handler and the watcher that stops the engine in order.

    Args:
        engine: the server's ``worker.Engine``. grace: seconds running requests may finish.
    """

    def __init__(self, engine, grace: float):
        self.engine, self.grace = engine, grace
        self.asked, self.now = threading.Event(), threading.Event()
        self.signals, self.old = 0, {}
        self.watcher = threading.Thread(target=self._watch, name="dflash-stop", daemon=True)

    def install(self) -> None:
        """Take SIGTERM and SIGINT (from the main thread only; an ignored SIGINT stays so)."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self.old[sig] = signal.signal(sig, self._on_signal)
        self.watcher.start()

    def restore(self) -> None:
        """Give the signals back their handlers and end the watcher."""
        for sig, old in self.old.items():
            signal.signal(sig, old)
        self.asked.set()

    def _on_signal(self, signum, frame) -> None:
        self.signals += 1
        if self.signals == 1:
            line = (
                f"dflash serve: stopping; running requests get {self.grace:g} s to finish "
                "(signal again to end them now)\n"
            )
        elif self.signals == 2:
            line = "dflash serve: stopping now; running requests end with 503\n"
            self.now.set()
        else:
            raise KeyboardInterrupt
        os.write(2, line.encode())
        self.asked.set()

    def _watch(self) -> None:
        self.asked.wait()
        if self.engine.finished.is_set():
            return
        self.engine.close()
        deadline = time.monotonic() + self.grace
        while not self.engine.finished.is_set():
            left = deadline - time.monotonic()
            if left <= 0 or self.now.wait(min(left, 0.05)):
                self.engine.stop()  # the rest end at their next cycle, with a 503
                return


def serve(httpd) -> None:
    """Serve until a signal (or ``KeyboardInterrupt``) and stop in order; blocking. The
    generation runs in the calling thread, the HTTP server in another.

    Args:
        httpd: an ``app.DFlashHTTPServer``.
    """
    engine = httpd.engine
    stopper = Stopper(engine, httpd.config.shutdown_grace)
    stopper.install()
    web = threading.Thread(target=httpd.serve_forever, name="dflash-http", daemon=True)
    web.start()
    try:
        engine.run()
    except KeyboardInterrupt:
        pass
    finally:
        stopper.restore()
        engine.stop()
        engine.close()
        httpd.inflight.wait(SETTLE)  # the ended requests' answers reach their clients
        httpd.shutdown()
        httpd.server_close()
        if not stopper.now.is_set():  # a second signal does not wait for the disk
            engine.pool.close()  # the prompt caches in memory go to --prompt-cache-dir
