"""``StepStager``: all of a step's arrays in one host arena, moved with one transfer.

``stage`` writes each array at the next 16-byte-aligned offset of the slot (a byte arena of the ring's tier)
and returns the device tensor at that offset; the flush publishes the used prefix (``Step.flush``).
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
import torch

from .._bytes.buffers import StagingBuffer, buffer_class, copy_rows, ensure_buffers_room
from .._bytes.make import make_buffer
from .._common.cache import BoundedCache
from .._common.convert import NUMPY_TO_TORCH, TORCH_TO_NUMPY, host_array
from .._common.errors import ArgumentTypeError, InvalidArgumentError, UsageError
from .._common.owner import thread_name
from .._common.sealed import Cell, Sealed
from .._common.tier import Tier
from .._common.types import DeviceLike, DTypeLike, HostData
from .._device.memory import alloc_device
from .._tiers.probe import capabilities
from .._tiers.settings import ALIGN, POISON, check_mode
from .guard import GuardMode, slot_count
from .ring import Ring, arena_as

_MAX_VIEWS = 4096  # views a slot keeps (a step's arrays of many shapes: more than a launcher's layouts)

_LayoutEntry = tuple[np.dtype, tuple[int, ...], np.ndarray, torch.Tensor, int, torch.dtype]
"""One stage() call of a step: (np dtype, shape, host view, device view, end offset, torch dtype)."""


class _Slot:
    """One arena and its views. ``host`` (what ``stage()`` writes) is the buffer's own memory on the copy
    tiers or ``in_place``, else a scratch arena (UVA, HOST: the device reads the buffer) copied at flush."""

    __slots__ = (
        "ring", "i", "static", "in_place", "check", "buf", "dev_arena", "host", "cap", "views", "layout",
    )  # fmt: skip

    def __init__(self, ring: Ring, i: int, static: torch.Tensor | None, in_place: bool, check: bool):
        self.ring, self.i, self.in_place, self.check = ring, i, in_place, check  # check: poison grown arenas
        self.static = static  # the static arena (static=True), else None
        self.buf = buf = ring.buf(i)  # replaced by grow()
        self.dev_arena: torch.Tensor = buf.dev if static is None else static  # where the tensors point
        self.cap = buf.shape[0]
        self.host: np.ndarray = self._host_of(buf)
        self.layout: list[_LayoutEntry] = []  # the last step's stage() calls: a repeat skips every check
        # the ring's cache: (offset, dtype, shape) -> (host, device view); (address, dtype) -> typed arena
        self.views: BoundedCache[tuple[Any, ...], Any] = ring.views(i)

    def _host_of(self, buf: StagingBuffer) -> np.ndarray:
        """What stage() writes for ``buf``: a scratch arena on UVA and HOST unless in place."""
        return buf.np if buf.copies or self.in_place else np.zeros(buf.shape[0], np.uint8)

    def publish(self, buf: StagingBuffer, host: np.ndarray, used: int) -> bool:
        """Make the first ``used`` bytes staged in ``buf`` visible where its tensors point (True: copied)."""
        if host is not buf.np:
            buf.np[:used] = host[:used]  # UVA and HOST: the device reads buf's memory from now on
        dev = self.static
        if dev is None:
            if buf.copies:  # the buffer publishes with a transfer into its device memory
                buf.uva(used)
                return True
            return False
        # the static arena: one stream-ordered copy from the slot's host memory (a host copy, no transfer,
        # where the device is the host itself)
        copy_rows(buf, dev, used)
        return buf.dev is not buf.cpu

    def grow(self, nbytes: int, used: int, seq: int) -> None:
        """Replace the arena with one that holds ``nbytes`` more (the old one stays alive until reuse)."""
        cap = self.cap
        if self.static is not None:
            raise UsageError(
                f"StepStager(static=True): step {seq} needs more than the {cap} bytes of its static arena; "
                "growing would move the addresses a captured CUDA graph reads. Construct the stager with "
                f"capacity >= {2 * cap + nbytes}."
            )
        buf = self.buf
        if buf.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise UsageError(
                f"StepStager: step {seq} needs more than the slot's {cap} bytes while a "
                "CUDA graph is being captured; growing would move addresses the graph reads. "
                f"Construct the stager with capacity >= {2 * cap + nbytes}."
            )
        need = (used + ALIGN) + nbytes
        new_cap = max(2 * cap, 1 << max(need - 1, 1).bit_length())
        ensure_buffers_room(  # the new arena, and the scratch arena _host_of makes on UVA and HOST
            f"StepStager: step {seq} growing a slot to {new_cap} bytes",
            1,
            (new_cap,),
            torch.uint8,
            buf.tier,
            buf.device.type,
            extra=0 if buf.copies or self.in_place else new_cap,
            fix="Nothing was staged by this call, and what the step staged before stays staged. Stage less "
            "in one step, or free host memory",
        )
        new = self.ring.grow(self.i, lambda tier: make_buffer(new_cap, torch.uint8, buf.device, tier))
        self.buf, self.dev_arena, self.cap = new, new.dev, new_cap
        self.host = self._host_of(new)
        self.layout.clear()  # (the ring empties the slot's views)
        if self.check:  # a new arena reads poison too until the step is published
            self.poison()

    def poison(self) -> None:
        """Check mode: what this slot published before is released, and nothing new is published yet."""
        self.host.fill(POISON)
        if self.static is not None:
            self.static.fill_(POISON)
        else:
            self.buf.poison()

    def view(self, off: int, dtype: np.dtype, shape: tuple[int, ...]) -> tuple[np.ndarray, torch.Tensor]:
        key = (off, dtype, shape)
        v: tuple[np.ndarray, torch.Tensor] | None = self.views.get(key)
        if v is None:
            n = math.prod(shape)
            host = self.host[off : off + n * dtype.itemsize].view(dtype).reshape(shape)
            base = arena_as(self.views, self.dev_arena, dtype)
            first = off // dtype.itemsize
            dev = base[first : first + n]
            if len(shape) != 1:
                dev = dev.view(shape)
            v = self.views.put(key, (host, dev))
        return v


class _StepState:
    """What a step changes as it stages, in plain slots (no sealed ``__setattr__`` per write)."""

    __slots__ = ("calls", "used", "layout", "retired", "done")

    def __init__(self, layout: list[_LayoutEntry]):
        self.calls = self.used = 0  # stage() calls and arena bytes used so far
        self.layout: list[_LayoutEntry] | None = layout  # the slot's, replayed while it repeats (None: off)
        self.retired: list[tuple[StagingBuffer, np.ndarray, int]] = []  # (buffer, host, used) grown out of
        self.done = False


class Step(Sealed):
    """One step's staging, made by :meth:`StepStager.step`: a context manager; ``flush()`` ends it early.

    Tensors from ``stage()`` hold their data from the step's publication (leaving the block, or ``flush()``)
    until the step that reuses the slot begins, ``max_concurrency`` steps later, on every tier; before, the
    slot's old contents (poison in check mode). Leaving by an exception publishes nothing and ends the step.
    Once the step is done, ``stage()`` and ``reserve()`` raise UsageError; a call that raises stages nothing.
    """

    _slot: _Slot
    _seq: int
    _s: _StepState
    _thread: int
    """The thread that began the step."""

    def __init__(self, slot: _Slot, seq: int):
        self._init(_slot=slot, _seq=seq, _s=_StepState(slot.layout), _thread=threading.get_ident())

    @property
    def seq(self) -> int:
        """The step's number (0 for a stager's first)."""
        return self._seq

    @property
    def done(self) -> bool:
        """Whether the step was published (or left by an exception)."""
        return self._s.done

    def __enter__(self) -> Step:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.flush()
        else:
            self._s.done = True

    def stage(self, x: HostData, dtype: DTypeLike | None = None) -> torch.Tensor:
        """Write ``x`` into this step's arena; the device tensor that holds it once the step is published.

        Parameters
        ----------
        x : list, tuple, numpy.ndarray or CPU tensor
            1-D or 2-D host data.
        dtype : torch.dtype, numpy.dtype, type, str or None, optional
            The element type; None (the default) is the input's own (int64 or float64 for Python lists).

        Raises
        ------
        UsageError
            If the step is done, or needs more than the arena holds and cannot grow (a static stager, or a
            CUDA graph is being captured).
        ArgumentTypeError, InvalidArgumentError
            ArgumentTypeError if ``x`` or its dtype (or ``dtype``) is not supported; InvalidArgumentError if
            ``x`` is not 1-D or 2-D, is on another device or holds a value ``dtype`` cannot hold exactly.
        DeviceAllocationError, HostAllocationError
            If growing the slot runs out of device memory, or of host memory (checked before allocating);
            the step and what it staged are as they were.
        """
        s = self._s
        layout = s.layout
        i = s.calls
        if type(x) is np.ndarray and layout is not None and i < len(layout) and not s.done:
            np_dtype, shape, host, dev, end, torch_dtype = layout[i]
            if x.shape == shape and x.dtype == np_dtype and (dtype is None or dtype is torch_dtype):
                host[...] = x  # the same array as last time in this slot: just write it
                s.calls = i + 1
                s.used = end
                return dev
        return self._stage(x, dtype)

    def _stage(self, x: HostData, dtype: DTypeLike | None) -> torch.Tensor:
        s = self._s
        if s.done:
            raise UsageError(f"step {self._seq} was already flushed; begin a new step()")
        if self._slot.ring.thread is not None:
            self._slot.ring.thread.check()
        want = TORCH_TO_NUMPY.get(dtype) if isinstance(dtype, torch.dtype) else None
        arr = x if type(x) is np.ndarray else None
        fits = arr is not None and arr.ndim in (1, 2) and arr.dtype in NUMPY_TO_TORCH
        if arr is None or not fits or (dtype is not None and arr.dtype != want):
            arr = host_array(x, dtype, "x")
        off = self._room(arr.nbytes)
        host, dev = self._slot.view(off, arr.dtype, arr.shape)
        host[...] = arr
        layout = s.layout
        if layout is not None:
            del layout[s.calls :]
            layout.append((arr.dtype, arr.shape, host, dev, s.used, NUMPY_TO_TORCH[arr.dtype]))
        s.calls += 1
        return dev

    def _room(self, nbytes: int) -> int:
        """The offset of ``nbytes`` more in the slot's arena (grown if needed); they count as used."""
        s, slot = self._s, self._slot
        used = s.used
        off = (used + ALIGN - 1) & -ALIGN
        if not nbytes:  # an empty array fits anywhere: no growth (it would leave the step nothing to publish)
            return min(off, slot.cap)
        if off + nbytes > slot.cap:
            old = (slot.buf, slot.host, used)
            slot.grow(nbytes, used, self._seq)  # (raising, it leaves the slot and the step as they were)
            s.retired.append(old)
            s.layout = None  # offsets restart in the new arena: record it next step
            off = 0
        s.used = off + nbytes
        return off

    def reserve(self, nbytes: int) -> tuple[np.ndarray, torch.Tensor, int]:
        """``nbytes`` of this step's arena for the caller to fill before the flush: the host bytes, the device
        arena and the offset in it where the device reads them once published. Raises InvalidArgumentError
        unless ``nbytes`` is an int >= 0."""
        if type(nbytes) is not int or nbytes < 0:
            raise InvalidArgumentError(f"nbytes={nbytes!r}; allowed: an int >= 0")
        s = self._s
        if s.done:
            raise UsageError(f"step {self._seq} was already flushed; begin a new step()")
        if s.layout is not None:
            del s.layout[s.calls :]
            s.layout = None
        off = self._room(nbytes)
        slot = self._slot
        return slot.host[off : off + nbytes], slot.dev_arena, off

    def typed(self, dtype: np.dtype) -> torch.Tensor:
        """The device arena of :meth:`reserve` viewed as ``dtype``, made once per slot arena (a slice of it is
        then one torch call); ArgumentTypeError if ``dtype`` is not a numpy dtype stagebuf stages."""
        if not isinstance(dtype, np.dtype) or dtype not in NUMPY_TO_TORCH:
            allowed = ", ".join(sorted(str(d) for d in NUMPY_TO_TORCH))
            raise ArgumentTypeError(f"dtype={dtype!r}; allowed: a numpy dtype ({allowed})")
        slot = self._slot
        return arena_as(slot.views, slot.dev_arena, dtype)

    def flush(self) -> None:
        """Publish what this step staged (leaving the ``with`` block calls it; again, a no-op): one copy on
        the current stream on PINNED and PAGEABLE, a host copy on UVA and HOST; a static stager copies into
        its device arena."""
        s = self._s
        if s.done:
            return
        slot = self._slot
        if slot.ring.thread is not None:
            slot.ring.thread.check()
        for buf, host, used in s.retired:  # a growth mid-step: earlier tensors stay valid
            if used:
                slot.publish(buf, host, used)
        if s.used and slot.publish(slot.buf, slot.host, s.used):
            slot.ring.count(s.used)
        s.done = True


