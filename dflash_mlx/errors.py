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
