"""The tier ladder: how host data reaches the device, best first."""

from __future__ import annotations

import enum

from .errors import InvalidArgumentError
from .sealed import Sealed, read_only


@read_only({"*": "a tier is a constant of the process; it cannot be changed"})
class Tier(Sealed, enum.IntEnum):
    """How host data reaches the device; an ``IntEnum``, lower is better (``Tier.UVA < Tier.PINNED``).

    :func:`capabilities` chooses one per device; ``STAGEBUF_TIER`` (``uva``, ``pinned``, ``pageable`` or
    ``host``) forces one, and nothing better is then used in the process. ``Tier(value)`` for a value no tier
    has raises InvalidArgumentError; assigning a tier's attribute raises ReadOnlyAttributeError.

    Attributes
    ----------
    copies : bool
        True where publishing host data costs an explicit host-to-device transfer (PINNED, PAGEABLE).
    async_host_reads : bool
        True where the device reads host memory after the host call returned (UVA, PINNED): a host slot must
        then wait for the device before it is rewritten (the slot-reuse guard's job).
    """

    UVA = 0
    """Pinned host memory read by kernels through a device view (zero copies)."""
    PINNED = 1
    """Pinned host memory and one asynchronous copy into device memory."""
    PAGEABLE = 2
    """Plain host memory and a copy into a fixed device buffer."""
    HOST = 3
    """No accelerator; the CPU tensor is the device tensor."""

    copies: bool
    async_host_reads: bool

    @classmethod
    def parse(cls, value: str | Tier, name: str = "tier") -> Tier:
        """The tier ``value`` names: a name in any case, spaces ignored (``"uva"``, ``"PINNED"``), or a Tier
        (returned as is); else InvalidArgumentError, naming the allowed names and ``name`` (what ``value``
        was given as)."""
        if isinstance(value, Tier):
            return value
        try:
            return cls[str(value).strip().upper()]
        except KeyError:
            allowed = ", ".join(t.name.lower() for t in cls)
            raise InvalidArgumentError(f"{name}={value!r} is not a tier; allowed: {allowed}") from None

    @classmethod
    def _missing_(cls, value: object) -> Tier:
        # Tier(value) for a value no tier has: the error names the values (and parse, for names)
        allowed = ", ".join(f"{t.value} ({t.name})" for t in cls)
        raise InvalidArgumentError(
            f"Tier({value!r}): no tier has this value; allowed: {allowed}, or Tier.parse(name) for a name"
        )

    def __str__(self) -> str:
        return self.name


type.__setattr__(Tier, "_COPYABLE", True)  # a value: copies and pickles are the member itself
# Plain member attributes, not properties: the hot paths read them per staged array. Then sealed.
for _t in Tier:
    _t.copies = _t in (Tier.PINNED, Tier.PAGEABLE)
    _t.async_host_reads = _t in (Tier.UVA, Tier.PINNED)
    _t._freeze()
del _t