class StepStager(Sealed):
    """Coalesced per-step staging with a slot-reuse guard: all of a step's arrays, one transfer.

    ``max_concurrency`` (at least 2), ``static``, ``in_place`` and ``device`` are the arguments, resolved.

    Parameters
    ----------
    device : torch.device, str, int or None, optional
        The target device, as for :func:`capabilities`.
    capacity : int, default 1 MiB
        Bytes per slot, >= 16 (a slot grows when a step needs more, unless ``static``).
    max_concurrency : int or None, optional
        Steps in flight (slots), 1 to 1024, raised to at least 2; None: :func:`set_default_max_concurrency`'s.
    guard : {"auto", "wait", "raise", "off"}, default "auto"
        As for :class:`UvaBufferPool`; a slot's consumers count as enqueued when the next step begins, or at
        ``mark_consumed()``.
    static : bool, default False
        Same device addresses every step (CUDA graphs): publishing copies the step into one fixed device arena
        that never grows; stage the same shapes in the same order as at capture.
    in_place : bool, default False
        Write each step straight into its slot on UVA and HOST too (no copy at publish); only if no reader of
        a step's tensors is enqueued before its flush (it would see the writes land). Off in check mode.
    tier : Tier, str or None, optional
        The slots' tier, as for :func:`make_buffer`: None, the device's; or a worse copy tier, e.g.
        ``"pinned"`` where the kernels read each staged array many times (an eager forward reads its inputs
        in every layer: one copy into device memory beats reading host memory through UVA each time).

    Raises
    ------
    InvalidArgumentError, ArgumentTypeError
        InvalidArgumentError if ``capacity``, ``max_concurrency``, ``guard`` or ``tier`` is not as allowed
        above; ArgumentTypeError if ``static`` or ``in_place`` is not a bool.
    TierUnavailableError
        If ``tier`` cannot work on the device (the message lists the allowed tiers).
    DeviceAllocationError, HostAllocationError
        If the device (or the host, checked before allocating) runs out of memory for the slots (or the
        static arena).
    SetupError, TierUnavailableError, ArgumentTypeError
        As :func:`capabilities` raises them for ``device`` and the settings.
    """

    def __init__(
        self,
        device: DeviceLike = None,
        capacity: int = 1 << 20,
        max_concurrency: int | None = None,
        guard: GuardMode = "auto",
        static: bool = False,
        in_place: bool = False,
        tier: Tier | str | None = None,
    ):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < ALIGN:
            raise InvalidArgumentError(f"capacity={capacity!r} must be an int >= {ALIGN} (bytes per slot)")
        for name, flag in (("static", static), ("in_place", in_place)):
            if not isinstance(flag, bool):
                raise ArgumentTypeError(f"{name}={flag!r}; allowed: True or False")
        self.max_concurrency = n = slot_count(max_concurrency)
        self.static = static
        # the slots' host memory (and _host_of's scratch arenas; a static arena on the CPU), checked first
        caps = capabilities(device)
        cls = buffer_class(caps, tier)  # the slots' class (a run-time fallback may give some another)
        scratch = 0 if cls.copies or (in_place and not check_mode()) else n * capacity
        dev_type = caps.device.type
        what = f"StepStager(capacity={capacity}): {n} slots"
        fixed = capacity if static and dev_type == "cpu" else 0
        ensure_buffers_room(what, n, (capacity,), torch.uint8, cls.tier, dev_type, extra=scratch + fixed)

        # check mode quarantines released slots, except in a static stager (one device arena for all)
        def make() -> StagingBuffer:
            return make_buffer(capacity, torch.uint8, device, tier)

        self._ring = ring = Ring(
            n, make, guard, "step slot", quarantined=not static, owner="StepStager", views_cap=_MAX_VIEWS
        )
        self.device = ring.device
        arena = alloc_device((capacity,), torch.uint8, self.device) if static else None
        self._check = check_mode()
        self.in_place = in_place and not self._check
        self._slots = [_Slot(ring, i, arena, self.in_place, self._check) for i in range(ring.slots)]
        self._open: Cell[Step | None] = Cell(None)  # the last step begun (a Cell: no sealed setattr per step)
        self._freeze()

    @property
    def tier(self) -> Tier:
        """The slots' tier (the lowest, if a run-time fallback split them)."""
        return self._ring.tier

    @property
    def guard(self) -> str:
        """The guard mode in effect, ``auto`` resolved to ``wait``, ``raise`` or ``off``."""
        return self._ring.mode

    def step(self) -> Step:
        """Begin a step in the next slot, once the guard says its readers are done.

        Raises
        ------
        UsageError
            If the previous step is still open.
        SlotInFlightError, StepRuleError, CudaError
            As :meth:`UvaBufferPool.copy_to_uva` raises them for the next slot.
        """
        last = self._open.value
        if last is not None and not last.done:
            raise UsageError(_still_open(last, "step()"))
        ring = self._ring
        cur, _ = ring.acquire()  # (check mode: the tensors of the step max_concurrency back read poison now)
        slot = self._slots[cur]
        if self._check:
            slot.poison()
        st = self._open.value = Step(slot, ring.publish(cur))
        return st

    def release_thread(self) -> None:
        """Hand this object to another thread, as :meth:`UvaBufferPool.release_thread`."""
        self._ring.release_thread()

    def mark_consumed(self) -> None:
        """Say that the last step's consumers are enqueued: the clock's next event protects its slot. Raises
        UsageError if a step is still open."""
        last = self._open.value
        if last is not None and not last.done:
            raise UsageError(_still_open(last, "mark_consumed()"))
        self._ring.mark()

    def stats(self) -> dict[str, int]:
        """The stager's counters: ``transfers`` (published steps that copied: every non-empty step on PINNED
        and PAGEABLE, and on UVA with ``static=True``), ``bytes`` (their size), ``growths`` (slots replaced by
        larger ones), ``guard_waits`` (times the guard waited for the device) and ``steps`` (steps begun)."""
        return self._ring.stats(steps=True)


def _still_open(last: Step, call: str) -> str:
    """Why ``call`` is refused while ``last`` is open: the step to flush, or the other thread holding it."""
    if last._thread == threading.get_ident():
        return f"step {last.seq} is still open; flush it before {call}"
    return (
        f"step {last.seq} is still open on thread {thread_name(last._thread)}, and {call} was called from "
        f"thread {thread_name()}: a StepStager belongs to one thread at a time (it takes no locks); "
        "give each thread its own stager, or hand it over with release_thread() between steps"
    )
