"""One sealing mechanism for every public object: attributes that cannot be assigned by mistake.

A class deriving from ``Sealed`` calls ``self._freeze()`` at the end of its
constructor. From then on assigning a name in its ``_COPY_IN`` (``np``/``cpu`` of
host-backed objects) copies the value into its host memory through
``_copy_in``, with stagebuf's value checks; assigning or deleting any other
public attribute raises ReadOnlyAttributeError, saying why it is fixed and what
to do instead, instead of being accepted and silently ignored by the object's
own code. Each class states its messages with ``@read_only({...})``. Private attributes
stay settable. On Python 3.12 and later, reading an attribute the object does not have raises
UnknownAttributeError (an AttributeError) listing the ones it has; on 3.10 and 3.11 it raises
Python's own AttributeError (a ``__getattr__`` hook would slow every attribute read there).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, ClassVar, Generic, TypeVar

from .errors import ReadOnlyAttributeError, UnknownAttributeError

COPY_HINT = "write its values through .np or .cpu"
"""The end of a host-backed object's read-only messages."""

_WHY: dict[type, dict[str, str]] = {}
"""Per class: attribute -> why it is fixed and what to do instead ("*": any other attribute)."""

_T = TypeVar("_T", bound=type)


def read_only(why: dict[str, str]) -> Callable[[_T], _T]:
    """Class decorator: the class's read-only messages, kept with the class (see the module docstring)."""

    def mark(cls: _T) -> _T:
        _WHY[cls] = why
        return cls

    return mark


_V = TypeVar("_V")


class Cell(Generic[_V]):
    """One value a sealed object changes on a hot path, written as ``cell.value = x``: a plain slot,
    so no ``__setattr__`` hook runs per write."""

    __slots__ = ("value",)

    def __init__(self, value: _V):
        self.value = value


class Sealed:
    """Base of every public object with attributes: see the module docstring."""

    _COPY_IN: ClassVar[tuple[str, ...]] = ()
    """Attributes whose assignment copies into host memory (``_copy_in``) instead of rebinding."""
    _sealed = False
    """Set on the instance by ``_freeze()``. (Read as an attribute: reading ``self.__dict__`` here
    makes CPython materialise every instance's dict, and each attribute read of the object then
    costs more: ``StagedWriteTensor.stage_write`` took 191 against 155 ns a call, a timeit of 256
    calls on the CPU machine, CPython 3.11.)"""

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
        # Only from 3.12: on 3.10 and 3.11 a class with a __getattr__ hook loses the interpreter's
        # attribute-read specialisation, which cost 0.2-0.3 us per pool publish (measured, CPython
        # 3.11); there a missing attribute raises Python's own AttributeError.
        def __getattr__(self, name: str) -> Any:
            # only reached when normal lookup fails: an attribute the object does not have
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
        """Set the private ``fields`` and seal: a constructor on a hot path runs no sealed
        ``__setattr__`` per field."""
        for name, value in fields.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_sealed", True)
