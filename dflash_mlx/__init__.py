"""dflash-mlx: DFlash 2 block-parallel speculative decoding on MLX.

``from dflash_mlx import load, generate, stream_generate, batch_generate, GenerationConfig``.
Heavy imports are deferred so that ``dflash --help`` stays instant; the system OpenBLAS (Linux) is loaded
here, before any module of the package imports MLX (see ``cpu/blas.py``).
"""

from . import cpu

cpu.preload()

__version__ = "0.1.0"
__all__ = [
    "BatchGenerator",
    "DFlashError",
    "GenerationConfig",
    "GenerationResponse",
    "__version__",
    "batch_generate",
    "generate",
    "load",
    "stream_generate",
]


def __getattr__(name):
    if name == "load":
        from .loading.loader import load

        return load
    if name in ("generate", "stream_generate", "GenerationResponse"):
        from . import generation

        return getattr(generation, name)
    if name in ("batch_generate", "BatchGenerator"):
        from . import batching

        return getattr(batching, name)
    if name == "GenerationConfig":
        from .settings import GenerationConfig

        return GenerationConfig
    if name == "DFlashError":
        from .errors import DFlashError

        return DFlashError
    raise AttributeError(f"module 'dflash_mlx' has no attribute {name!r}")
