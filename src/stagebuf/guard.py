"""The slot-reuse guard: one event per step, checked before a slot comes round again.

On UVA the device reads a slot's host memory while kernels run; on PINNED the
asynchronous copy reads it after the host call returned. Rewriting that slot
before the readers are done gives them torn inputs, silently. The guard records
one event when a slot's consumers have been enqueued and, before the slot is
reused, checks it: ``wait`` blocks (and counts the wait), ``raise`` raises
SlotInFlightError, ``off`` skips. ``auto`` is ``wait`` on the tiers whose host
memory the device reads asynchronously (UVA, PINNED) and ``off`` elsewhere,
where stream order already protects single-stream consumers.

Events are cheap CUDA events recorded through cuda-bindings on torch's current
raw stream where cuda-bindings is present (no ``torch.cuda.current_stream()``
object on the hot path), else ``torch.cuda.Event``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import torch

from .tier import Tier

GUARD_MODES = ("auto", "wait", "raise", "off")


class SlotInFlightError(RuntimeError):
    """A slot came round again while the device may still read it (guard='raise')."""


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

    def __init__(self, device: torch.device, cudart: Any):
        self._rt = cudart
        self._idx = device.index if device.index is not None else torch.cuda.current_device()
        with torch.cuda.device(self._idx):
            err, self._ev = cudart.cudaEventCreateWithFlags(cudart.cudaEventDisableTiming)
        if int(err) != 0:
            raise RuntimeError(f"cudaEventCreateWithFlags failed: {err}")
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
            raise RuntimeError(f"cudaEventRecord failed: {err}")

    def query(self) -> bool:
        (err,) = self._query(self._ev)
        if err == self._not_ready:
            return False
        if int(err) != 0:
            raise RuntimeError(f"cudaEventQuery failed: {err}")
        return True

    def synchronize(self) -> None:
        (err,) = self._rt.cudaEventSynchronize(self._ev)
        if int(err) != 0:
            raise RuntimeError(f"cudaEventSynchronize failed: {err}")

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._rt.cudaEventDestroy(self._ev)


def make_event(device: torch.device) -> Event | None:
    """An event for ``device``, or None where work is synchronous (the CPU).

    Tests replace this to fake an unfinished event on a CPU-only machine.
    """
    if device.type != "cuda":
        return None
    if device.index is None or device.index == torch.cuda.current_device():
        # cuda-bindings' runtime records against the calling thread's current device, so
        # the cheap path is only for the current device (one process per GPU, the usual
        # engine layout); an event for another device goes through torch.
        try:
            from .uva import load_cudart

            return _CudartEvent(device, load_cudart())
        except Exception:
            pass
    return _TorchEvent(device)


class SlotGuard:
    """Per-slot events and the reuse check for a ring of ``n`` slots."""

    __slots__ = ("mode", "active", "waits", "_events", "_owner", "_device", "_what")

    def __init__(self, n: int, device: torch.device, mode: str, tier: Tier, what: str = "slot"):
        if mode not in GUARD_MODES:
            raise ValueError(f"guard={mode!r}; allowed: {', '.join(GUARD_MODES)}")
        if mode == "auto":
            mode = "wait" if tier.async_host_reads else "off"
        self.mode = mode
        self._device = device
        self._what = what
        self._events: list[Event | None] = [None] * n
        self._owner: list[int] = [-1] * n
        self.waits = 0
        self.active = mode != "off" and make_event(device) is not None

    def mark(self, slot: int, seq: int) -> None:
        """The consumers of use ``seq`` of ``slot`` have been enqueued: record it."""
        if not self.active:
            return
        ev = self._events[slot]
        if ev is None:
            ev = self._events[slot] = make_event(self._device)
        assert ev is not None
        ev.record()
        self._owner[slot] = seq

    def acquire(self, slot: int, seq: int) -> None:
        """Before use ``seq`` of ``slot``: make sure its last readers are done."""
        if not self.active:
            return
        ev = self._events[slot]
        if ev is None or self._owner[slot] < 0 or ev.query():
            return
        if self.mode == "raise":
            raise SlotInFlightError(
                f"{self._what} {slot} comes round again for use {seq} while use "
                f"{self._owner[slot]} may still be read by the device; add slots "
                "(max_concurrency) or wait for the consumers"
            )
        ev.synchronize()
        self.waits += 1


class SlotRing:
    """A ring of ``n`` slots taken in turn, with the guard that says when one may be reused.

    ``next()`` records the current slot's event (its consumers are enqueued by
    now) and checks the following slot, returning its index without taking it,
    so a caller that fails before ``take()`` leaves the ring as it was.
    """

    __slots__ = ("guard", "n", "cur", "seq", "_marked")

    def __init__(self, n: int, device: torch.device, mode: str, tier: Tier, what: str = "slot"):
        self.guard = SlotGuard(n, device, mode, tier, what)
        self.n = n
        self.cur = -1  # the slot last taken
        self.seq = 0  # uses taken so far
        self._marked = True

    def mark(self) -> None:
        """The current slot's consumers are enqueued: record its event (once per use)."""
        if not self._marked:
            self.guard.mark(self.cur, self.seq - 1)
            self._marked = True

    def next(self) -> int:
        """The slot the next use goes to, once its previous readers are done (per the guard)."""
        self.mark()
        slot = (self.cur + 1) % self.n
        self.guard.acquire(slot, self.seq)
        return slot

    def take(self, slot: int) -> int:
        """Take ``slot`` (from ``next()``) for the next use; returns that use's number."""
        self.cur = slot
        self._marked = False
        self.seq += 1
        return self.seq - 1
