"""The serving loop of ``dflash serve``: bind the HTTP server, answer requests in threads,
run generations in the calling thread.

Up to ``max_batch`` generations decode together (continuous batching, ``worker.Engine``);
more requests wait in a bounded FIFO queue (503 when full). Prompt
caches are kept across requests in a pool keyed by their tokens (``prompt_cache.PromptPool``),
so a chat history or an agent's system prompt re-sent each turn prefills only its new part. All MLX work runs in the thread that calls ``run_server`` (the main thread): MLX
streams belong to the thread that makes them, and the decode loop makes its stream on first
use there (``decode.generation_stream``).

Start it with ``dflash serve`` (or ``python -m dflash_mlx.server``, the same command).
"""

from __future__ import annotations

import logging
import socket
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

from .. import generation
from ..decoding.prompt import context_length
from ..errors import ContextLengthError, DFlashError
from ..settings import GenerationConfig, ServerConfig
from ..vision.budget import PixelBudget
from ..vision.images import ImageError, ImageLimits
from .access import Access
from .connection import body_limit
from .http import Handler
from .images import Gather, api_error
from .prompt_cache import GB, check_gb
from .prompt_cache_disk import DiskTier
from .schema import DEFAULTS, bad, now
from .shutdown import InFlight, serve
from .worker import Engine

logger = logging.getLogger("dflash_mlx.server")

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def bind_warning(host: str, api_key: str | None) -> str | None:
    """The warning printed when the server listens beyond loopback with no key."""
    if host in LOOPBACK or host.startswith("127.") or api_key:
        return None
    return (
        f"warning: binding {host} without --api-key: anyone who can reach this machine "
        "can use the model; pass --api-key KEY (or bind to 127.0.0.1)"
    )


def backlog(max_queue: int, max_batch: int = 8) -> int:
    """Connections the kernel holds for the server before it accepts them: twice what may
    wait or run, at least 128. A burst past the stdlib's 5 got resets, not answers; past
    this a client still gets its 503."""
    return max(128, 2 * (max(1, max_queue) + max(1, max_batch)))


class DFlashHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer holding the engine and the serving options."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = backlog(16)  # ``listen``'s; ``make_server`` sizes it to the queue

    def __init__(
        self,
        sock: socket.socket,
        engine: Engine,
        model_name: str,
        api_key: str | None,
        defaults: GenerationConfig | None,
        host: str = "127.0.0.1",
        config: ServerConfig | None = None,
    ):
        super().__init__(sock.getsockname()[:2], Handler, bind_and_activate=False)
        self.socket.close()  # the unbound one made above; serve the socket ``listen`` bound
        self.socket, self.server_address = sock, sock.getsockname()
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]
        self.engine, self.model_name, self.api_key = engine, model_name, api_key
        self.defaults = defaults or DEFAULTS
        self.config = (config or ServerConfig()).validate()
        self.images = (self.config.image_limits or ImageLimits()).validate()
        self.max_body = body_limit(self.images)
        self.decoding = PixelBudget(self.images.decoded)  # pixels decoded at once, all requests
        self.access = Access(host, self.server_port, self.config.allow_origins)
        self.created = now()
        self.context = context_length(engine.model)
        model = engine.model
        names = {model_name, Path(str(model_name)).name, "default_model"}
        for p in (getattr(model, "target_path", ""),):
            if p:
                names |= {str(p), Path(str(p)).name}
        self.names = {n.lower() for n in names if n}
        self._tok_lock = threading.Lock()
        self.inflight = InFlight()  # requests being answered, waited for at a stop

    def gather(self, param: str) -> Gather:
        """A request's image collector under this server's limits and URL policy.

        Args:
            param: the request field holding the messages (OpenAI's error ``param``).
        """
        return Gather(self.images, self.config.allow_image_urls, param)

    def _image_ids(self, req) -> list[int]:
        """The ids of a prompt with images (each expanded to its rows by the engine's entry,
        which refuses a text-only model), rendered with the request's tools and template
        variables as a text prompt is; ``req.vision`` keeps the prepared prompt, which the
        engine decodes as it is (the processor runs once) and whose keys (an image's rows
        by its hash) the prompt pool matches."""
        model = self.engine.model
        kw = {"tools": req.template_tools, "template_kwargs": req.template_kwargs}
        kw["budget"] = self.decoding
        with model.lock:  # the tokenizer and processor are shared with the worker
            ids, _, req.vision = generation.request_ids(
                model, self.engine.tokenizer, req.prompt, req.gen, images=req.images, **kw
            )
        return ids

    def knows(self, name: str) -> bool:
        """Whether ``name`` is the served model (its name or its directory, any case)."""
        return name.lower() in self.names

    def tokenize(self, req) -> list[int]:
        """Prompt ids: chat messages through the chat template, completions raw."""
        tok = self.engine.tokenizer
        field = "messages" if req.kind == "chat" else "prompt"
        try:
            if req.images:
                ids = self._image_ids(req)
            else:
                with self._tok_lock:
                    ids = generation.encode_prompt(
                        tok,
                        req.prompt,
                        raw=req.kind == "completion",
                        context=self.context,
                        tools=req.template_tools,
                        template_kwargs=getattr(req, "template_kwargs", None),
                    )
        except ImageError as e:  # a text-only model (no_vision), parts that do not match
            raise api_error(e, param=field) from None
        except ContextLengthError as e:
            raise bad(str(e), field, "context_length_exceeded") from None
        except DFlashError as e:
            raise bad(str(e), field) from None
        except generation.template_errors() as e:  # e.g. a template refusing the roles' order
            raise bad(
                f"cannot apply the chat template: {str(e).splitlines()[0] if str(e) else e}",
                "messages",
            ) from None
        vocab = self.engine.model.adapter.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise bad(f"token ids must be in [0, {vocab})", "prompt")
        return ids


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port and listening; ``dflash serve`` calls it before loading
    the model, so a busy port or an unknown host is reported at once.

    Args:
        host: a name or an address. port: 0..65535 (0 picks a free one).

    Raises:
        DFlashError: the host cannot be resolved or the address cannot be bound.
    """
    sock = None
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, addr = info[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(DFlashHTTPServer.request_queue_size)
        return sock
    except (OSError, UnicodeError, ValueError, OverflowError) as e:  # idna, NUL, port range
        if sock is not None:
            sock.close()
        reason = getattr(e, "strerror", None) or str(e) or type(e).__name__
        raise DFlashError(
            f"cannot listen on {host}:{port} ({reason}); pick another --port or --host"
        ) from None


def make_server(
    model,
    tokenizer,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8080,
    api_key: str | None = None,
    defaults: GenerationConfig | None = None,
    max_queue: int = 16,
    sock: socket.socket | None = None,
    max_batch: int = 8,
    cache_gb: float | None = None,
    cache_dir: str | None = None,
    config: ServerConfig | None = None,
    lockstep=None,
) -> DFlashHTTPServer:
    """Bind the HTTP server; ``run_server`` serves it.

    Args:
        model, tokenizer, model_name, host, api_key, defaults, max_queue, max_batch,
            cache_gb, cache_dir, config, lockstep: as for ``run_server``. port: 0 picks a
            free one. sock: a socket from ``listen`` (host and port are then only names).

    Raises:
        DFlashError: the address cannot be resolved or bound.
    """
    sock = sock or listen(host, port)
    try:
        sock.listen(backlog(max_queue, max_batch))  # a listening socket takes a new backlog
        cache_bytes = None if cache_gb is None else int(check_gb(cache_gb) * GB)
        disk = None if cache_dir is None else DiskTier.open(cache_dir, model)
        engine = Engine(model, tokenizer, max_queue, max_batch, cache_bytes, disk, lockstep)
        return DFlashHTTPServer(sock, engine, model_name, api_key, defaults, host, config)
    except BaseException:
        sock.close()
        raise


def banner(httpd: DFlashHTTPServer) -> str:
    """The line ``run_server`` prints once it listens."""
    h, p = httpd.server_address[:2]
    shown = f"[{h}]" if ":" in str(h) else h
    eng = httpd.engine
    return (
        f"dflash serve: '{httpd.model_name}' listening on http://{shown}:{p}/v1 "
        f"(batch {eng.max_batch}, queue {eng.jobs.maxsize}, "
        f"prompt cache {eng.pool.max_bytes / GB:.3g} GB{' + disk' if eng.pool.disk else ''}, "
        f"api key {'on' if httpd.api_key else 'off'})"
    )


def run_server(
    model,
    tokenizer,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8080,
    api_key: str | None = None,
    defaults: GenerationConfig | None = None,
    max_queue: int = 16,
    sock: socket.socket | None = None,
    max_batch: int = 8,
    cache_gb: float | None = None,
    cache_dir: str | None = None,
    config: ServerConfig | None = None,
    lockstep=None,
) -> None:
    """Serve the OpenAI-compatible API until SIGTERM or Ctrl-C, then stop in order
    (``shutdown``: running requests get ``config.shutdown_grace`` seconds); blocking.

    Call it from the main thread: generation runs in the calling thread, HTTP in others.
    The caller warns about a non-loopback host without a key (see ``bind_warning``).

    Args:
        model, tokenizer: from ``dflash_mlx.load``. model_name: the id clients ask for.
        host, port: where to listen (loopback by default). api_key: require
            'Authorization: Bearer <key>' on /v1/*. defaults: the decoding settings that
            requests override (default ``schema.DEFAULTS``). max_queue: requests that may
            wait for a row (503 past it). sock: already bound (``listen``), else bound here.
            max_batch: requests decoded together (1: one at a time; a VLM's always).
            cache_gb: the prompt caches' memory budget in GB (None: a quarter of what the
            device budget leaves beside the weights; 0: off). cache_dir: a folder keeping
            evicted prompt caches as safetensors (None: none). config: the origins web
            pages may call from and the shutdown grace (``settings.ServerConfig``).
            lockstep: under ``mlx.launch``, rank 0's ``distributed.follow.Lead`` (the other
            ranks run ``cli.serve``'s follower).
    """
    opts = (host, port, api_key, defaults, max_queue, sock, max_batch, cache_gb, cache_dir)
    opts += (config, lockstep)
    httpd = make_server(model, tokenizer, model_name, *opts)
    print(banner(httpd), flush=True)
    serve(httpd)
