"""``make_buffer``: a buffer of the tier ``capabilities()`` chose, falling back one tier at run time."""

from __future__ import annotations

from collections.abc import Sequence

from .._common.errors import PinnedAllocationError, UvaError
from .._common.log import warn_once
from .._common.tier import Tier
from .._common.types import DeviceLike, DTypeLike
from .._tiers.probe import capabilities
from .buffers import StagingBuffer, checked_caps, tier_class


def make_buffer(
    size: int | Sequence[int], dtype: DTypeLike, device: DeviceLike = None, tier: Tier | str | None = None
) -> StagingBuffer:
    """A buffer of the tier chosen for ``device``, or of ``tier``.

    A run-time allocation failure (memlock exhausted, WSL cap, a device view refused) falls back to the next
    tier that can work (a worse one), with one warning per process.

    Parameters
    ----------
    size, dtype, device
        As for :class:`StagingBuffer`.
    tier : Tier, str or None, optional
        ``"uva"``, ``"pinned"``, ``"pageable"``, ``"host"`` or a Tier; None: ``capabilities(device).tier``.
        Allowed: PAGEABLE and HOST on the CPU; on an accelerator, the chosen tier and every worse copy tier.

    Returns
    -------
    StagingBuffer
        A :class:`UvaBuffer`, :class:`PinnedBuffer`, :class:`NonUvaBuffer` or :class:`HostBuffer`.

    Raises
    ------
    InvalidArgumentError, ArgumentTypeError, DeviceAllocationError, SetupError, TierUnavailableError
        As :class:`StagingBuffer` raises them; InvalidArgumentError also if ``tier`` names no tier,
        TierUnavailableError if it cannot work on the device (the message lists the allowed tiers).
    """
    if tier is None:
        caps = capabilities(device)
        want = caps.tier
    else:
        want = Tier.parse(tier)
        caps = checked_caps(want, device, f"make_buffer(tier={want.name.lower()!r})")
    t = want
    while True:
        cls = tier_class(t)
        try:
            return cls(size, dtype, caps.device)
        except (PinnedAllocationError, UvaError) as e:
            nxt = cls.fallback(e)
            if nxt is None:
                raise
            warn_once(
                ("runtime-fallback", str(caps.device), nxt),
                f"a {t.name} buffer could not be made on {caps.device} "
                f"({e}); falling back to tier {nxt.name} for it",
            )
            t = nxt
