"""``Ring``: the staging buffers of one pool, stager, param table or staged-write launcher.

One abstraction for every ring: it owns its buffers (one per slot), their tier,
the transfer counters and growth, and takes slots in turn under the slot-reuse
guard (``SlotRing``, :mod:`stagebuf._guard`). In check mode a ring whose slots
users read directly (pools, stagers) keeps ``STAGEBUF_CHECK_QUARANTINE`` more
slots: a released slot is poisoned and waits that many uses before it is taken
again, so a too-late read reads poison, as AddressSanitizer quarantines freed
memory.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ._buffers import StagingBuffer
from ._constants import POISON, check_mode, quarantine
from ._guard import GuardMode, SlotRing
from ._tier import Tier


def _counters() -> dict[str, int]:
    return {"transfers": 0, "bytes": 0, "growths": 0}


class Ring(SlotRing):
    """``n`` slots of staging buffers (plus a quarantine in check mode) taken in turn, guarded.

    ``make()`` makes one slot's buffer. ``quarantined``: users read the slots' device
    tensors themselves (pools, stagers), so check mode quarantines released slots.
    """

    __slots__ = ("bufs", "counts", "poisons")

    def __init__(
        self,
        n: int,
        make: Callable[[], StagingBuffer],
        mode: GuardMode,
        what: str,
        quarantined: bool = False,
    ):
        extra = quarantine() if quarantined and check_mode() else 0
        bufs = [make() for _ in range(n + extra)]
        super().__init__(n, bufs[0].device, mode, max(b.tier for b in bufs), what, extra)
        self.bufs = bufs
        self.counts = _counters()
        self.poisons = quarantined and check_mode()
        """Check mode on a ring users read: ``poison_released()`` poisons what ``next()`` released."""

    @property
    def tier(self) -> Tier:
        """The slots' tier (the lowest, if a run-time fallback split them)."""
        return max(b.tier for b in self.bufs)

    def grow(self, slot: int, make: Callable[[Tier], StagingBuffer]) -> StagingBuffer:
        """Replace ``slot``'s buffer with a larger one of its tier (``make(tier)``); the new buffer."""
        buf = self.bufs[slot] = make(self.bufs[slot].tier)
        self.counts["growths"] += 1
        return buf

    def count(self, nbytes: int) -> None:
        """One transfer of ``nbytes``."""
        c = self.counts
        c["transfers"] += 1
        c["bytes"] += nbytes

    def poison_released(self) -> None:
        """Check mode: poison the slot ``next()`` released (what its tensors read from now on)."""
        g = self.released
        if self.poisons and g >= 0:
            poison(self.bufs[g])

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
