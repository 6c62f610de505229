"""One buffer interface, one small class per tier; ``make_buffer`` picks the class from ``capabilities()``.

An explicit tier request that cannot work (``STAGEBUF_TIER``, ``make_buffer(tier=)``, a tier class)
raises ``TierUnavailableError`` naming what was asked, why and the allowed values; a tier better than
the one ``STAGEBUF_TIER`` forces cannot work (``UvaBuffer()`` raises under ``STAGEBUF_TIER=pinned``),
a worse one may be asked for (``usable_tiers``). A run-time allocation failure falls back one tier,
warning once per process, in ``make_buffer`` only (the tier classes raise): docs/DESIGN.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from .._common.cache import BoundedCache
from .._common.convert import check_rows, fill_host, shape_of, torch_dtype
from .._common.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    PinnedAllocationError,
    UsageError,
    UvaError,
)
from .._common.sealed import COPY_HINT, Sealed, read_only
from .._common.tier import Tier
from .._common.types import DeviceLike, DTypeLike
from .._device import uva as _uva
from .._device.memory import alloc_device, alloc_host, ensure_host_room, nbytes_of
from .._tiers.capabilities import Capabilities, device_type
from .._tiers.probe import capabilities, unavailable_error, usable_tiers
from .._tiers.settings import POISON
from .checked import host_view


@read_only(
    {
        "*": f"a buffer's attributes are fixed at construction; {COPY_HINT}",
        "dev": "it is the device storage uva() publishes into, at a fixed address; write .np or .cpu",
        "device": "a buffer stays on the device it was made for; make a new buffer for another device",
        "shape": "the host and device storage are sized at construction; make a new buffer to resize",
        "dtype": "the storage is typed at construction; make a new buffer for another dtype",
        "tier": "it is the class's tier; use make_buffer(..., tier=...) for another tier",
    }
)
class StagingBuffer(Sealed):
    """A host buffer and the way its rows reach the device (the tier).

    The base of the four tier classes (make one with :func:`make_buffer`, or a tier class for that tier). The
    host writes ``.np`` or ``.cpu``; ``uva(n)`` publishes the first ``n`` rows. ``buf.np = x`` (or ``.cpu``)
    copies ``x`` (a scalar, or an array of the buffer's shape) in, checked: InvalidArgumentError for another
    shape or a value the dtype cannot hold, ArgumentTypeError for an unsupported type, and nothing is written.
    Other attributes are read-only (ReadOnlyAttributeError).

    Parameters
    ----------
    size : int or sequence of int
        The shape: a row count, or a tuple whose first entry is the row count.
    dtype : torch.dtype, numpy.dtype, type or str
        bool, uint8, int8, int16, int32, int64, float16, float32 or float64.
    device : torch.device, str, int or None, optional
        The target device, as for :func:`capabilities`.

    Attributes
    ----------
    cpu : torch.Tensor
        The host storage (pinned on tiers UVA and PINNED); ``np`` is a numpy view of it.
    dev : torch.Tensor
        The device storage ``uva()`` publishes into, at a fixed address: a view of ``cpu`` on tiers UVA and
        HOST, a separate device tensor on the copy tiers.
    tier : Tier
        The class's tier; ``device``, ``shape`` and ``dtype`` are the arguments, resolved.
    copies, async_host_reads : bool
        The tier's behaviour, as :class:`Tier` documents it: whether ``uva()`` issues a transfer into separate
        device memory, and whether the device reads the host memory after the host call returned (so that a
        ring must wait for the device before rewriting a slot).

    Raises
    ------
    UsageError
        If ``StagingBuffer`` itself is made (it holds no storage).
    InvalidArgumentError, ArgumentTypeError
        InvalidArgumentError if ``size`` is not an int >= 0 or a tuple of them; ArgumentTypeError if ``dtype``
        is not supported, or ``device`` is not None, a str, an int or a torch.device.
    DeviceAllocationError
        If the device runs out of memory for ``dev`` (tiers PINNED and PAGEABLE).
    SetupError, TierUnavailableError
        As :func:`capabilities` raises them for ``device`` and the settings (not :class:`HostBuffer`).
    """

    tier: ClassVar[Tier]
    copies: ClassVar[bool]
    async_host_reads: ClassVar[bool]
    cpu: torch.Tensor
    np: np.ndarray
    device: torch.device
    dev: torch.Tensor

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "tier" in vars(cls):  # a tier's class: its flags are the tier's, unless it states its own
            for flag in ("copies", "async_host_reads"):
                if flag not in vars(cls):
                    setattr(cls, flag, getattr(cls.tier, flag))

    def __init__(self, size: int | Sequence[int], dtype: DTypeLike, device: DeviceLike = None):
        if type(self) is StagingBuffer:
            raise UsageError(
                "StagingBuffer is the base of the tier classes and holds no storage; make a buffer with "
                "make_buffer(size, dtype), or with a tier class: HostBuffer, NonUvaBuffer, PinnedBuffer "
                "or UvaBuffer"
            )
        self.shape = shape_of(size)
        self.dtype = torch_dtype(dtype)
        self._rows: BoundedCache[int | None, tuple[torch.Tensor, torch.Tensor]] = BoundedCache(256)

    _COPY_IN = ("np", "cpu")

    def _copy_in(self, name: str, value: Any) -> None:
        fill_host(self.np, value, self.dtype, f"{type(self).__name__}.{name}")

    def rows(self, n: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``(dev[:n], cpu[:n])`` of the first ``n`` rows (None: all), cached per ``n``; nothing is
        copied. Raises InvalidArgumentError unless ``n`` is None or an int in ``[0, shape[0]]``."""
        try:
            pair = self._rows.get(n)
        except TypeError:  # an unhashable n: check_rows says what n may be
            pair = None
        if pair is None:
            k = check_rows(n, self.shape[0])
            pair = self._rows.put(n, (self.dev[:k], self.cpu[:k]))
        return pair

    def uva(self, n: int | None = None) -> torch.Tensor:
        """Publish the first ``n`` rows (as for :meth:`rows`; None, the default: all): ``dev[:n]``, a view of
        the host storage on tiers UVA and HOST (no copy: later host writes show through), else a view of
        ``dev`` after an asynchronous copy into it on the current stream."""
        return self.rows(n)[0]

    def copy_to(self, out: torch.Tensor, n: int | None = None) -> torch.Tensor:
        """Copy the first ``n`` host rows (``n`` as for :meth:`rows`) into the device tensor ``out`` on the
        current stream; ``out[:n]``. ``out`` must be a tensor (else ArgumentTypeError) on this buffer's
        device, of its dtype and row shape, with at least ``n`` rows (else InvalidArgumentError)."""
        n = check_rows(n, self.shape[0])
        if not isinstance(out, torch.Tensor):
            raise ArgumentTypeError(f"out must be a torch.Tensor; got {type(out).__name__}")
        shape = tuple(out.shape)
        if (
            out.dtype is not self.dtype
            or len(shape) != len(self.shape)
            or shape[0] < n
            or shape[1:] != self.shape[1:]
            or out.device != self.device
        ):
            raise InvalidArgumentError(
                f"out has shape {tuple(out.shape)}, dtype {out.dtype} on {out.device}; expected "
                f"at least {n} rows of shape {self.shape[1:]}, dtype {self.dtype} on {self.device}"
            )
        return copy_rows(self, out, n)

    def poison(self) -> None:
        """Fill what the device reads of this buffer (``dev``, or the host memory it views) with ``0xFF``
        bytes (int -1, float NaN), stream-ordered: check mode's poison for slots nothing may read."""
        self.dev.view(torch.uint8).fill_(POISON)

    @classmethod
    def fallback(cls, error: BaseException) -> Tier | None:
        """The tier :func:`make_buffer` falls back to when making a buffer of this class failed with ``error``
        at run time; None: none, the error stands. ArgumentTypeError if ``error`` is not an exception."""
        if not isinstance(error, BaseException):
            raise ArgumentTypeError(f"error must be an exception; got {type(error).__name__}")
        return None

    @property
    def nbytes(self) -> int:
        """The size of the host storage in bytes."""
        return self.cpu.numel() * self.cpu.element_size()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={self.shape}, dtype={self.dtype}, device={self.device})"


