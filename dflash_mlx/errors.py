"""Errors with one-line messages meant for people: what is wrong and how to fix it."""


class DFlashError(ValueError):
    """A user-facing error. ``str(err)`` is a single line naming the problem and the fix."""


class IncompatibleDrafterError(DFlashError):
    """The drafter checkpoint does not fit the target model."""


class UnsupportedModelError(DFlashError):
    """The target architecture cannot be served by the speculative decoder."""


class ContextLengthError(DFlashError):
    """The prompt does not fit in the model's context (the server answers 400 with the code
    ``context_length_exceeded``)."""


# What mlx / mlx-lm / mlx-vlm raise on a corrupt, incomplete or unsupported checkpoint.
LOAD_ERRORS = (ValueError, RuntimeError, OSError, KeyError, TypeError, AttributeError)


def load_failed(exc: BaseException, what: str, library: str) -> DFlashError:
    """The one line for a checkpoint a loader could not read.

    Args:
        exc: what the loader raised (one of ``LOAD_ERRORS``). what: the model and where it
            is, e.g. "model M from PATH". library: the loader, "mlx-lm" or "mlx-vlm".
    """
    reason = (str(exc).splitlines() or [type(exc).__name__])[0][:160]
    return DFlashError(
        f"cannot load {what} ({type(exc).__name__}: {reason}); "
        f"re-download it or check that {library} supports this model"
    )
