"""An instance wrapper around an mlx-lm module: the adapter's taps and recorders, the CPU
backend's compiled layers and the verify's chunked attention wrap *instances* with it, so
nothing in mlx-lm is patched. No other import of the package."""

from mlx import nn


class Wrapper(nn.Module):
    """An instance wrapper that forwards unknown attributes (e.g. ``is_linear``) inward.

    Non-parameter state is kept out of the module tree with ``object.__setattr__``.

    Args:
        inner: the wrapped module.
    """

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "inner" or "inner" not in self:
                raise
            return getattr(self["inner"], name)
