"""``Ring``: the staging buffers of one pool, stager, param table or staged-write launcher (their tier,
counters, growth and view caches), handed out in turn under the slot-reuse guard (``guard.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .._bytes.buffers import StagingBuffer
from .._common.cache import BoundedCache
from .._common.convert import NUMPY_TO_TORCH
from .._common.errors import InvalidArgumentError, SlotInFlightError, StepRuleError
from .._common.owner import Owner
from .._common.tier import Tier
from .._tiers.settings import POISON, check_mode, quarantine
from .guard import GUARD_MODES, GuardMode, step_clock

MAX_VIEWS = 1024
"""Layouts a slot's view cache holds (``views_cap`` by default) before it empties itself."""


class Ring:
    """``n`` slots of staging buffers (plus a quarantine in check mode) taken in turn, guarded by the
    device's step clock: ``acquire()`` the next slot, fill it (``grow()`` it first if too small;
    ``typed()`` views its device arena), then ``publish()`` it. ``make()`` makes one slot's buffer;
    ``quarantined``: users read the slots' device tensors themselves, so check mode quarantines and
    poisons released slots; ``mark()``: the current use's consumers are enqueued now; ``mode``: as a
    pool's ``guard``."""

    __slots__ = (
        "mode", "active", "waits", "n", "size", "released", "cur", "seq", "clock", "bufs", "counts",
        "poisons", "_what", "_tick", "_serial", "_owner", "_last_tick", "_last_marked", "_exact",
        "_typed", "_views", "_retired", "thread",
    )  # fmt: skip

    def __init__(
        self,
        n: int,
        make: Callable[[], StagingBuffer],
        mode: GuardMode,
        what: str,
        quarantined: bool = False,
        owner: str = "",
        views_cap: int = MAX_VIEWS,
    ):
        check = check_mode()
        self.thread = Owner(owner) if check and owner else None
        """Check mode: the thread the ring's user (``owner``, its name; none: its user checks) belongs to."""
        extra = quarantine() if quarantined and check else 0
        bufs = [make() for _ in range(n + extra)]
        tier = max(b.tier for b in bufs)
        if not isinstance(mode, str) or mode not in GUARD_MODES:
            raise InvalidArgumentError(f"guard={mode!r}; allowed: {', '.join(GUARD_MODES)}")
        if mode == "auto":
            mode = "wait" if tier.async_host_reads else "off"
        self.mode = mode
        self.clock = step_clock(bufs[0].device)
        self.active = mode != "off" and self.clock.active
        self.waits = 0
        self.n = n
        self.size = size = n + extra
        """Slots: ``n``, plus ``quarantine`` more that a released slot waits in (check mode)."""
        self.released = -1
        """The slot whose use ended when ``acquire()`` last returned (its use ``n`` uses back); -1: none."""
        self.cur = -1  # the slot last taken
        self.seq = 0  # uses taken so far
        self._what = what
        self._tick = [-1] * size  # per slot: the step of its last use
        self._serial = [-1] * size  # per slot: its last use was marked before this event serial
        self._owner = [-1] * size  # per slot: the number of its last use
        self._last_tick = -1  # the step of the current use
        self._last_marked = False
        # check mode: an event of its own per use too, to catch the clock releasing a slot still read
        self._exact: list[int] | None = [-1] * size if self.active and check else None
        self.bufs = bufs
        self.counts = {"transfers": 0, "bytes": 0, "growths": 0}
        self.poisons = quarantined and check
        self._typed: list[BoundedCache[Any, torch.Tensor]] = [BoundedCache(64) for _ in bufs]
        """Per slot: its device arena viewed as each dtype asked for (``typed()``)."""
        self._views: list[BoundedCache[Any, Any]] = [BoundedCache(views_cap) for _ in bufs]
        """Per slot: the user's views of its buffer by layout (``views()``)."""
        self._retired: list[list[StagingBuffer]] = [[] for _ in bufs]
        """Per slot: the buffers its growths replaced, alive while its last use may still read them."""

    @property
    def tier(self) -> Tier:
        """The slots' tier (the lowest, if a run-time fallback split them)."""
        return max(b.tier for b in self.bufs)

    @property
    def device(self) -> torch.device:
        return self.bufs[0].device

    @property
    def slots(self) -> int:
        """The slot count (quarantine included)."""
        return len(self.bufs)

    def buf(self, slot: int) -> StagingBuffer:
        """``slot``'s buffer."""
        return self.bufs[slot]

    def acquire(self) -> tuple[int, StagingBuffer]:
        """The next slot, once the guard allows, and its buffer; not taken until ``publish()`` (a caller
        that fails in between leaves the ring as it was). Frees what the slot's growths retired, and sets
        ``released`` (the slot of the use ``n`` back; with a quarantine it waits ``quarantine`` uses and,
        in check mode, reads poison from now on)."""
        if self.thread is not None:
            self.thread.check()
        size = self.size
        slot = (self.cur + 1) % size
        g = slot if size == self.n else (slot - self.n) % size  # the slot of the use n back
        self.released = g if self.seq >= self.n else -1
        if self.active:
            clock = self.clock
            if self.cur >= 0:  # cover the current use before checking an older one
                if self._last_marked:
                    if self._serial[self.cur] >= clock.serial:
                        clock.record()
                else:
                    if self._last_tick == clock.tick:
                        clock.end_step()  # this ring stages again: the step it staged in is over
                    if self._exact is not None:  # its consumers are enqueued by now (the ring's contract)
                        self._exact[self.cur] = clock.record()
            owner = self._owner[g]
            if owner >= 0:
                k = self._serial[g]
                if k < 0:
                    k = clock.step_event(self._tick[g])
                if k < 0 or k >= clock.serial:  # not covered yet (cannot happen in order): cover it now
                    k = clock.record()
                if clock.done(k):
                    if self._exact is not None:
                        self._verify(g, owner)
                elif self.mode == "raise":
                    raise SlotInFlightError(
                        f"{self._what} {g} comes round again for use {self.seq} while use "
                        f"{owner} may still be read by the device; add slots "
                        "(max_concurrency) or wait for the consumers"
                    )
                else:
                    clock.wait(k)
                    self.waits += 1
        if self.poisons and self.released >= 0:
            poison(self.bufs[self.released])
        self._retired[slot].clear()
        return slot, self.bufs[slot]

    def _verify(self, slot: int, owner: int) -> None:
        """Check mode: the step clock released ``slot``; its own event must agree."""
        assert self._exact is not None
        k = self._exact[slot]
        clock = self.clock
        if k < 0 or self._serial[slot] >= 0 or not clock.holds(k) or clock.done(k):
            return  # (an event object recorded again since cannot say: no verdict)
        raise StepRuleError(
            f"{self._what} {slot}: the step clock released it for use {self.seq}, but the device may "
            f"still read use {owner}. A ring staged in a step the clock did not see begin (one that "
            "skips steps and stages first in a later one, or stages twice in one step). Fix: call "
            "stagebuf.begin_step() at the start of every step."
        )

    def release_thread(self) -> None:
        """Check mode: the next thread to use the ring takes it (``Owner.release``)."""
        if self.thread is not None:
            self.thread.release()

    def touch(self) -> None:
        """The current use goes on (its slot is read again in this step, not rewritten): the step rule as
        in ``acquire()``, then the slot counts as used in this step."""
        if self.thread is not None:
            self.thread.check()
        cur = self.cur
        if not self.active or cur < 0:
            return
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

    def publish(self, slot: int, nbytes: int | None = None, marked: bool = False) -> int:
        """Take ``slot`` (from ``acquire()``) for the next use; that use's number. ``nbytes``: one transfer
        of that many bytes was issued from it; ``marked``: its consumers are enqueued already."""
        self.cur = slot
        use = self.seq
        self.seq = use + 1
        if self.active:
            t = self.clock.tick
            self._tick[slot] = t
            self._serial[slot] = self.clock.serial if marked else -1
            self._owner[slot] = use
            self._last_tick = t
            self._last_marked = marked
            if self._exact is not None:
                self._exact[slot] = -1
        if nbytes is not None:  # (count()'s two lines: a call costs more than them on this path)
            c = self.counts
            c["transfers"] += 1
            c["bytes"] += nbytes
        return use

    def mark(self) -> None:
        """The current use's consumers are enqueued: the next event recorded protects its slot."""
        if self.active and self.cur >= 0 and not self._last_marked:
            self._serial[self.cur] = self.clock.serial
            self._last_marked = True

    def grow(self, slot: int, make: Callable[[Tier], StagingBuffer]) -> StagingBuffer:
        """Replace ``slot``'s buffer with a larger one of its tier (``make(tier)``); the new buffer.
        The old one stays alive until the slot is acquired again."""
        old = self.bufs[slot]
        self._retired[slot].append(old)
        buf = self.bufs[slot] = make(old.tier)
        self._typed[slot].clear()
        self._views[slot].clear()
        self.counts["growths"] += 1
        return buf

    def typed(self, slot: int, dtype: np.dtype) -> torch.Tensor:
        """``slot``'s whole device arena viewed as ``dtype`` (made once per buffer, see ``arena_as``)."""
        return arena_as(self._typed[slot], self.bufs[slot].dev, dtype)

    def views(self, slot: int) -> BoundedCache[Any, Any]:
        """The user's cache of views of ``slot``'s buffer by layout (emptied at growth, and when full)."""
        return self._views[slot]

    def count(self, nbytes: int) -> None:
        """One transfer of ``nbytes``."""
        c = self.counts
        c["transfers"] += 1
        c["bytes"] += nbytes

    def stats(self, steps: bool = False) -> dict[str, int]:
        """transfers, bytes, growths, guard_waits (and ``steps``: uses taken)."""
        out = {**self.counts, "guard_waits": self.waits}
        if steps:
            out["steps"] = self.seq
        return out


def poison(buf: StagingBuffer) -> None:
    """Fill what ``buf``'s device tensors read with POISON (int -1, float NaN), stream-ordered."""
    if buf.tier.copies:
        buf.dev.view(torch.uint8).fill_(POISON)
    else:  # UVA and HOST: the device reads the host memory itself
        buf.np.view(np.uint8).fill(POISON)


def arena_as(cache: BoundedCache[Any, Any], arena: torch.Tensor, dtype: np.dtype) -> torch.Tensor:
    """The whole byte ``arena`` viewed as ``dtype`` (any trailing partial element left out), made once per
    (arena address, dtype) in ``cache``: a slice of it is then a new typed view's one torch call."""
    key = (arena.data_ptr(), dtype)
    base: torch.Tensor | None = cache.get(key)
    if base is None:
        whole = arena[: arena.shape[0] // dtype.itemsize * dtype.itemsize]
        base = cache.put(key, whole.view(NUMPY_TO_TORCH[dtype]))
    return base