def copy_rows(buf: StagingBuffer, out: torch.Tensor, n: int) -> torch.Tensor:
    """``buf.copy_to(out, n)`` without the checks, for callers that made ``out`` to fit (saves ~1 us)."""
    dst = out[:n]
    dst.copy_(buf.cpu[:n], non_blocking=True)
    return dst


def checked_caps(want: Tier, device: DeviceLike, who: str) -> Capabilities:
    """The capabilities of ``device``, if tier ``want`` may be asked for there; else raise."""
    caps = capabilities(device)
    if want not in usable_tiers(caps):
        raise unavailable_error(want, caps, who)
    return caps


class HostBuffer(StagingBuffer):
    """Tier HOST, no accelerator: the CPU tensor is the device tensor.

    As :class:`StagingBuffer`, but ``device`` must be None or a CPU device (else InvalidArgumentError).
    """

    tier = Tier.HOST

    def poison(self) -> None:
        self.np.view(np.uint8).fill(POISON)

    def __init__(self, size: int | Sequence[int], dtype: DTypeLike, device: DeviceLike = None):
        super().__init__(size, dtype)
        if device is not None and device_type(device, "HostBuffer") != "cpu":
            raise InvalidArgumentError(f"HostBuffer: device={device!r}; allowed: None or 'cpu'")
        self.device = torch.device("cpu")
        self.cpu = alloc_host(self.shape, self.dtype, pinned=False, tier=self.tier)
        self.np = host_view(self.cpu, f"{type(self).__name__}.np")
        self.dev = self.cpu
        self._freeze()


