"""The pixels decoded at once across every request of this process (``PixelBudget``): a
4096 x 4096 image is 50 MB as RGB and about twice that while Pillow converts it, so a
server that decoded every request's images as they arrived would grow by gigabytes under
load (docs/server.md "Images").
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading
from contextlib import contextmanager

from .images import MAX_DECODED, ImageError

BYTES_PER_PIXEL = 8  # RGB, and the converting copy beside it


class PixelBudget:
    """The pixels decoded at once across every request of this process: a request's images
    are decoded only when their pixels fit beside the ones being decoded, and counted back
    when the processor is done with them.

    Args:
        pixels: the budget (a request needing more alone is refused). wait: seconds a
            request waits for room before it is refused as busy.
    """

    def __init__(self, pixels: int = MAX_DECODED, wait: float = 60.0):
        self.pixels, self.wait, self.used = pixels, wait, 0
        self._cond = threading.Condition()

    @contextmanager
    def hold(self, pixels: int):
        """Count ``pixels`` in flight while the block runs.

        Raises:
            ImageError: over the budget alone (``too_large``), no room in time (``busy``).
        """
        if pixels > self.pixels:
            raise ImageError(
                f"the images have {pixels:,} pixels together; at most {self.pixels:,} are "
                "decoded at once (send fewer or smaller images)",
                "too_large",
            )
        with self._cond:
            if not self._cond.wait_for(lambda: self.used + pixels <= self.pixels, self.wait):
                raise ImageError("too many images are being decoded; retry later", "busy")
            self.used += pixels
        try:
            yield
        finally:
            with self._cond:
                self.used -= pixels
                idle = self.used == 0
                self._cond.notify_all()
            if idle:
                give_back()


def give_back() -> None:
    """Hand freed heap memory back to the system (glibc's ``malloc_trim``; elsewhere
    nothing): after a first large free glibc raises its mmap threshold, so later decode
    buffers come from the heap and stay resident once freed (0.35 GB kept after 8 images
    of 2048 x 2048 on a tiny VLM server, 0.17 GB with this)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc; musl has none
    except (OSError, AttributeError):
        return None


DECODING = PixelBudget()  # the Python API's; a server makes its own from its limits


def share_of(max_memory_gb: float | None, limits) -> int | None:
    """``ImageLimits.max_decoded`` inside ``--max-memory``: a tenth of it at
    ``BYTES_PER_PIXEL``, never under one image at ``max_pixels`` nor over the default
    (``limits.decoded``); None without ``--max-memory`` (the default)."""
    if max_memory_gb is None:
        return None
    share = int(max_memory_gb * 1e9 / 10 / BYTES_PER_PIXEL)
    return max(limits.max_pixels, min(share, limits.decoded))
