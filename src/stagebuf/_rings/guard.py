"""The slot-reuse guard: one event per step for a whole device (``StepClock``), and per ring a ``SlotGuard``
that records each slot's last use and says whether a slot may be rewritten (else it waits, raises, or in
check mode verifies against the ring's own event), so that no reader of a slot (UVA kernels, a PINNED copy)
reads torn inputs (docs/DESIGN.md, "Rings and the guard"). Events go through cuda-bindings where present (no
``torch.cuda.current_stream()`` object per step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from types import ModuleType
from typing import Literal, Protocol

import torch

from .._common.errors import CudaError, InvalidArgumentError, SlotInFlightError, StepRuleError
from .._common.log import warn_once
from .._common.types import DeviceLike
from .._device.uva import load_cudart
from .._tiers.probe import capabilities
from .._tiers.settings import DEFAULT_MAX_CONCURRENCY

GuardMode = Literal["auto", "wait", "raise", "off"]
GUARD_MODES: tuple[GuardMode, ...] = ("auto", "wait", "raise", "off")


_DEFAULT_MAX_CONCURRENCY = DEFAULT_MAX_CONCURRENCY
MAX_SLOTS = 1024  # the most slots one ring may have (each is a buffer; an engine keeps a few steps in flight)


def set_default_max_concurrency(n: int) -> None:
    """Set the slot count of the rings made afterwards with ``max_concurrency=None`` (pools, stagers,
    parameter tables, staged writers); those made before keep theirs. The default is 2.

    Parameters
    ----------
    n : int
        The slot count; below 2 is raised to 2 (a ring fills a second slot while the device reads the first).

    Raises
    ------
    InvalidArgumentError
        If ``n`` is not an int in [1, 1024] (a ``bool`` is refused).
    """
    global _DEFAULT_MAX_CONCURRENCY
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SLOTS:
        raise InvalidArgumentError(
            f"n={n!r} must be an int in [1, {MAX_SLOTS}] (values below 2 are raised to 2)"
        )
    _DEFAULT_MAX_CONCURRENCY = max(2, n)


def slot_count(n: int | None) -> int:
    """The slot count of a ring: ``n`` (its ``max_concurrency``), or the default; at least 2."""
    if n is None:
        return _DEFAULT_MAX_CONCURRENCY
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SLOTS:
        raise InvalidArgumentError(f"max_concurrency={n!r} must be None or an int in [1, {MAX_SLOTS}]")
    if n == 1:
        warn_once(
            "max-concurrency-1",
            "max_concurrency=1 is raised to 2: one slot the device reads while the host fills the other "
            "(with one, every call would wait for the device)",
        )
    return max(2, n)


class Event(Protocol):
    def record(self) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class _TorchEvent:
    __slots__ = ("_ev", "_device")

    def __init__(self, device: torch.device):
        self._device = device
        with torch.cuda.device(device):
            self._ev = torch.cuda.Event()

    def record(self) -> None:
        # the current stream *of the event's device*, whichever device is current
        self._ev.record(torch.cuda.current_stream(self._device))

    def query(self) -> bool:
        return bool(self._ev.query())

    def synchronize(self) -> None:
        self._ev.synchronize()


class _CudartEvent:
    """A CUDA event driven through cuda-bindings on torch's current raw stream."""

    __slots__ = ("_ev", "_rt", "_idx", "_record", "_query", "_stream", "_not_ready")

    def __init__(self, device: torch.device, cudart: ModuleType):
        self._rt = cudart
        self._idx = device.index if device.index is not None else torch.cuda.current_device()
        with torch.cuda.device(self._idx):
            err, self._ev = cudart.cudaEventCreateWithFlags(cudart.cudaEventDisableTiming)
        if int(err) != 0:
            raise CudaError(f"cudaEventCreateWithFlags failed: {err}")
        self._record = cudart.cudaEventRecord
        self._query = cudart.cudaEventQuery
        self._stream = torch._C._cuda_getCurrentRawStream
        self._not_ready = cudart.cudaError_t.cudaErrorNotReady

    def record(self) -> None:
        (err,) = self._record(self._ev, self._stream(self._idx))
        if int(err) != 0:  # the caller switched its current device since: record under ours
            with torch.cuda.device(self._idx):
                (err,) = self._record(self._ev, self._stream(self._idx))
        if int(err) != 0:
            raise CudaError(f"cudaEventRecord failed: {err}")

    def query(self) -> bool:
        (err,) = self._query(self._ev)
        if err == self._not_ready:
            return False
        if int(err) != 0:
            raise CudaError(f"cudaEventQuery failed: {err}")
        return True

    def synchronize(self) -> None:
        (err,) = self._rt.cudaEventSynchronize(self._ev)
        if int(err) != 0:
            raise CudaError(f"cudaEventSynchronize failed: {err}")

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._rt.cudaEventDestroy(self._ev)


