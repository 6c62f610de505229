"""Public attributes that cannot be assigned by mistake.

A class deriving from ``Sealed`` calls ``self._freeze()`` at the end of its
constructor; from then on assigning a public attribute raises AttributeError
saying why it is fixed and what to do instead, instead of being accepted and
silently ignored by the object's own code. Private attributes stay settable.
"""

from __future__ import annotations

from typing import Any, ClassVar

from ._errors import ReadOnlyAttributeError


class Sealed:
    _READ_ONLY: ClassVar[dict[str, str]] = {}
    """name -> why it is fixed and what to do instead."""
    _FIXED: ClassVar[str] = "it is fixed at construction; make a new object to change it"

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or "_sealed" not in self.__dict__:  # private, or constructing
            object.__setattr__(self, name, value)
            return
        why = self._READ_ONLY.get(name, self._FIXED)
        raise ReadOnlyAttributeError(f"{type(self).__name__}.{name} is read-only: {why}")

    def __delattr__(self, name: str) -> None:
        if name.startswith("_"):
            object.__delattr__(self, name)
            return
        raise ReadOnlyAttributeError(f"{type(self).__name__}.{name} cannot be deleted: {self._FIXED}")

    def _freeze(self) -> None:
        object.__setattr__(self, "_sealed", True)
