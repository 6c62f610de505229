"""``StepStager``: all of a step's arrays in one host arena, moved with one transfer.

Each slot is one byte arena (a staging buffer of the chosen tier). ``stage``
writes an array at the next 16-byte-aligned offset and returns the device
tensor at the matching offset of the slot's device side. Leaving the
``step()`` block publishes the used prefix, the same moment on every tier: one
copy on PINNED and PAGEABLE; on UVA and HOST, where the device reads the slot's
own memory, ``stage`` writes a scratch arena that publishing copies in (a host
memcpy). ``STAGEBUF_CHECK=1`` poisons a slot's memory when a step begins in it,
so a tensor read before its step is published, or after its slot came round
again, reads poison (int -1, float NaN) on every tier. ``static=True`` keeps one
device address for every step (CUDA graphs).
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import numpy as np
import torch

from ._buffers import StagingBuffer, make_buffer
from ._constants import ALIGN, POISON, check_mode
from ._convert import _NUMPY_TO_TORCH, _TORCH_TO_NUMPY, host_array
from ._errors import ArgumentTypeError, InvalidArgumentError, UsageError
from ._guard import SlotRing, empty_stats, slot_count
from ._memory import alloc_device
from ._sealed import Sealed
from ._tier import Tier
from ._types import DeviceLike, DTypeLike, HostData

_MAX_CACHED_VIEWS = 4096


_LayoutEntry = tuple[np.dtype, tuple[int, ...], np.ndarray, torch.Tensor, int, torch.dtype]
"""One stage() call of a step: (np dtype, shape, host view, device view, end offset, torch dtype)."""


class _Slot:
    """One arena, where the host writes it, and the views into it that steps have asked for.

    ``host`` is what ``stage()`` writes: the staging buffer's own memory on the copy
    tiers (the device sees it only through the copy at publish), a private scratch
    arena on UVA and HOST (where the buffer's memory *is* what the device reads),
    so that nothing a step stages is visible before the step is published.
    """

    __slots__ = ("buf", "host", "cap", "views", "layout", "retired")

    def __init__(self, buf: StagingBuffer, scratch: bool):
        self.buf = buf
        self.cap = buf.shape[0]
        self.host: np.ndarray = np.zeros(self.cap, np.uint8) if scratch else buf.np
        # The last step's stage() calls in order: (np dtype, shape, host view, device view,
        # end offset, torch dtype). A step that repeats it skips all checks and lookups.
        self.layout: list[_LayoutEntry] = []
        self.views: dict[tuple[Any, ...], Any] = {}
        """(offset, dtype, shape) -> (host view, device view); (arena address, dtype) -> typed arena."""
        self.retired: list[StagingBuffer] = []
        """Buffers a growth replaced: kept alive until the slot comes round again."""

    def view(
        self, off: int, dtype: np.dtype, shape: tuple[int, ...], dev_arena: torch.Tensor
    ) -> tuple[np.ndarray, torch.Tensor]:
        key = (off, dtype, shape)
        v = self.views.get(key)
        if v is None:
            if len(self.views) >= _MAX_CACHED_VIEWS:
                self.views.clear()
            n = int(np.prod(shape, dtype=np.int64))
            end = off + n * dtype.itemsize
            host = self.host[off:end].view(dtype).reshape(shape)
            base = self.views.get((dev_arena.data_ptr(), dtype))  # the whole arena as this dtype
            if base is None:
                base = self.views[(dev_arena.data_ptr(), dtype)] = dev_arena.view(_NUMPY_TO_TORCH[dtype])
            first = off // dtype.itemsize
            dev = base[first : first + n]
            if len(shape) != 1:
                dev = dev.view(shape)
            v = self.views[key] = (host, dev)
        return v


class Step:
    """One step's staging. Use as a context manager; ``flush()`` ends it early.

    Tensors returned by ``stage()`` hold their data from the moment the step is
    published (leaving the block, or ``flush()``) until the stager begins the step
    that reuses the slot, ``max_concurrency`` steps later; on every tier.
    """

    __slots__ = ("_stager", "_slot", "_used", "_n", "_layout", "_retired", "seq", "done")

    def __init__(self, stager: StepStager, slot: _Slot, seq: int):
        self._stager = stager
        self._slot = slot
        self._used = 0
        self._n = 0
        self._layout: list[_LayoutEntry] | None = slot.layout
        self._retired: list[tuple[StagingBuffer, np.ndarray, int]] = []
        self.seq = seq
        self.done = False

    def __enter__(self) -> Step:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.flush()
        else:
            self.done = True
            self._stager._open = None

    def stage(self, x: HostData, dtype: DTypeLike | None = None) -> torch.Tensor:
        """Write ``x`` (list, ndarray or CPU tensor; 1-D or 2-D) into this step's arena.

        Returns the device tensor that holds it once the step is published (on
        leaving the ``with`` block). ``dtype`` defaults to the input's own
        (int64/float64 for Python lists).
        """
        layout = self._layout
        i = self._n
        if type(x) is np.ndarray and layout is not None and i < len(layout) and not self.done:
            e = layout[i]
            if x.shape == e[1] and x.dtype == e[0] and (dtype is None or dtype is e[5]):
                e[2][...] = x  # the same array as last time in this slot: just write it
                self._n = i + 1
                self._used = e[4]
                return e[3]
        return self._stage(x, dtype)

    def _stage(self, x: HostData, dtype: DTypeLike | None) -> torch.Tensor:
        if self.done:
            raise UsageError(f"step {self.seq} was already flushed; begin a new step()")
        to_numpy: dict[Any, np.dtype] = _TORCH_TO_NUMPY  # keyed by torch dtypes: other dtype-likes miss
        want = None if dtype is None else to_numpy.get(dtype)
        if (
            type(x) is np.ndarray
            and x.ndim in (1, 2)
            and x.dtype in _NUMPY_TO_TORCH
            and (dtype is None or x.dtype == want)
        ):
            arr = x
        else:
            arr = host_array(x, dtype, "x")
        off = (self._used + ALIGN - 1) & -ALIGN
        end = off + arr.nbytes
        slot = self._slot
        if end > slot.cap:
            self._grow(arr.nbytes)
            off, end = 0, arr.nbytes
        host, dev = slot.view(off, arr.dtype, arr.shape, self._stager._dev_arena(slot))
        host[...] = arr
        self._used = end
        layout = self._layout
        if layout is not None:
            del layout[self._n :]
            layout.append((arr.dtype, arr.shape, host, dev, end, _NUMPY_TO_TORCH[arr.dtype]))
        self._n += 1
        return dev

    def _grow(self, nbytes: int) -> None:
        st = self._stager
        slot = self._slot
        if st.static:
            raise UsageError(
                f"StepStager(static=True): step {self.seq} needs more than the {slot.cap} bytes of its "
                "static arena; growing would move the addresses a captured CUDA graph reads. "
                f"Construct the stager with capacity >= {2 * slot.cap + nbytes}."
            )
        if st.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise UsageError(
                f"StepStager: step {self.seq} needs more than the slot's {slot.cap} bytes while a "
                "CUDA graph is being captured; growing would move addresses the graph reads. "
                f"Construct the stager with capacity >= {2 * slot.cap + nbytes}."
            )
        need = (self._used + ALIGN) + nbytes
        cap = max(2 * slot.cap, 1 << max(need - 1, 1).bit_length())
        new = make_buffer(cap, torch.uint8, st.device, slot.buf.tier)
        self._retired.append((slot.buf, slot.host, self._used))
        slot.retired.append(slot.buf)  # alive while tensors of this step may point into it
        slot.buf, slot.cap = new, cap
        slot.host = new.np if new.tier.copies else np.zeros(cap, np.uint8)
        slot.views.clear()
        slot.layout.clear()
        self._layout = None  # offsets restart in the new arena: record the layout next step
        self._used = 0
        st._stats["growths"] += 1

    def flush(self) -> None:
        """Publish everything staged in this step: from now on the device sees it."""
        if self.done:
            return
        st = self._stager
        slot = self._slot
        for buf, host, used in self._retired:  # a growth mid-step: earlier tensors stay valid
            if used:
                st._publish(buf, host, used, buf.dev)
        used = self._used
        if used:
            buf = slot.buf
            if st._static_dev is not None:
                st._publish(buf, slot.host, used, st._static_dev)
                copied = buf.tier is not Tier.HOST
            elif slot.host is buf.np:  # the copy tiers: one copy of the used prefix
                buf.uva(used)
                copied = True
            else:  # UVA and HOST: the device reads the slot's memory from now on
                buf.np[:used] = slot.host[:used]
                copied = False
            if copied:
                stats = st._stats
                stats["transfers"] += 1
                stats["bytes"] += used
        self.done = True
        st._open = None


class StepStager(Sealed):
    """Coalesced per-step staging with a slot-reuse guard.

    ``capacity`` is in bytes per slot. ``guard`` is ``"auto"`` (wait where the
    device reads host memory asynchronously: UVA and PINNED; off elsewhere),
    ``"wait"``, ``"raise"`` or ``"off"``: see :mod:`stagebuf._guard`. A slot's
    consumers count as enqueued when the next step begins, or at
    ``mark_consumed()``.

    ``static=True`` gives every step the same device addresses (for CUDA graphs):
    the slots rotate on the host, and publishing copies the step into one fixed
    device arena (one copy on every tier but HOST). Stage the same shapes in the
    same order as when the graph was captured; the arena never grows.
    """

    def __init__(
        self,
        device: DeviceLike = None,
        capacity: int = 1 << 20,
        max_concurrency: int | None = None,
        guard: str = "auto",
        static: bool = False,
    ):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < ALIGN:
            raise InvalidArgumentError(f"capacity={capacity!r} must be an int >= {ALIGN} (bytes per slot)")
        if not isinstance(static, bool):
            raise ArgumentTypeError(f"static={static!r}; allowed: True or False")
        self.max_concurrency = slot_count(max_concurrency)
        bufs = [make_buffer(capacity, torch.uint8, device) for _ in range(self.max_concurrency)]
        self.static = static
        # UVA and HOST: stage into scratch, publish at exit (per slot: a fallback may mix tiers)
        self._slots = [_Slot(b, not b.tier.copies) for b in bufs]
        self.device = bufs[0].device
        self._static_dev: torch.Tensor | None = None
        if static:
            self._static_dev = alloc_device((capacity,), torch.uint8, self.device)
        self._check = check_mode()
        self._ring = SlotRing(self.max_concurrency, self.device, guard, self.tier, "step slot")
        self._open: Step | None = None
        self._stats = empty_stats()
        self._freeze()

    @property
    def tier(self) -> Tier:
        return max(s.buf.tier for s in self._slots)

    @property
    def guard(self) -> str:
        return self._ring.guard.mode

    def _dev_arena(self, slot: _Slot) -> torch.Tensor:
        """The device memory a slot's tensors point into (the static arena, or the slot's own)."""
        return slot.buf.dev if self._static_dev is None else self._static_dev

    def _publish(self, buf: StagingBuffer, host: np.ndarray, used: int, dev: torch.Tensor) -> None:
        """Make the first ``used`` bytes staged in ``buf`` visible at ``dev``: one copy, or none."""
        if host is not buf.np:
            buf.np[:used] = host[:used]  # UVA and HOST: the device reads buf's memory from now on
        if dev is buf.dev:
            if buf.tier.copies:
                buf.uva(used)
        elif buf.tier is Tier.HOST:
            dev[:used].numpy()[...] = buf.np[:used]
        else:  # the static arena: one stream-ordered copy from the slot (read through UVA, or a copy)
            src = buf.dev if buf.tier is Tier.UVA else buf.cpu
            dev[:used].copy_(src[:used], non_blocking=True)

    def _poison(self, slot: _Slot) -> None:
        """Check mode: what this slot published before is released, and nothing new is published yet."""
        slot.host.fill(POISON)
        if self._static_dev is not None:
            self._static_dev.fill_(POISON)
        elif slot.buf.tier.copies:
            slot.buf.dev.fill_(POISON)
        else:
            slot.buf.np.fill(POISON)

    def step(self) -> Step:
        """Begin a step in the next slot (after the guard's check of that slot)."""
        if self._open is not None:
            raise UsageError(f"step {self._open.seq} is still open; flush it before step()")
        ring = self._ring
        cur = ring.next()
        slot = self._slots[cur]
        slot.retired.clear()
        if self._check:
            self._poison(slot)
        st = self._open = Step(self, slot, ring.take(cur))
        return st

    def mark_consumed(self) -> None:
        """The last step's consumers are enqueued: record the guard's event now."""
        if self._open is not None:
            raise UsageError(f"step {self._open.seq} is still open; flush it first")
        self._ring.mark()

    def stats(self) -> dict[str, int]:
        return {**self._stats, "guard_waits": self._ring.guard.waits, "steps": self._ring.seq}
