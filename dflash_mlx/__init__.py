"""dflash-mlx: DFlash 2 block-parallel speculative decoding on MLX.

``from dflash_mlx import load, generate, stream_generate, batch_generate, GenerationConfig``.
Heavy imports are deferred so that ``dflash --help`` stays instant; the system OpenBLAS (Linux) is loaded
here, before any module of the package imports MLX (see ``blas.py``).
"""

from .blas import load_system_blas

load_system_blas()

__version__ = "0.1.0"
__all__ = [
    "load",
    "generate",
    "stream_generate",
    "batch_generate",
    "BatchGenerator",
    "GenerationConfig",
    "GenerationResponse",
    "DFlashError",
    "__version__",
]


def __getattr__(name):
    if name == "load":
        from .loading import load

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
