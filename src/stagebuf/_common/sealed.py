"""One sealing mechanism for every public object: attributes that cannot be assigned by mistake.

A ``Sealed`` subclass calls ``self._freeze()`` at the end of its constructor. Then assigning a name in its
``_COPY_IN`` (``np``/``cpu``) copies the value in through ``_copy_in``, checked; assigning or deleting any
other public attribute raises ReadOnlyAttributeError with the reason its class gives in ``@read_only``.
Reading a missing attribute raises UnknownAttributeError on Python 3.12+ (see docs/DESIGN.md).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, ClassVar, Generic, TypeVar

from .errors import NotCopyableError, ReadOnlyAttributeError, UnknownAttributeError

COPY_HINT = "write its values through .np or .cpu"
"""The end of a host-backed object's read-only messages."""

_WHY: dict[type, dict[str, str]] = {}
"""Per class: attribute -> why it is fixed and what to do instead ("*": any other attribute)."""

_T = TypeVar("_T", bound=type)


def read_only(why: dict[str, str]) -> Callable[[_T], _T]:
    """Class decorator: record the class's read-only messages in ``_WHY``."""

    def mark(cls: _T) -> _T:
        _WHY[cls] = why
        return cls

    return mark


_V = TypeVar("_V")


class Cell(Generic[_V]):
    """A value a sealed object changes on a hot path (``cell.value = x``: no ``__setattr__`` hook runs)."""

    __slots__ = ("value",)

    def __init__(self, value: _V):
        self.value = value


class Sealed:
    """Base of every public object with attributes: see the module docstring."""

    _COPY_IN: ClassVar[tuple[str, ...]] = ()
    """Attributes whose assignment copies into host memory (``_copy_in``) instead of rebinding."""
    _sealed = False
    """Set by ``_freeze()``. Read as an attribute: reading ``self.__dict__`` materialises the instance dict,
    which slowed ``stage_write`` from 155 to 191 ns a call (CPU machine, CPython 3.11, timeit of 256)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or not self._sealed:  # private, or constructing
            object.__setattr__(self, name, value)
        elif name in self._COPY_IN:
            self._copy_in(name, value)
        else:
            raise ReadOnlyAttributeError(f"{type(self).__name__}.{name} is read-only: {self._why(name)}")

    def __delattr__(self, name: str) -> None:
        if name.startswith("_"):
            object.__delattr__(self, name)
            return
        raise ReadOnlyAttributeError(f"{type(self).__name__}.{name} cannot be deleted: {self._why('*')}")

    if sys.version_info >= (3, 12):
        # Only from 3.12: on 3.10 and 3.11 the hook would slow every attribute read (docs/DESIGN.md).
        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)  # protocol probes (copy, pickle, numpy) expect the plain error
            if name.startswith("_"):
                raise UnknownAttributeError(f"{type(self).__name__} has no attribute {name!r}")
            public = sorted(n for n in dir(type(self)) if not n.startswith("_"))
            public += sorted(n for n in self.__dict__ if not n.startswith("_") and n not in public)
            hint = self._missing_hint(name)
            raise UnknownAttributeError(
                f"{type(self).__name__} has no attribute {name!r}"
                + (f"; {hint}" if hint else "")
                + f". Its attributes: {', '.join(public)}"
            )

    _COPYABLE: ClassVar[bool] = False
    """Whether copies and pickles are allowed (values with no buffers: ``Tier``, ``Capabilities``)."""

    def __copy__(self) -> Any:
        if self._COPYABLE:
            return self
        raise self._not_copyable("copy.copy")

    def __deepcopy__(self, memo: Any) -> Any:
        if self._COPYABLE:
            return self
        raise self._not_copyable("copy.deepcopy")

    def __reduce_ex__(self, protocol: Any) -> Any:
        if self._COPYABLE:
            return super().__reduce_ex__(protocol)
        raise self._not_copyable("pickling")

    def _not_copyable(self, what: str) -> NotCopyableError:
        name = type(self).__name__
        return NotCopyableError(
            f"{what} of a {name} is refused: it owns staging slots and device memory, which a copy would "
            f"share or lose (its values would read back as zeros). Make a new {name} with the same "
            "arguments instead, and stage the values into it; in another process, make it there"
        )

    def _missing_hint(self, name: str) -> str | None:
        """What to write instead of reading the missing attribute ``name`` (None: nothing to say)."""
        return None

    def _why(self, name: str) -> str:
        """Why ``name`` is fixed: the first class along the MRO that says, else the general answer."""
        mro = type(self).__mro__
        for key in (name, "*"):
            for cls in mro:
                entry = _WHY.get(cls)
                if entry is not None and key in entry:
                    return entry[key]
        return "it is fixed at construction; make a new object to change it"

    def _copy_in(self, name: str, value: Any) -> None:
        raise NotImplementedError  # only classes with a _COPY_IN define it

    def _freeze(self) -> None:
        object.__setattr__(self, "_sealed", True)

    def _init(self, **fields: Any) -> None:
        """Set the private ``fields`` and seal, with no sealed ``__setattr__`` per field (for hot paths)."""
        for name, value in fields.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_sealed", True)
