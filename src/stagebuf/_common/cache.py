"""``BoundedCache``: every cache of views, layouts and checked values in stagebuf, one size rule."""

from __future__ import annotations

from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


class BoundedCache(dict[K, V]):
    """A dict of at most ``cap`` entries: ``put`` (on a miss) empties it first when it is full. Hits read it
    as a plain dict (``cache.get(key)``, ``key in cache``), at C speed; the caches hold views and layouts an
    engine reuses every step, so a full one means the keys changed and emptying it loses little."""

    __slots__ = ("cap",)

    def __init__(self, cap: int):
        super().__init__()
        self.cap = cap

    def put(self, key: K, value: V) -> V:
        """``self[key] = value`` (after emptying a full cache); ``value``."""
        if len(self) >= self.cap:
            self.clear()
        self[key] = value
        return value
