"""One sealing mechanism for every public object: attributes that cannot be assigned by mistake.

A class deriving from ``Sealed`` calls ``self._freeze()`` at the end of its
constructor. From then on assigning a name in its ``_COPY_IN`` (``np``/``cpu`` of
host-backed objects) copies the value into its host memory through
``_copy_in``, with stagebuf's value checks; assigning or deleting any other
public attribute raises ReadOnlyAttributeError, saying why it is fixed and what
to do instead, instead of being accepted and silently ignored by the object's
own code. Every message comes from one table, ``READ_ONLY``. Private attributes
stay settable. On Python 3.12 and later, reading an attribute the object does not have raises
UnknownAttributeError (an AttributeError) listing the ones it has; on 3.10 and 3.11 it raises
Python's own AttributeError (a ``__getattr__`` hook would slow every attribute read there).
"""

from __future__ import annotations

import sys
from typing import Any, ClassVar

from .errors import ReadOnlyAttributeError, UnknownAttributeError

_COPY = "write its values through .np or .cpu"
READ_ONLY: dict[str, dict[str, str]] = {
    # class name (looked up along the MRO) -> attribute -> why it is fixed and what to do
    # instead; "*" is the class's answer for any other attribute
    "StagingBuffer": {
        "*": f"a buffer's attributes are fixed at construction; {_COPY}",
        "dev": "it is the device storage uva() publishes into, at a fixed address; write .np or .cpu",
        "device": "a buffer stays on the device it was made for; make a new buffer for another device",
        "shape": "the host and device storage are sized at construction; make a new buffer to resize",
        "dtype": "the storage is typed at construction; make a new buffer for another dtype",
        "tier": "it is the class's tier; use make_buffer(..., tier=...) for another tier",
    },
    "ParamField": {
        "*": f"a field has no other attributes; {_COPY}",
        "gpu": "it is a view of the device arena at a fixed address, written by sync(); "
        "write .np (or .cpu) and call table.sync()",
        "name": "fields are named at construction; make a new DeviceParamTable to rename one",
        "dtype": "fields are typed at construction; make a new DeviceParamTable for another dtype",
        "offset": "it is the field's place in the packed arena, fixed at construction",
    },
    "DeviceParamTable": {
        "*": "a table's attributes are fixed at construction; write field values with "
        "table[name].np[...] = values",
        "num_rows": "the arenas are sized at construction; make a new DeviceParamTable(num_rows, ...)",
        "device": "the device arena lives on the device the table was made for; make a new table",
        "nbytes": "it is the packed arena's size, fixed at construction",
        "max_concurrency": "the staging slots are made at construction; make a new table with "
        "max_concurrency=...",
        "tier": "it is the staging slots' tier; set STAGEBUF_TIER before making the table",
        "fields": "fields are fixed at construction; write values with table[name].np[...] = values",
    },
    "UvaBackedTensor": {"gpu": "copy_to_uva() sets it; write the host values through .np or .cpu"},
    "StagedWriteTensor": {
        "gpu": "applies write the tensor made at construction; edit it with stage_write() + apply_write()",
        "stage_write": "it is this tensor's staging call",
        "stage_write_elem": "it is this tensor's staging call",
    },
    "Capabilities": {
        "*": "it is the probe's decision, cached per device and shared by every buffer made for it; "
        "set STAGEBUF_TIER (or pass another device) and call reset_capabilities() to probe again"
    },
    "Tier": {"*": "a tier is a constant of the process; it cannot be changed"},
    "Sealed": {"*": "it is fixed at construction; make a new object to change it"},
}


class Sealed:
    """Base of every public object with attributes: see the module docstring."""

    _COPY_IN: ClassVar[tuple[str, ...]] = ()
    """Attributes whose assignment copies into host memory (``_copy_in``) instead of rebinding."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or not self.__dict__.get("_sealed"):  # private, or constructing
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
        """Why ``name`` is fixed, from ``READ_ONLY`` (the first class along the MRO that says)."""
        for cls in type(self).__mro__:
            entry = READ_ONLY.get(cls.__name__)
            if entry is not None and name in entry:
                return entry[name]
        for cls in type(self).__mro__:
            entry = READ_ONLY.get(cls.__name__)
            if entry is not None and "*" in entry:
                return entry["*"]
        return READ_ONLY["Sealed"]["*"]

    def _copy_in(self, name: str, value: Any) -> None:
        raise NotImplementedError  # only classes with a _COPY_IN define it

    def _freeze(self) -> None:
        object.__setattr__(self, "_sealed", True)
