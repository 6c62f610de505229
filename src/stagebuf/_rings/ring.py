"""``Ring``: the staging buffers of one pool, stager, param table or staged-write launcher (their counters,
growth and view caches), handed out in turn; whether a slot may be rewritten is its ``SlotGuard``'s answer
(``guard.py``), and what a slot's tier does is its buffer's (``uva()``, ``poison()``, the flags)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .._bytes.buffers import StagingBuffer
from .._common.cache import BoundedCache
from .._common.convert import NUMPY_TO_TORCH
from .._common.owner import Owner
from .._common.tier import Tier
from .._tiers.settings import check_mode, quarantine
from .guard import GuardMode, slot_guard

MAX_VIEWS = 1024
"""Layouts a slot's view cache holds (``views_cap`` by default) before it empties itself."""


class Ring:
    """``n`` slots of staging buffers (plus a quarantine in check mode) taken in turn, each reuse admitted by
    the ring's guard: ``acquire()`` the next slot, fill it (``grow()`` it first if too small; ``typed()``
    views its device arena), then ``publish()`` it. ``make()`` makes one slot's buffer; ``quarantined``:
    users read the slots' device tensors themselves, so check mode quarantines and poisons released slots;
    ``mark()``: the current use's consumers are enqueued now; ``mode``: as a pool's ``guard`` (``auto``
    follows the buffers' ``async_host_reads``)."""

    __slots__ = (
        "mode", "guard", "n", "size", "released", "cur", "seq", "bufs", "counts", "poisons", "_auto", "_what",
        "_check", "_typed", "_views", "_retired", "thread",
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
        self.size = size = n + extra
        """Slots: ``n``, plus ``quarantine`` more that a released slot waits in (check mode)."""
        reads_async = any(b.async_host_reads for b in bufs)
        self.mode, self.guard = slot_guard(mode, reads_async, bufs[0].device, size, what, check)
        """The mode in effect (``auto`` resolved) and the guard that admits each reuse (None: none kept)."""
        self._auto = mode == "auto"
        self._what, self._check = what, check
        self.n = n
        self.released = -1
        """The slot whose use ended when ``acquire()`` last returned (its use ``n`` uses back); -1: none."""
        self.cur = -1  # the slot last taken
        self.seq = 0  # uses taken so far
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
    def active(self) -> bool:
        """Whether a guard admits each reuse (not ``off``, and the device has events)."""
        return self.guard is not None

    @property
    def waits(self) -> int:
        """Times the guard waited for the device."""
        return 0 if self.guard is None else self.guard.waits

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
        """The next slot, once the guard admits it, and its buffer; not taken until ``publish()`` (a caller
        that fails in between leaves the ring as it was). Frees what the slot's growths retired, and sets
        ``released`` (the slot of the use ``n`` back; with a quarantine it waits ``quarantine`` uses and,
        in check mode, reads poison from now on)."""
        if self.thread is not None:
            self.thread.check()
        size = self.size
        slot = (self.cur + 1) % size
        g = slot if size == self.n else (slot - self.n) % size  # the slot of the use n back
        self.released = g if self.seq >= self.n else -1
        if self.guard is not None:
            self.guard.admit(self.cur, g, self.seq)
        if self.poisons and self.released >= 0:
            self.bufs[self.released].poison()
        self._retired[slot].clear()
        return slot, self.bufs[slot]

    def release_thread(self) -> None:
        """Check mode: the next thread to use the ring takes it (``Owner.release``)."""
        if self.thread is not None:
            self.thread.release()

    def touch(self) -> None:
        """The current use goes on (its slot is read again in this step, not rewritten): the step rule as
        in ``acquire()``, then the slot counts as used in this step."""
        if self.thread is not None:
            self.thread.check()
        if self.guard is not None and self.cur >= 0:
            self.guard.touch(self.cur)

    def publish(self, slot: int, nbytes: int | None = None, marked: bool = False) -> int:
        """Take ``slot`` (from ``acquire()``) for the next use; that use's number. ``nbytes``: one transfer
        of that many bytes was issued from it; ``marked``: its consumers are enqueued already."""
        self.cur = slot
        use = self.seq
        self.seq = use + 1
        if self.guard is not None:
            self.guard.took(slot, use, marked)
        if nbytes is not None:  # (count()'s two lines: a call costs more than them on this path)
            c = self.counts
            c["transfers"] += 1
            c["bytes"] += nbytes
        return use

    def mark(self) -> None:
        """The current use's consumers are enqueued: the next event recorded protects its slot."""
        if self.guard is not None and self.cur >= 0:
            self.guard.mark(self.cur)

    def grow(self, slot: int, make: Callable[[Tier], StagingBuffer]) -> StagingBuffer:
        """Replace ``slot``'s buffer with a larger one of its tier (``make(tier)``); the new buffer.
        The old one stays alive until the slot is acquired again."""
        old = self.bufs[slot]
        self._retired[slot].append(old)
        buf = self.bufs[slot] = make(old.tier)
        if self._auto and self.guard is None and buf.async_host_reads:  # (a run-time fallback's class)
            self.mode, self.guard = slot_guard("auto", True, buf.device, self.size, self._what, self._check)
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
        out = {**self.counts, "guard_waits": 0 if self.guard is None else self.guard.waits}
        if steps:
            out["steps"] = self.seq
        return out


def arena_as(cache: BoundedCache[Any, Any], arena: torch.Tensor, dtype: np.dtype) -> torch.Tensor:
    """The whole byte ``arena`` viewed as ``dtype`` (any trailing partial element left out), made once per
    (arena address, dtype) in ``cache``: a slice of it is then a new typed view's one torch call."""
    key = (arena.data_ptr(), dtype)
    base: torch.Tensor | None = cache.get(key)
    if base is None:
        whole = arena[: arena.shape[0] // dtype.itemsize * dtype.itemsize]
        base = cache.put(key, whole.view(NUMPY_TO_TORCH[dtype]))
    return base