class NonUvaBuffer(StagingBuffer):
    """Tier PAGEABLE: plain (pageable) host memory copied into a fixed device buffer.

    ``device="cpu"`` works on any machine: a separate CPU tensor stands in for device memory. CUDA stages the
    pageable source before the (non-blocking) copy call returns, so the host may rewrite ``.cpu`` at once.
    This tier can be asked for on every device. Arguments and errors: :class:`StagingBuffer`.
    """

    tier = Tier.PAGEABLE

    def __init__(self, size: int | Sequence[int], dtype: DTypeLike, device: DeviceLike = None):
        super().__init__(size, dtype)
        self.device = capabilities(device).device
        self.cpu = alloc_host(self.shape, self.dtype, pinned=False, tier=self.tier)
        self.np = host_view(self.cpu, f"{type(self).__name__}.np")
        self.dev = alloc_device(self.shape, self.dtype, self.device, self.tier)
        self._freeze()

    def uva(self, n: int | None = None) -> torch.Tensor:
        pair = self._rows.get(n) if type(n) is int else None  # (the cache hit without rows()' call)
        dev, host = pair or self.rows(n)
        return dev.copy_(host, non_blocking=True)


class PinnedBuffer(NonUvaBuffer):
    """Tier PINNED: pinned host memory and one asynchronous copy into a fixed device buffer.

    The device reads ``.cpu`` after ``uva()`` returns: rewrite a buffer only once its copy is consumed (pools
    and stagers guard this for you). Arguments and errors: :class:`StagingBuffer`, and:

    Raises
    ------
    TierUnavailableError
        If tier PINNED cannot work on the device (the CPU, no pinned memory, or ``STAGEBUF_TIER`` forces
        PAGEABLE); the message lists the allowed tiers.
    PinnedAllocationError
        If the pinned allocation fails at run time (memlock limit exhausted, say).
    """

    tier = Tier.PINNED

    @classmethod
    def fallback(cls, error: BaseException) -> Tier | None:
        super().fallback(error)
        return Tier.PAGEABLE if isinstance(error, PinnedAllocationError) else None

    def __init__(self, size: int | Sequence[int], dtype: DTypeLike, device: DeviceLike = None):
        StagingBuffer.__init__(self, size, dtype)
        self.device = checked_caps(Tier.PINNED, device, "PinnedBuffer").device
        self.cpu = alloc_host(self.shape, self.dtype, pinned=True, tier=self.tier)
        self.np = host_view(self.cpu, f"{type(self).__name__}.np")
        self.dev = alloc_device(self.shape, self.dtype, self.device, self.tier)
        for hook in UPLOAD_TARGET_HOOKS:
            hook(self.dev)
        self._freeze()


UPLOAD_TARGET_HOOKS: list[Callable[[torch.Tensor], None]] = []
"""Called with each PINNED buffer's device tensor when it is made: an engine that reroutes asynchronous
uploads (vLLM 0.34 under confidential computing) registers the targets it may write in place. stagebuf
rewrites a slot's device tensor only once its readers are done (the guard), which is what that asks."""


