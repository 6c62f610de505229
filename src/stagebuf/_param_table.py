"""``DeviceParamTable``: per-request parameters written on the host, uploaded only when changed.

All fields (``name -> dtype``, ``num_rows`` values each) live in one packed host
arena, each at a 16-byte-aligned offset; users write ``table[name].np`` (or
``table.fields[name].np``) directly. ``table[name].gpu`` is a typed view of one
fixed device arena (its address never changes, so CUDA graphs may read it).
``sync()`` compares the host arena with a shadow of what was last uploaded and,
only if a byte differs, snapshots the host arena into the next of
``max_concurrency`` round-robin staging slots and issues one stream-ordered
copy of the whole arena from that slot. The copy
reads the snapshot, not the arena, so host writes after ``sync()`` never race
the copy in flight; the slot-reuse guard (see :mod:`stagebuf._guard`) makes
sure a slot's previous copy is done before the slot is written again.

Nothing is silently ignored: ``field.np = values`` (or ``.cpu``) copies the
values into the field's host view, checked like every stagebuf input (the
field's shape, or one scalar for every row); every other public attribute of a
field or a table is read-only and raises AttributeError saying what to do.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from ._buffers import StagingBuffer, fill_host, make_buffer
from ._constants import ALIGN
from ._convert import torch_dtype
from ._errors import InvalidArgumentError, ReadOnlyAttributeError, UnknownFieldError
from ._guard import SlotRing, empty_stats, slot_count
from ._memory import alloc_device, alloc_host
from ._probe import capabilities
from ._tier import Tier
from ._types import DeviceLike

_FIELD_READ_ONLY = {
    "gpu": "it is a view of the device arena at a fixed address, written by sync(); "
    "write .np (or .cpu) and call table.sync()",
    "name": "fields are named at construction; make a new DeviceParamTable to rename one",
    "dtype": "fields are typed at construction; make a new DeviceParamTable for another dtype",
    "offset": "it is the field's place in the packed arena, fixed at construction",
}


class _Fields(Mapping[str, "ParamField"]):
    """``table.fields``: name -> ParamField, read-only; an unknown name raises UnknownFieldError."""

    __slots__ = ("_d",)

    def __init__(self, d: dict[str, ParamField]):
        self._d = d

    def __getitem__(self, name: str) -> ParamField:
        try:
            return self._d[name]
        except KeyError:
            raise UnknownFieldError(f"no field {name!r}; fields: {', '.join(self._d)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __repr__(self) -> str:
        return f"fields({', '.join(self._d)})"


class ParamField:
    """One field of a DeviceParamTable: ``.np``/``.cpu`` on the host, ``.gpu`` on the device.

    ``field.np = values`` copies ``values`` into the host view (like
    ``field.np[:] = values``, with stagebuf's value checks); the other attributes
    are read-only.
    """

    __slots__ = ("name", "dtype", "offset", "cpu", "np", "gpu")

    name: str
    dtype: torch.dtype
    offset: int
    cpu: torch.Tensor
    np: np.ndarray
    gpu: torch.Tensor

    def __init__(self, name: str, dtype: torch.dtype, offset: int, cpu: torch.Tensor, gpu: torch.Tensor):
        init = object.__setattr__
        init(self, "name", name)
        init(self, "dtype", dtype)
        init(self, "offset", offset)
        init(self, "cpu", cpu)
        init(self, "np", cpu.numpy())
        init(self, "gpu", gpu)

    def __setattr__(self, attr: str, value: Any) -> None:
        if attr in ("np", "cpu"):
            fill_host(self.np, value, self.dtype, f"table[{self.name!r}].{attr}")
            return
        what = _FIELD_READ_ONLY.get(
            attr, "a field has no other attributes; write its values through .np or .cpu"
        )
        raise ReadOnlyAttributeError(f"ParamField.{attr} is read-only: {what}")

    def __delattr__(self, attr: str) -> None:
        raise ReadOnlyAttributeError(f"ParamField.{attr} cannot be deleted: a field's attributes are fixed")

    def __repr__(self) -> str:
        return f"ParamField({self.name!r}, dtype={self.dtype}, rows={self.cpu.shape[0]})"


_TABLE_READ_ONLY = {
    "num_rows": "the arenas are sized at construction; make a new DeviceParamTable(num_rows, ...)",
    "device": "the device arena lives on the device the table was made for; make a new table",
    "nbytes": "it is the packed arena's size, fixed at construction",
    "max_concurrency": "the staging slots are made at construction; make a new table with "
    "max_concurrency=...",
    "tier": "it is the staging slots' tier; set STAGEBUF_TIER before making the table",
    "fields": "fields are fixed at construction; write values with table[name].np[...] = values",
}


class DeviceParamTable:
    """Per-row parameters (e.g. sampling temperature, top-k) mirrored on the device."""

    def __init__(
        self,
        num_rows: int,
        fields: Mapping[str, Any],
        device: DeviceLike = None,
        max_concurrency: int | None = None,
    ):
        """``num_rows`` rows of each field in ``fields`` (name -> dtype) on ``device``.

        ``device=None`` is the current accelerator, else the CPU (as ``capabilities(None)``).
        """
        if isinstance(num_rows, bool) or not isinstance(num_rows, (int, np.integer)) or num_rows < 0:
            raise InvalidArgumentError(f"num_rows={num_rows!r} must be an int >= 0")
        if not isinstance(fields, Mapping) or not fields:
            raise InvalidArgumentError(f"fields={fields!r} must be a non-empty dict of name -> torch dtype")
        self.num_rows = int(num_rows)
        layout: list[tuple[str, torch.dtype, int]] = []
        off = 0
        for name, dt in fields.items():
            if not isinstance(name, str) or not name:
                raise InvalidArgumentError(f"field name {name!r} must be a non-empty str")
            dtype = torch_dtype(dt, f"fields[{name!r}]")
            layout.append((name, dtype, off))
            nbytes = self.num_rows * torch.empty((), dtype=dtype).element_size()
            off = (off + nbytes + ALIGN - 1) & -ALIGN
        self.nbytes = max(off, ALIGN)
        caps = capabilities(device)
        self.device = caps.device
        self.max_concurrency = slot_count(max_concurrency)
        self._host = alloc_host((self.nbytes,), torch.uint8, pinned=False)
        self._host_np = self._host.numpy()
        self._shadow = np.zeros(self.nbytes, np.uint8)  # the device arena starts zero-filled too
        self._dev = alloc_device((self.nbytes,), torch.uint8, self.device)
        self._slots: list[StagingBuffer] = [
            make_buffer(self.nbytes, torch.uint8, self.device) for _ in range(self.max_concurrency)
        ]
        self._ring = SlotRing(self.max_concurrency, self.device, "auto", self.tier, "param table slot")
        self._stats = {**empty_stats(), "skipped": 0, "syncs": 0}
        self._fields: dict[str, ParamField] = {}
        for name, dtype, o in layout:
            n = self.num_rows * torch.empty((), dtype=dtype).element_size()
            self._fields[name] = ParamField(
                name, dtype, o, self._host[o : o + n].view(dtype), self._dev[o : o + n].view(dtype)
            )
        self._fields_view = _Fields(self._fields)
        self._sealed = True

    @property
    def tier(self) -> Tier:
        """The tier of the staging slots (the lowest, if a run-time fallback split them)."""
        return max(s.tier for s in self._slots)

    @property
    def fields(self) -> Mapping[str, ParamField]:
        """name -> ParamField, read-only (``table.fields[name]`` is ``table[name]``)."""
        return self._fields_view

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or "_sealed" not in self.__dict__:  # private, or constructing
            object.__setattr__(self, name, value)
            return
        if name in self._fields:
            raise ReadOnlyAttributeError(
                f"DeviceParamTable.{name}: fields are not attributes; write the "
                f"values with table[{name!r}].np[...] = values"
            )
        what = _TABLE_READ_ONLY.get(
            name,
            "a table's attributes are fixed at construction; write "
            "field values with table[name].np[...] = values",
        )
        raise ReadOnlyAttributeError(f"DeviceParamTable.{name} is read-only: {what}")

    def __delattr__(self, name: str) -> None:
        raise ReadOnlyAttributeError(
            f"DeviceParamTable.{name} cannot be deleted: a table's attributes are fixed"
        )

    def __getitem__(self, name: str) -> ParamField:
        return self._fields_view[name]

    def __contains__(self, name: object) -> bool:
        return name in self._fields

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def changed(self) -> bool:
        """True when a host value differs from what was last uploaded."""
        return self._host_np.tobytes() != self._shadow.tobytes()  # bitwise (a NaN equals itself)

    def sync(self, force: bool = False) -> bool:
        """Upload every field with one stream-ordered copy if a host value changed (or ``force``).

        Returns True when a copy was issued, False when the device already held
        the host values.
        """
        self._stats["syncs"] += 1
        if not force and not self.changed():
            self._stats["skipped"] += 1
            return False
        ring = self._ring
        cur = ring.next()
        slot = self._slots[cur]
        np.copyto(slot.np, self._host_np)
        np.copyto(self._shadow, self._host_np)
        slot._copy_rows(self._dev, self.nbytes)  # the device arena was made to fit the slots
        ring.take(cur)
        ring.mark()  # the slot's one reader, the copy, is enqueued
        if slot.tier is not Tier.HOST:
            self._stats["transfers"] += 1
            self._stats["bytes"] += self.nbytes
        return True

    def stats(self) -> dict[str, int]:
        """transfers, bytes, growths, guard_waits, skipped (syncs with nothing to upload), syncs."""
        return {**self._stats, "guard_waits": self._ring.guard.waits}

    def __repr__(self) -> str:
        names = ", ".join(f"{n}: {str(f.dtype).replace('torch.', '')}" for n, f in self._fields.items())
        return f"DeviceParamTable(num_rows={self.num_rows}, fields={{{names}}}, device={self.device})"
