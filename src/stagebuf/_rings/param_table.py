"""``DeviceParamTable``: per-request parameters written on the host, uploaded only when changed.

``sync()`` compares the host arena with a shadow of the last upload, byte for byte; the class docstring has
the rest.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from .._bytes.buffers import copy_rows, ensure_buffers_room
from .._bytes.checked import host_view
from .._bytes.make import make_buffer
from .._common.convert import fill_host, torch_dtype
from .._common.errors import ArgumentTypeError, InvalidArgumentError, UnknownFieldError
from .._common.sealed import COPY_HINT, Sealed, read_only
from .._common.tier import Tier
from .._common.types import DeviceLike
from .._device.memory import alloc_device, alloc_host
from .._tiers.probe import capabilities
from .._tiers.settings import ALIGN
from .guard import slot_count
from .ring import Ring


class _Fields(Mapping[str, "ParamField"]):
    """``table.fields``: name -> ParamField, read-only; an unknown name raises UnknownFieldError."""

    __slots__ = ("_d",)

    def __init__(self, d: dict[str, ParamField]):
        self._d = d

    def __getitem__(self, name: str) -> ParamField:
        try:
            return self._d[name]
        except (KeyError, TypeError):  # (an unhashable key is no field name either)
            raise UnknownFieldError(f"no field {name!r}; fields: {', '.join(self._d)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __repr__(self) -> str:
        return f"fields({', '.join(self._d)})"


@read_only(
    {
        "*": f"a field has no other attributes; {COPY_HINT}",
        "gpu": "it is a view of the device arena at a fixed address, written by sync(); "
        "write .np (or .cpu) and call table.sync()",
        "name": "fields are named at construction; make a new DeviceParamTable to rename one",
        "dtype": "fields are typed at construction; make a new DeviceParamTable for another dtype",
        "offset": "it is the field's place in the packed arena, fixed at construction",
    }
)
class ParamField(Sealed):
    """One field of a :class:`DeviceParamTable`: ``.np``/``.cpu`` on the host, ``.gpu`` on the device.

    Assigning ``.np`` or ``.cpu`` copies the values (one scalar, or one value per row) in, checked as a
    :class:`StagingBuffer`'s are; the other attributes (``name``, ``dtype``, ``offset``: the field's byte
    offset in the packed arena, and ``gpu``) are read-only (ReadOnlyAttributeError).

    Attributes
    ----------
    cpu : torch.Tensor
        The host values (one per row); ``np`` is a numpy view of it.
    gpu : torch.Tensor
        The device values, at a fixed address, written by ``table.sync()``.
    """

    _COPY_IN = ("np", "cpu")

    def __init__(self, name: str, dtype: torch.dtype, offset: int, cpu: torch.Tensor, gpu: torch.Tensor):
        self.name = name
        self.dtype = dtype
        self.offset = offset
        self.cpu = cpu
        self.np = host_view(cpu, f"table[{name!r}].np")
        self.gpu = gpu
        self._freeze()

    def _copy_in(self, name: str, value: Any) -> None:
        fill_host(self.np, value, self.dtype, f"table[{self.name!r}].{name}")

    def __repr__(self) -> str:
        return f"ParamField({self.name!r}, dtype={self.dtype}, rows={self.cpu.shape[0]})"


@read_only(
    {
        "*": "a table's attributes are fixed at construction; write field values with "
        "table[name].np[...] = values",
        "num_rows": "the arenas are sized at construction; make a new DeviceParamTable(num_rows, ...)",
        "device": "the device arena lives on the device the table was made for; make a new table",
        "nbytes": "it is the packed arena's size, fixed at construction",
        "max_concurrency": "the staging slots are made at construction; make a new table with "
        "max_concurrency=...",
        "tier": "it is the staging slots' tier; set STAGEBUF_TIER before making the table",
        "fields": "fields are fixed at construction; write values with table[name].np[...] = values",
    }
)
class DeviceParamTable(Sealed):
    """Per-row parameters (e.g. sampling temperature, top-k) mirrored on the device.

    Every field holds ``num_rows`` values, packed with the others into one host arena and one device arena at
    a fixed address (CUDA graphs may read it). The host writes ``table[name].np``; :meth:`sync` uploads the
    whole arena with one copy when a value changed, from a snapshot in the next of ``max_concurrency`` staging
    slots, so host writes after ``sync()`` never reach the copy in flight.

    ``table[name]`` is the field's :class:`ParamField` (another name raises UnknownFieldError, a KeyError);
    ``in``, ``len()`` and iteration go over the names. ``num_rows``, ``device``, ``max_concurrency`` (at least
    2) and ``nbytes`` (the arena's size, fields 16-byte aligned) are read-only (ReadOnlyAttributeError).

    Parameters
    ----------
    num_rows : int
        The values per field, >= 0.
    fields : mapping of str to dtype
        Field name (a non-empty str) -> dtype (as for :class:`StagingBuffer`), in arena order; at least one.
    device : torch.device, str, int or None, optional
        The target device, as for :func:`capabilities`.
    max_concurrency : int or None, optional
        The staging slot count, 1 to 1024 (raised to at least 2); None: :func:`set_default_max_concurrency`'s.

    Raises
    ------
    InvalidArgumentError, ArgumentTypeError
        InvalidArgumentError if ``num_rows``, ``fields`` (or a field name) or ``max_concurrency`` is not as
        allowed above; ArgumentTypeError if a field's dtype is not supported.
    DeviceAllocationError
        If the device runs out of memory for the arena or the staging slots.
    SetupError, TierUnavailableError, ArgumentTypeError
        As :func:`capabilities` raises them for ``device`` and the settings.
    """

    def __init__(
        self,
        num_rows: int,
        fields: Mapping[str, Any],
        device: DeviceLike = None,
        max_concurrency: int | None = None,
    ):
        if isinstance(num_rows, bool) or not isinstance(num_rows, (int, np.integer)) or num_rows < 0:
            raise InvalidArgumentError(f"num_rows={num_rows!r} must be an int >= 0")
        if not isinstance(fields, Mapping) or not fields:
            raise InvalidArgumentError(f"fields={fields!r} must be a non-empty dict of name -> torch dtype")
        self.num_rows = int(num_rows)
        layout: list[tuple[str, torch.dtype, int, int]] = []  # (name, dtype, offset, bytes)
        off = 0
        for name, dt in fields.items():
            if not isinstance(name, str) or not name:
                raise InvalidArgumentError(f"field name {name!r} must be a non-empty str")
            dtype = torch_dtype(dt, f"fields[{name!r}]")
            nbytes = self.num_rows * dtype.itemsize
            layout.append((name, dtype, off, nbytes))
            off = (off + nbytes + ALIGN - 1) & -ALIGN
        self.nbytes = max(off, ALIGN)
        caps = capabilities(device)
        self.device = caps.device
        self.max_concurrency = n = slot_count(max_concurrency)
        # the host memory of the host arena, its shadow, the slots (and a CPU device arena), checked first
        ensure_buffers_room(
            f"DeviceParamTable({self.num_rows} rows, {self.nbytes} bytes): its arenas and {n} slots",
            n,
            (self.nbytes,),
            torch.uint8,
            caps.tier,
            self.device.type,
            extra=(3 if self.device.type == "cpu" else 2) * self.nbytes,
        )
        self._host = alloc_host((self.nbytes,), torch.uint8, pinned=False, tier=caps.tier)
        self._host_np = self._host.numpy()
        # the device arena starts zero-filled too
        self._shadow = alloc_host((self.nbytes,), torch.uint8, pinned=False, tier=caps.tier).numpy()
        self._dev = alloc_device((self.nbytes,), torch.uint8, self.device, caps.tier)
        self._ring = Ring(
            n,
            lambda: make_buffer(self.nbytes, torch.uint8, self.device),
            "auto",
            "param table slot",
            owner="DeviceParamTable",
        )
        self._syncs = {"skipped": 0, "syncs": 0}
        h, d = self._host, self._dev
        self._fields = {
            name: ParamField(name, dtype, o, h[o : o + b].view(dtype), d[o : o + b].view(dtype))
            for name, dtype, o, b in layout
        }
        self._fields_view = _Fields(self._fields)
        self._freeze()

    @property
    def tier(self) -> Tier:
        """The tier of the staging slots (the worst, if a run-time fallback split them)."""
        return self._ring.tier

    @property
    def fields(self) -> Mapping[str, ParamField]:
        """name -> ParamField, read-only, in arena order (``table.fields[name]`` is ``table[name]``)."""
        return self._fields_view

    def _missing_hint(self, name: str) -> str | None:
        if name in self.__dict__.get("_fields", {}):
            return f"fields are not attributes: it is table[{name!r}]"
        return None

    def _why(self, name: str) -> str:
        if name in self._fields:
            return f"fields are not attributes; write the values with table[{name!r}].np[...] = values"
        return super()._why(name)

    def __getitem__(self, name: str) -> ParamField:
        """The field ``name`` (UnknownFieldError if there is none: see the class docstring)."""
        return self._fields_view[name]

    def __contains__(self, name: object) -> bool:
        try:
            return name in self._fields
        except TypeError:  # unhashable: not a field name
            return False

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def changed(self) -> bool:
        """Whether a host value differs, bitwise (a NaN equals itself), from what was last uploaded: whether
        :meth:`sync` would issue a copy."""
        return self._host_np.tobytes() != self._shadow.tobytes()

    def sync(self, force: bool = False) -> bool:
        """Upload every field with one copy on the current stream, from a snapshot, if a host value changed or
        ``force`` (the guard first waits for the slot's previous copy); whether a copy was issued. Raises
        ArgumentTypeError if ``force`` is not a bool, CudaError if the guard's CUDA event fails."""
        self._syncs["syncs"] += 1
        if not isinstance(force, (bool, np.bool_)):
            raise ArgumentTypeError(f"force={force!r}; allowed: True or False")
        if not force and not self.changed():
            self._syncs["skipped"] += 1
            return False
        ring = self._ring
        cur, slot = ring.acquire()
        np.copyto(slot.np, self._host_np)
        np.copyto(self._shadow, self._host_np)
        copy_rows(slot, self._dev, self.nbytes)  # the device arena was made to fit the slots
        # the slot's one reader, the copy, is enqueued
        # (no transfer where the device is the host itself: the copy was a host copy)
        ring.publish(cur, None if slot.dev is slot.cpu else self.nbytes, marked=True)
        return True

    def release_thread(self) -> None:
        """Hand this object to another thread, as :meth:`UvaBufferPool.release_thread`."""
        self._ring.release_thread()

    def stats(self) -> dict[str, int]:
        """The table's counters: ``transfers`` and ``bytes`` (uploads and their size; none on tier HOST),
        ``growths`` (always 0: the arena never grows), ``guard_waits`` (times a sync waited for a slot's
        previous copy), ``syncs`` (calls of :meth:`sync`) and ``skipped`` (those with nothing to upload)."""
        return {**self._ring.stats(), **self._syncs}

    def __repr__(self) -> str:
        names = ", ".join(f"{n}: {str(f.dtype).replace('torch.', '')}" for n, f in self._fields.items())
        return f"DeviceParamTable(num_rows={self.num_rows}, fields={{{names}}}, device={self.device})"
