"""``StepStager``: all of a step's arrays in one host arena, moved with one transfer.

Each slot is one byte arena (a staging buffer of the chosen tier). ``stage``
writes an array at the next 16-byte-aligned offset and returns the device
tensor at the matching offset of the slot's device side; leaving the ``step()``
block publishes the used prefix: nothing on UVA and HOST, one copy on PINNED
and PAGEABLE. Slots keep fixed device addresses (CUDA graphs may read them)
until a step outgrows its slot.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .buffers import StagingBuffer, make_buffer
from .convert import _NUMPY_TO_TORCH, _TORCH_TO_NUMPY, host_array
from .guard import SlotRing
from .pool import empty_stats, slot_count
from .tier import Tier

ALIGN = 16
_MAX_CACHED_VIEWS = 4096


class _Slot:
    """One arena and the views into it that steps have asked for."""

    __slots__ = ("buf", "cap", "views", "retired", "layout")

    def __init__(self, buf: StagingBuffer):
        self.buf = buf
        self.cap = buf.shape[0]
        # The last step's stage() calls in order: (np dtype, shape, host view, device view,
        # end offset, torch dtype). A step that repeats it skips all checks and lookups.
        self.layout: list[tuple[np.dtype, tuple[int, ...], np.ndarray, torch.Tensor, int, torch.dtype]] = []
        self.views: dict[tuple[int, np.dtype, tuple[int, ...]], tuple[np.ndarray, torch.Tensor]] = {}
        self.retired: list[StagingBuffer] = []

    def view(self, off: int, dtype: np.dtype, shape: tuple[int, ...]) -> tuple[np.ndarray, torch.Tensor]:
        key = (off, dtype, shape)
        v = self.views.get(key)
        if v is None:
            if len(self.views) >= _MAX_CACHED_VIEWS:
                self.views.clear()
            end = off + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            host = self.buf.np[off:end].view(dtype).reshape(shape)
            dev = self.buf.dev[off:end].view(_NUMPY_TO_TORCH[dtype]).view(shape)
            v = self.views[key] = (host, dev)
        return v


class Step:
    """One step's staging. Use as a context manager; ``flush()`` ends it early."""

    __slots__ = ("_stager", "_slot", "_used", "_n", "_layout", "_retired", "seq", "done")

    def __init__(self, stager: StepStager, slot: _Slot, seq: int):
        self._stager = stager
        self._slot = slot
        self._used = 0
        self._n = 0
        self._layout: list | None = slot.layout
        self._retired: list[tuple[StagingBuffer, int]] = []
        self.seq = seq
        self.done = False

    def __enter__(self) -> Step:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.flush()
        else:
            self.done = True
            self._stager._open = None

    def stage(self, x: Any, dtype: Any = None) -> torch.Tensor:
        """Write ``x`` (list, ndarray or CPU tensor; 1-D or 2-D) into this step's arena.

        Returns the device tensor that will hold it once the step is flushed.
        ``dtype`` defaults to the input's own (int64/float64 for Python lists).
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

    def _stage(self, x: Any, dtype: Any) -> torch.Tensor:
        if self.done:
            raise RuntimeError(f"step {self.seq} was already flushed; begin a new step()")
        want = None if dtype is None else _TORCH_TO_NUMPY.get(dtype)
        if (type(x) is np.ndarray and x.ndim in (1, 2) and x.dtype in _NUMPY_TO_TORCH
                and (dtype is None or x.dtype == want)):
            arr = x
        else:
            arr = host_array(x, dtype, "x")
        off = (self._used + ALIGN - 1) & -ALIGN
        end = off + arr.nbytes
        slot = self._slot
        if end > slot.cap:
            self._grow(arr.nbytes)
            off, end = 0, arr.nbytes
        host, dev = slot.view(off, arr.dtype, arr.shape)
        host[...] = arr
        self._used = end
        layout = self._layout
        if layout is not None:
            del layout[self._n:]
            layout.append((arr.dtype, arr.shape, host, dev, end, _NUMPY_TO_TORCH[arr.dtype]))
        self._n += 1
        return dev

    def _grow(self, nbytes: int) -> None:
        st = self._stager
        slot = self._slot
        if st.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"StepStager: step {self.seq} needs more than the slot's {slot.cap} bytes while a "
                "CUDA graph is being captured; growing would move addresses the graph reads. "
                f"Construct the stager with capacity >= {2 * slot.cap + nbytes}."
            )
        need = (self._used + ALIGN) + nbytes
        cap = max(2 * slot.cap, 1 << max(need - 1, 1).bit_length())
        new = make_buffer(cap, torch.uint8, st.device, slot.buf.tier)
        self._retired.append((slot.buf, self._used))
        slot.retired.append(slot.buf)
        slot.buf, slot.cap = new, cap
        slot.views.clear()
        slot.layout.clear()
        self._layout = None  # offsets restart in the new arena: record the layout next step
        self._used = 0
        st._stats["growths"] += 1

    def flush(self) -> None:
        """Complete the transfer of everything staged in this step."""
        if self.done:
            return
        st = self._stager
        slot = self._slot
        if slot.buf.tier.copies:
            for buf, used in self._retired:  # a growth's extra copy: keeps earlier tensors valid
                if used:
                    buf.uva(used)
            if self._used:
                slot.buf.uva(self._used)
                st._stats["transfers"] += 1
                st._stats["bytes"] += self._used
        self.done = True
        st._open = None


class StepStager:
    """Coalesced per-step staging with a slot-reuse guard.

    ``capacity`` is in bytes per slot. ``guard`` is ``"auto"`` (wait where the
    device reads host memory asynchronously: UVA and PINNED; off elsewhere),
    ``"wait"``, ``"raise"`` or ``"off"``: see :mod:`stagebuf.guard`. A slot's
    consumers count as enqueued when the next step begins, or at
    ``mark_consumed()``.
    """

    def __init__(
        self,
        device: Any = None,
        capacity: int = 1 << 20,
        max_concurrency: int | None = None,
        guard: str = "auto",
    ):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < ALIGN:
            raise ValueError(f"capacity={capacity!r} must be an int >= {ALIGN} (bytes per slot)")
        self.max_concurrency = slot_count(max_concurrency)
        self._slots = [
            _Slot(make_buffer(capacity, torch.uint8, device)) for _ in range(self.max_concurrency)
        ]
        self.device = self._slots[0].buf.device
        self._ring = SlotRing(self.max_concurrency, self.device, guard, self.tier, "step slot")
        self._open: Step | None = None
        self._stats = empty_stats()

    @property
    def tier(self) -> Tier:
        return max(s.buf.tier for s in self._slots)

    @property
    def guard(self) -> str:
        return self._ring.guard.mode

    def step(self) -> Step:
        """Begin a step in the next slot (after the guard's check of that slot)."""
        if self._open is not None:
            raise RuntimeError(f"step {self._open.seq} is still open; flush it before step()")
        ring = self._ring
        cur = ring.next()
        slot = self._slots[cur]
        slot.retired.clear()
        st = self._open = Step(self, slot, ring.take(cur))
        return st

    def mark_consumed(self) -> None:
        """The last step's consumers are enqueued: record the guard's event now."""
        if self._open is not None:
            raise RuntimeError(f"step {self._open.seq} is still open; flush it first")
        self._ring.mark()

    def stats(self) -> dict[str, int]:
        return {**self._stats, "guard_waits": self._ring.guard.waits, "steps": self._ring.seq}
