"""Which caches belong to recurrent layers (Gated DeltaNet): mlx-lm's ``ArraysCache``, and
another library's once its model is loaded (mlx-vlm's, ``vision/loader.py``). A snapshot
copies them; a rollback rewinds or replays them; they are never trimmed."""

from __future__ import annotations

from mlx_lm.models.cache import ArraysCache

_RECURRENT: list[type] = [ArraysCache]


def add_recurrent(cls: type) -> None:
    """Treat caches of ``cls`` as recurrent layers' (another library's ``ArraysCache``)."""
    if cls not in _RECURRENT:
        _RECURRENT.append(cls)


def recurrent(c) -> bool:
    """Whether ``c`` is a recurrent layer's cache (a list of states, not trimmable)."""
    return isinstance(c, tuple(_RECURRENT))