def make_event(device: torch.device) -> Event | None:
    """An event for ``device``, or None where work is synchronous (the CPU)."""
    if device.type != "cuda":
        return None
    if device.index is None or device.index == torch.cuda.current_device():
        # cuda-bindings records on the calling thread's current device: the cheap path is for that device
        # only (one process per GPU, the usual engine layout); another device's event goes through torch
        with contextlib.suppress(Exception):
            return _CudartEvent(device, load_cudart())
    return _TorchEvent(device)


EventFactory = Callable[[torch.device], Event | None]
"""Makes an event for a device (None where work is synchronous): ``make_event``, or a test's fake."""

_CLOCK_EVENTS = 64  # event objects a clock records in turn; before reuse each is asked once if it completed
_TICKS = 4096  # steps (and events) whose event and completion a clock remembers (docs/DESIGN.md has the rule)


class StepClock:
    """One event per step for every ring on one device, on its current stream, protecting every slot used in
    the step. A step ends when a ring that already staged in it stages again, or at ``begin_step()``. A ring
    whose consumer is enqueued inside the call (an apply, a sync) marks its use: the next event protects it
    (the ring records one itself at its next use if none came since).
    """

    __slots__ = (
        "device", "factory", "active", "tick", "serial", "_events", "_done", "_tick_end", "_complete", "held",
    )  # fmt: skip

    def __init__(self, device: torch.device, factory: EventFactory):
        self.device = device
        self.factory = factory
        self.tick = 0  # the current step
        self.serial = 0  # events recorded so far (the next event's serial)
        self._events: list[Event | None] = [None] * _CLOCK_EVENTS
        self._done = [-1] * _CLOCK_EVENTS  # per event object: the latest serial known to be complete
        self.held = [-1] * _CLOCK_EVENTS  # per event object: the serial it was last recorded as
        self._tick_end = [-1] * _TICKS  # per step (mod _TICKS): the serial of the event that ended it
        self._complete = [-1] * _TICKS  # per serial (mod _TICKS): that serial, once known to have completed
        self.active = factory(device) is not None

    def record(self) -> int:
        """Record an event now; its serial."""
        k = self.serial
        i = k % _CLOCK_EVENTS
        ev = self._events[i]
        if ev is None:
            ev = self._events[i] = self.factory(self.device)
        else:  # learn whether its last recording completed before it stands for another
            old = self.held[i]
            if old >= 0 and self._done[i] < old and self._complete[old % _TICKS] != old and ev.query():
                self._complete[old % _TICKS] = old
        assert ev is not None
        ev.record()
        self.held[i] = k
        self.serial = k + 1
        return k

    def end_step(self) -> None:
        """Record the event that ends the current step, and begin the next."""
        self._tick_end[self.tick % _TICKS] = self.record()
        self.tick += 1

    def holds(self, k: int) -> bool:
        """Whether event ``k``'s object still stands for ``k`` (not recorded again since for a later one)."""
        return self.held[k % _CLOCK_EVENTS] == k

    def step_event(self, tick: int) -> int:
        """The serial of the event that ended step ``tick`` (-1: none recorded yet)."""
        # (a recycled entry: a later step's event, safe to wait for)
        return -1 if tick >= self.tick else self._tick_end[tick % _TICKS]

    def done(self, k: int) -> bool:
        """Whether event ``k`` (or a later one in its place) has completed; asks the device once."""
        i = k % _CLOCK_EVENTS
        if self._done[i] >= k or self._complete[k % _TICKS] == k:
            return True
        ev = self._events[i]
        if ev is None or ev.query():
            self._done[i] = max(k, self._done[i])
            return True
        return False

    def wait(self, k: int) -> None:
        i = k % _CLOCK_EVENTS
        ev = self._events[i]
        if ev is not None:
            ev.synchronize()
        self._done[i] = max(k, self._done[i])


