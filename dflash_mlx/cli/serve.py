"""``dflash serve`` (also ``python -m dflash_mlx.server``): the OpenAI-compatible server."""

from __future__ import annotations

import sys
from dataclasses import replace

import typer

from ..errors import DFlashError
from ..settings import SHUTDOWN_GRACE, GenerationConfig, ServerConfig
from ..vision.budget import share_of
from ..vision.images import MAX_BYTES as MAX_IMAGE_BYTES
from ..vision.images import MAX_IMAGES as MAX_IMAGE_COUNT
from ..vision.images import MAX_PIXELS as MAX_IMAGE_PIXELS
from ..vision.images import ImageLimits
from . import common as c
from .options import MODEL, ModelOptions, decoding, expand

# the decoding options, with this command's defaults
SETTINGS = decoding("serve", "Default max tokens.")
CACHE_GB = typer.Option(
    None,
    "--prompt-cache-gb",
    help="Memory for prompt caches kept across requests, in GB (default: a quarter of what "
    "the memory budget leaves beside the weights; 0: off).",
)
CACHE_DIR = typer.Option(
    None,
    "--prompt-cache-dir",
    help="Keep prompt caches evicted from memory in this folder (safetensors); restore them.",
)

ALLOW_ORIGIN = typer.Option(
    None,
    "--allow-origin",
    help="Let web pages of this origin (scheme://host[:port], or '*') call the server; "
    "repeatable. Other pages' requests get 403.",
)
API_KEY = typer.Option(
    None,
    "--api-key",
    help="Require 'Authorization: Bearer KEY' (also DFLASH_API_KEY).",
    envvar="DFLASH_API_KEY",
)
MAX_BATCH = typer.Option(
    8, "--max-batch", help="Requests decoded together (1: one at a time; a VLM's always)."
)
ALLOW_URLS = typer.Option(
    False,
    "--allow-image-urls",
    help="Fetch http(s) image URLs that requests send (off: data: URLs and base64 only).",
)
MAX_PIXELS = typer.Option(
    MAX_IMAGE_PIXELS, "--max-image-pixels", help="Width x height of one image, at most."
)
MAX_BYTES = typer.Option(MAX_IMAGE_BYTES, "--max-image-bytes", help="Bytes of one image file.")
MAX_IMAGES = typer.Option(MAX_IMAGE_COUNT, "--max-images", help="Images in one request.")
SHUTDOWN = typer.Option(
    SHUTDOWN_GRACE,
    "--shutdown-grace",
    help="Seconds running requests get to finish after SIGTERM or Ctrl-C; the rest get 503.",
)


@expand()
def serve(
    src: ModelOptions = MODEL,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind."),
    port: int = typer.Option(8080, "--port", help="Port to listen on (0: a free one)."),
    api_key: str | None = API_KEY,
    max_queue: int = typer.Option(16, "--max-queue", help="Waiting requests before 503."),
    max_batch: int = MAX_BATCH,
    prompt_cache_gb: float | None = CACHE_GB,
    prompt_cache_dir: str | None = CACHE_DIR,
    allow_origin: list[str] | None = ALLOW_ORIGIN,
    shutdown_grace: float = SHUTDOWN,
    allow_image_urls: bool = ALLOW_URLS,
    max_image_pixels: int = MAX_PIXELS,
    max_image_bytes: int = MAX_BYTES,
    max_images: int = MAX_IMAGES,
    cfg: GenerationConfig = SETTINGS,
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Print the loaded paths."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No download notices."),
):
    """Serve the OpenAI and Anthropic APIs; the decoding options are the defaults of
    requests that do not set them."""
    check_server_options(port, api_key, max_queue, max_batch, prompt_cache_gb, prompt_cache_dir)
    images = ImageLimits(max_image_pixels, max_image_bytes, max_images).validate(flags=True)
    images = replace(images, max_decoded=share_of(src.max_memory, images))  # inside it
    config = ServerConfig(tuple(allow_origin or ()), shutdown_grace, allow_image_urls, images)
    config = config.validate(flags=True)
    from .. import distributed, server

    group = distributed.group()
    if cfg.kv_bits is not None and max_batch > 1:
        raise DFlashError("--kv-bits needs --max-batch 1 (batched requests share one cache)")
    sock = _listen(host, port, api_key, group)
    m, tok, prompt_cache_gb, cfg = _load(src, quiet, verbose, cfg, prompt_cache_gb, sock)
    ranks = _across_ranks(group, m, tok, prompt_cache_dir)
    if ranks is None:
        return  # another rank than 0: it followed rank 0 to its end
    lockstep, prompt_cache_dir = ranks
    server.run_server(
        m,
        tok,
        m.name,
        host=host,
        port=port,
        api_key=api_key,
        defaults=cfg,
        max_queue=max_queue,
        sock=sock,
        max_batch=max_batch,
        cache_gb=prompt_cache_gb,
        cache_dir=prompt_cache_dir,
        config=config,
        lockstep=lockstep,
    )