class UvaBuffer(StagingBuffer):
    """Tier UVA: pinned host memory that kernels read through a device view, zero copies.

    ``uva()`` returns a view of the host memory: rewrite it only once the kernels reading it are done (pools
    and stagers guard this). Arguments and errors: :class:`StagingBuffer` (no DeviceAllocationError), and:

    Raises
    ------
    TierUnavailableError
        If tier UVA cannot work on the device (the CPU, no cuda-bindings, the UVA probe failed, or
        ``STAGEBUF_TIER`` forces a worse tier); the message lists the allowed tiers.
    PinnedAllocationError
        As for :class:`PinnedBuffer`.
    UvaError
        If the device view of the new allocation cannot be made or does not alias it.
    """

    tier = Tier.UVA

    def poison(self) -> None:
        self.np.view(np.uint8).fill(POISON)

    @classmethod
    def fallback(cls, error: BaseException) -> Tier | None:
        super().fallback(error)
        # no pinned memory: PINNED would fail the same way, so PAGEABLE; a refused view: PINNED
        if isinstance(error, PinnedAllocationError):
            return Tier.PAGEABLE
        return Tier.PINNED if isinstance(error, UvaError) else None

    def __init__(self, size: int | Sequence[int], dtype: DTypeLike, device: DeviceLike = None):
        super().__init__(size, dtype)
        self.device = checked_caps(Tier.UVA, device, "UvaBuffer").device
        self.cpu = alloc_host(self.shape, self.dtype, pinned=True, tier=self.tier)
        self.np = host_view(self.cpu, f"{type(self).__name__}.np")
        self.dev = _uva.device_view(self.cpu, self.device)
        self._freeze()


TIER_CLASSES: dict[Tier, type[StagingBuffer]] = {}
"""The ladder: each tier's buffer class, best tier first (``make_buffer`` and the rings read it; a run-time
failure moves down it by the class's :meth:`~StagingBuffer.fallback`)."""


def register_tier_class(cls: type[StagingBuffer]) -> type[StagingBuffer]:
    """Make ``cls`` the buffer class of its ``tier`` (the one extension point of the ladder: the four tiers'
    classes are registered by it); the class it replaces is returned by ``TIER_CLASSES`` no more."""
    TIER_CLASSES[cls.tier] = cls
    return cls


def tier_class(tier: Tier) -> type[StagingBuffer]:
    """The buffer class of ``tier``."""
    return TIER_CLASSES[tier]


def buffer_class(caps: Capabilities, tier: Tier | str | None = None) -> type[StagingBuffer]:
    """The class ``make_buffer(..., caps.device, tier)`` tries first: ``caps.tier``'s for None, else that of
    the tier ``tier`` names (InvalidArgumentError, naming the allowed names, if it names none)."""
    return tier_class(caps.tier if tier is None else Tier.parse(tier))


def reread_tier(caps: Capabilities) -> Tier | None:
    """The tier for staged data the device reads many times (an eager forward reads its inputs in every
    layer): where the device's kernels read the buffers of ``caps.tier`` from host memory itself (no copy
    into device memory, yet the device reads after the host call returned: UVA), the best usable tier whose
    buffers copy into device memory (one copy beats a host read per use); else None, ``caps.tier`` itself."""
    cls = tier_class(caps.tier)
    if cls.copies or not cls.async_host_reads:
        return None
    return next((t for t in usable_tiers(caps) if tier_class(t).copies), None)


for _cls in (UvaBuffer, PinnedBuffer, NonUvaBuffer, HostBuffer):
    register_tier_class(_cls)
del _cls


def ensure_buffers_room(
    what: str,
    count: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    tier: Tier,
    device_type: str,
    extra: int = 0,
    fix: str | None = None,
) -> None:
    """``ensure_host_room`` for ``count`` buffers of ``shape`` and ``dtype`` on ``tier`` (each its host side,
    and where the tier copies on a CPU device its device side too) and ``extra`` bytes more; first
    InvalidArgumentError for a buffer past 2**63 - 1 bytes, as allocating it would raise."""
    n = nbytes_of(shape, dtype)
    per = 2 * n if tier_class(tier).copies and device_type == "cpu" else n
    ensure_host_room(count * per + extra, what, tier, fix)