_clocks: dict[str, StepClock] = {}


def slot_guard(
    mode: GuardMode, reads_async: bool, device: torch.device, size: int, what: str, check: bool
) -> tuple[GuardMode, SlotGuard | None]:
    """The guard mode in effect (``auto``: ``wait`` where ``reads_async``, the device reading a slot's host
    memory after the host call returned; else ``off``) and the guard of a ring of ``size`` slots on ``device``
    (None: off, or no events there). InvalidArgumentError for a mode not in GUARD_MODES."""
    if not isinstance(mode, str) or mode not in GUARD_MODES:
        raise InvalidArgumentError(f"guard={mode!r}; allowed: {', '.join(GUARD_MODES)}")
    if mode == "auto":
        mode = "wait" if reads_async else "off"
    clock = step_clock(device)
    if mode == "off" or not clock.active:
        return mode, None
    return mode, SlotGuard(clock, size, mode, what, check)


class SlotGuard:
    """The slot-reuse policy of one ring on its device's step clock. Per slot it records the last use: the
    step it was taken in, the event serial it was marked before (-1: unmarked) and the use's number; in check
    mode also the ring's own event per use. The ring asks ``admit()`` before a slot comes round and reports
    each use (``took``, ``touch``, ``mark``); ``mode``: ``wait`` or ``raise``; ``waits`` counts the waits."""

    __slots__ = (
        "clock", "mode", "what", "waits", "_tick", "_serial", "_owner", "_last_tick", "_last_marked",
        "_exact",
    )  # fmt: skip

    def __init__(self, clock: StepClock, size: int, mode: GuardMode, what: str, check: bool):
        self.clock = clock
        self.mode = mode
        self.what = what
        self.waits = 0
        self._tick = [-1] * size  # per slot: the step of its last use
        self._serial = [-1] * size  # per slot: its last use was marked before this event serial
        self._owner = [-1] * size  # per slot: the number of its last use
        self._last_tick = -1  # the step of the current use
        self._last_marked = False
        # check mode: an event of its own per use too, to catch the clock releasing a slot still read
        self._exact: list[int] | None = [-1] * size if check else None

    def admit(self, cur: int, slot: int, use: int) -> None:
        """Before use ``use`` may rewrite ``slot``'s memory (``cur``: the slot of the current use, -1:
        none): cover the current use with an event, then return once ``slot``'s last use is done, waiting for
        it in mode ``wait``, raising SlotInFlightError in mode ``raise``; in check mode, StepRuleError where
        the clock released it while the ring's own event for that use is pending."""
        clock = self.clock
        if cur >= 0:  # cover the current use before checking an older one
            if self._last_marked:
                if self._serial[cur] >= clock.serial:
                    clock.record()
            else:
                if self._last_tick == clock.tick:  # this ring stages again: the step it staged in is over
                    clock._tick_end[clock.tick % _TICKS] = clock.record()  # (clock.end_step(), inlined)
                    clock.tick += 1
                if self._exact is not None:  # its consumers are enqueued by now (the ring's contract)
                    self._exact[cur] = clock.record()
        owner = self._owner[slot]
        if owner < 0:
            return
        k = self._serial[slot]
        if k < 0:  # unmarked: the event that ended its step (clock.step_event, inlined)
            t = self._tick[slot]
            k = -1 if t >= clock.tick else clock._tick_end[t % _TICKS]
        if k < 0 or k >= clock.serial:  # not covered yet (cannot happen in order): cover it now
            k = clock.record()
        # clock.done(k), its known-complete test inlined (another ring of the device often asked already)
        if clock._done[k % _CLOCK_EVENTS] >= k or clock.done(k):
            if self._exact is not None:
                self._verify(slot, owner, use)
        elif self.mode == "raise":
            raise SlotInFlightError(
                f"{self.what} {slot} comes round again for use {use} while use "
                f"{owner} may still be read by the device; add slots "
                "(max_concurrency) or wait for the consumers"
            )
        else:
            clock.wait(k)
            self.waits += 1

    def _verify(self, slot: int, owner: int, use: int) -> None:
        """Check mode: the step clock released ``slot``; its own event must agree."""
        assert self._exact is not None
        k = self._exact[slot]
        clock = self.clock
        if k < 0 or self._serial[slot] >= 0 or not clock.holds(k) or clock.done(k):
            return  # (an event object recorded again since cannot say: no verdict)
        raise StepRuleError(
            f"{self.what} {slot}: the step clock released it for use {use}, but the device may "
            f"still read use {owner}. A ring staged in a step the clock did not see begin (one that "
            "skips steps and stages first in a later one, or stages twice in one step). Fix: call "
            "stagebuf.begin_step() at the start of every step."
        )

    def took(self, slot: int, use: int, marked: bool) -> None:
        """Use ``use`` took ``slot`` in the current step; ``marked``: its consumers are enqueued already."""
        clock = self.clock
        t = clock.tick
        self._tick[slot] = t
        self._serial[slot] = clock.serial if marked else -1
        self._owner[slot] = use
        self._last_tick = t
        self._last_marked = marked
        if self._exact is not None:
            self._exact[slot] = -1

    def touch(self, cur: int) -> None:
        """The current use (in ``cur``) goes on into this step: the step rule as in ``admit()``, then it
        counts as taken in this step."""
        clock = self.clock
        if self._last_marked:
            if self._serial[cur] >= clock.serial:
                clock.record()
        elif self._last_tick == clock.tick:
            clock.end_step()
        t = clock.tick
        self._tick[cur] = t
        self._serial[cur] = -1
        self._last_tick = t
        self._last_marked = False
        if self._exact is not None:
            self._exact[cur] = -1

    def mark(self, cur: int) -> None:
        """The current use's (in ``cur``) consumers are enqueued: the next event recorded protects it."""
        if not self._last_marked:
            self._serial[cur] = self.clock.serial
            self._last_marked = True


def step_clock(device: torch.device) -> StepClock:
    """The clock shared by every ring on ``device``."""
    key = str(device)
    clock = _clocks.get(key)
    if clock is None:
        clock = _clocks[key] = StepClock(device, make_event)
    return clock


def begin_step(device: DeviceLike = None) -> None:
    """Begin a step on ``device``'s step clock: record the event that ends the last step.

    The clock finds step boundaries itself when every ring stages once per step; an engine with a ring that
    skips steps (or stages twice in one) calls this at each step's start. It does nothing on the CPU.

    Parameters
    ----------
    device : torch.device, str, int or None, optional
        The device whose clock to advance, as for :func:`capabilities`.

    Raises
    ------
    CudaError
        If recording the CUDA event fails.
    SetupError, TierUnavailableError, ArgumentTypeError
        As :func:`capabilities` raises them for ``device`` and the settings.
    """
    dev = capabilities(device).device
    clock = step_clock(dev)
    if clock.active:
        clock.end_step()