def _listen(host: str, port: int, api_key: str | None, group):
    """The listening socket (a busy port or a bad host fails before the load), with the
    warning of an open address; None on ranks other than 0 (only rank 0 serves HTTP)."""
    from .. import server

    if group is not None and group.rank() != 0:
        return None
    sock = server.listen(host, port)
    warning = server.bind_warning(host, api_key)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    return sock


def _across_ranks(group, m, tok, cache_dir: str | None):
    """(rank 0's ``follow.Lead`` or None in one process, the disk tier's folder); None on
    the other ranks, once they have followed rank 0 to its end. Under ``mlx.launch`` each
    rank keeps its own disk tier, in ``cache_dir/rank<N>`` (docs/distributed.md)."""
    if group is None:
        return None, cache_dir
    from ..distributed import follow

    channel, dog = follow.start(group)
    if cache_dir is not None:
        cache_dir = f"{cache_dir.rstrip('/')}/rank{group.rank()}"
    if group.rank() != 0:
        follow_server(channel, dog, m, tok, cache_dir)
        return None
    return follow.Lead(channel, dog), cache_dir


def _load(src, quiet: bool, verbose: bool, cfg: GenerationConfig, cache_gb, sock=None):
    """(model, tokenizer, the prompt caches' GB inside the memory budget, the default
    settings) for ``serve``. ``auto``'s cost tables are measured now, not under the first
    request's lock (a batch's planner starts from them too: ``batching._planner``). A load
    that fails closes ``sock`` (the listening socket, if any)."""
    from ..server.prompt_cache import pool_gb

    try:
        m, tok = c.load_pair(src, quiet, verbose, cfg, sharded=True)
        if cfg.block_size == "auto":
            from ..distributed.policy import ensure

            ensure(m, m.group)  # under mlx.launch on every rank, rank 0's tables
        return m, tok, pool_gb(m, cache_gb, src.max_memory), cfg
    except BaseException:
        if sock is not None:
            sock.close()
        raise


def follow_server(channel, dog, m, tok, cache_dir: str | None) -> None:
    """A rank other than 0 under ``dflash serve``: build the pool and batch rank 0 chose
    and repeat its calls until it stops (its Ctrl-C or SIGTERM is sent as a quit)."""
    import signal

    from ..distributed import follow
    from ..server.prompt_cache import PromptPool
    from ..server.prompt_cache_disk import DiskTier
    from ..server.worker import batch_generator

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches rank 0 too
    hello = channel.recv()
    disk = None if cache_dir is None else DiskTier.open(cache_dir, m)
    pool = PromptPool(m, hello["cache_bytes"], disk)
    try:
        follow.follow_batches(channel, pool, lambda: batch_generator(m, tok, hello["max_batch"]))
    except RuntimeError as e:  # MLX's ring: a peer's connection was lost
        dog.broke(e)
    except Exception as e:  # noqa: BLE001 - this rank's stderr is muted: the watchdog says it
        dog.fail(f"rank {channel.rank} failed: {type(e).__name__}: {e}")
    pool.close()


def check_server_options(
    port: int,
    api_key: str | None,
    max_queue: int,
    max_batch: int,
    cache_gb: float | None = None,
    cache_dir: str | None = None,
):
    """Refuse, before anything is bound or loaded, options the server cannot run with.

    Args:
        port, api_key, max_queue, max_batch, cache_gb, cache_dir: ``--port``,
            ``--api-key``, ``--max-queue``, ``--max-batch``, ``--prompt-cache-gb``,
            ``--prompt-cache-dir``.

    Raises:
        DFlashError: one line naming the option and the fix.
    """
    if not 0 <= port < 65536:
        raise DFlashError(f"--port must be in 0..65535 (got {port}); 0 picks a free port")
    if api_key is not None and not (api_key.isascii() and api_key.isprintable()):
        raise DFlashError(
            "--api-key must be printable ASCII (clients send it in an HTTP header); "
            "pick a key of letters, digits and punctuation"
        )
    if api_key is not None and (not api_key.strip() or api_key != api_key.strip()):
        raise DFlashError(
            "--api-key is empty or starts or ends with spaces, which clients cannot send; "
            "pick another key (or drop --api-key for no key)"
        )
    if max_queue < 1:
        raise DFlashError(f"--max-queue must be at least 1 (got {max_queue})")
    if max_batch < 1:
        raise DFlashError(f"--max-batch must be at least 1 (got {max_batch})")
    from ..server.prompt_cache import check_gb
    from ..server.prompt_cache_disk import check_dir

    check_gb(cache_gb)
    check_dir(cache_dir)
