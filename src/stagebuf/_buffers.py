"""One buffer interface, one small class per tier.

Every buffer has ``.cpu`` (a CPU tensor the host writes), ``.np`` (a numpy view
of it), ``.uva(n)`` (a device tensor of the first ``n`` rows) and ``.tier``;
``copy_to(out, n)`` moves the first ``n`` rows into another device tensor.
``make_buffer`` picks the class from ``capabilities()``.

The rule for a tier that cannot work (one rule, everywhere):

* **An explicit request that cannot work raises** ``TierUnavailableError``, which
  names what was asked, why it cannot work here and the allowed values. Explicit
  requests are ``STAGEBUF_TIER`` (checked by the probe), the ``tier=`` argument of
  ``make_buffer`` and the tier classes themselves (``UvaBuffer``,
  ``PinnedBuffer``). "Cannot work" includes "better than the tier STAGEBUF_TIER
  forces": a forced tier caps the process, so ``UvaBuffer()`` raises under
  ``STAGEBUF_TIER=pinned`` even on a machine that could do UVA. A tier worse than
  the chosen one may be asked for (``usable_tiers(caps)`` lists them).
* **A run-time allocation failure falls back** one tier, with one warning per
  process: the probe said yes, but a pinned allocation or a device view fails
  later (memlock exhausted, WSL cap). Only ``make_buffer`` falls back; the tier
  classes raise ``PinnedAllocationError`` / ``UvaError``.

A buffer's attributes are fixed at construction. Assigning ``.np`` or ``.cpu``
copies the values in (``buf.np = x`` is ``buf.np[...] = x`` with stagebuf's value
checks); assigning any other attribute raises ReadOnlyAttributeError (an
AttributeError).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from . import _uva
from ._constants import ENV_TIER
from ._convert import check_rows, host_array, shape_of, torch_dtype
from ._errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    PinnedAllocationError,
    TierUnavailableError,
    UsageError,
    UvaError,
)
from ._log import warn_once
from ._memory import alloc_device, alloc_host
from ._probe import Capabilities, capabilities, usable_tiers
from ._sealed import Sealed
from ._tier import Tier
from ._types import DeviceLike, DTypeLike


def fill_host(dst: np.ndarray, value: Any, dtype: torch.dtype, name: str) -> None:
    """``dst[...] = value``, checked first: ``value`` has ``dst``'s shape, or is one scalar.

    The values go through the same checks as every other host input
    (``convert.host_array``): a fraction, NaN or an out-of-range value into an
    integer dtype raises ValueError naming ``name``; nothing is written then.
    """
    if isinstance(value, (bool, int, float, np.generic)):
        value = np.asarray(value)
    arr = host_array(value, dtype, name, ndims=(0, dst.ndim))
    if arr.ndim and arr.shape != dst.shape:
        raise InvalidArgumentError(
            f"{name}: a value of shape {arr.shape} was given; expected shape {dst.shape} "
            "(or one scalar for every element)"
        )
    np.copyto(dst, arr)


class StagingBuffer(Sealed):
    """A host buffer and the way its rows reach the device (the tier).

    The base of the four tier classes; make one with :func:`make_buffer`, or with a
    tier class to ask for that tier. The host writes ``.np`` or ``.cpu``;
    ``uva(n)`` publishes the first ``n`` rows and returns them as a device tensor.

    Assigning ``buf.np = x`` or ``buf.cpu = x`` copies ``x`` (one scalar, or an
    array of the buffer's shape) into the host storage, with the value checks of
    every other input: it raises InvalidArgumentError for another shape or a value
    that does not fit the dtype, and ArgumentTypeError for an unsupported type;
    nothing is written then. Assigning or deleting any other attribute raises
    ReadOnlyAttributeError.

    Parameters
    ----------
    size : int or sequence of int
        The shape: a row count, or a tuple whose first entry is the row count.
    dtype : torch.dtype, numpy.dtype, type or str
        The element type (bool, uint8, int8, int16, int32, int64, float16, float32,
        float64).
    device : torch.device, str, int or None, optional
        The target device, as for :func:`capabilities`; None is the default device.

    Attributes
    ----------
    tier : Tier
        The class's tier.
    cpu : torch.Tensor
        The host storage (pinned on tiers UVA and PINNED).
    np : numpy.ndarray
        A numpy view of ``cpu``.
    dev : torch.Tensor
        The device-side storage ``uva()`` publishes into, at a fixed address: a view
        of ``cpu`` on tiers UVA and HOST, a separate device tensor on the copy tiers.
    device : torch.device
        The target device.
    shape : tuple of int
        The shape of ``cpu`` and ``dev``.
    dtype : torch.dtype
        The element type.
    """

    tier: ClassVar[Tier]
    cpu: torch.Tensor
    np: np.ndarray
    device: torch.device
    dev: torch.Tensor

    def __init__(self, size: int | Sequence[int], dtype: DTypeLike, device: DeviceLike = None):
        if type(self) is StagingBuffer:
            raise UsageError(
                "StagingBuffer is the base of the tier classes and holds no storage; make a buffer with "
                "make_buffer(size, dtype), or with a tier class: HostBuffer, NonUvaBuffer, PinnedBuffer "
                "or UvaBuffer"
            )
        self.shape = shape_of(size)
        self.dtype = torch_dtype(dtype)
        self._rows: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = {}

    _COPY_IN = ("np", "cpu")

    def _copy_in(self, name: str, value: Any) -> None:
        fill_host(self.np, value, self.dtype, f"{type(self).__name__}.{name}")

    def rows(self, n: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the first ``n`` rows of ``dev`` and ``cpu``; nothing is copied.

        The views are cached per ``n`` (slicing costs a torch call).

        Parameters
        ----------
        n : int or None
            The row count, ``0 <= n <= shape[0]``; None is every row.

        Returns
        -------
        tuple of torch.Tensor
            ``(dev[:n], cpu[:n])``.

        Raises
        ------
        InvalidArgumentError
            If ``n`` is not None or an int in ``[0, shape[0]]``.
        """
        try:
            pair = self._rows.get(n)
        except TypeError:  # an unhashable n: check_rows says what n may be
            pair = None
        if pair is None:
            k = check_rows(n, self.shape[0])
            if len(self._rows) >= 256:
                self._rows.clear()
            pair = self._rows[n] = (self.dev[:k], self.cpu[:k])
        return pair

    def uva(self, n: int | None = None) -> torch.Tensor:
        """Publish the first ``n`` rows: a device tensor holding them.

        On tiers UVA and HOST this is a view of the host storage (no copy: later host
        writes show through). On tiers PINNED and PAGEABLE the rows are copied into
        ``dev`` (asynchronously, on the current stream) and a view of ``dev`` is
        returned.

        Parameters
        ----------
        n : int or None, optional
            The row count, ``0 <= n <= shape[0]``; None (the default) is every row.

        Returns
        -------
        torch.Tensor
            The first ``n`` rows of ``dev``, on ``device``.

        Raises
        ------
        InvalidArgumentError
            If ``n`` is not None or an int in ``[0, shape[0]]``.
        """
        return self.rows(n)[0]

    def copy_to(self, out: torch.Tensor, n: int | None = None) -> torch.Tensor:
        """Copy the first ``n`` host rows into the device tensor ``out`` (on the current stream).

        Parameters
        ----------
        out : torch.Tensor
            The destination: on this buffer's device, of its dtype and row shape, with
            at least ``n`` rows (checked: ``copy_`` would otherwise convert silently).
        n : int or None, optional
            The row count, ``0 <= n <= shape[0]``; None (the default) is every row.

        Returns
        -------
        torch.Tensor
            ``out[:n]``, the rows written.

        Raises
        ------
        InvalidArgumentError
            If ``n`` is not None or an int in ``[0, shape[0]]``, or if ``out`` does not
            fit (device, dtype, row shape or row count).
        ArgumentTypeError
            If ``out`` is not a tensor.
        """
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
        return self._copy_rows(out, n)

    def _copy_rows(self, out: torch.Tensor, n: int) -> torch.Tensor:
        """``copy_to`` without the checks, for callers that made ``out`` to fit (saves ~1 us)."""
        dst = out[:n]
        dst.copy_(self.cpu[:n], non_blocking=True)
        return dst

    @property
    def nbytes(self) -> int:
        """The size of the host storage in bytes."""
        return self.cpu.numel() * self.cpu.element_size()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={self.shape}, dtype={self.dtype}, device={self.device})"


def _unavailable(want: Tier, caps: Capabilities, who: str) -> TierUnavailableError:
    """The error for an explicit request of tier ``want`` that cannot work on ``caps.device``."""
    allowed = [t.name.lower() for t in usable_tiers(caps)]
    head = "UVA is not available" if want is Tier.UVA else f"tier {want.name} is not available"
    hint = None
    if caps.device_type == "cpu" and want is not Tier.PAGEABLE:
        cause = f"{who} needs an accelerator, but the target device is the CPU because {caps.cpu_cause}"
        fix = f"pass an accelerator device, or use stagebuf.make_buffer() (tier {caps.tier.name} here)"
        hint = caps.cpu_fix
        if hint:
            fix += f"; or {hint}"
    elif caps.forced is not None and want < caps.tier:
        cause = (
            f"{who} was asked for, but {ENV_TIER}={caps.forced} forces tier {caps.tier.name} "
            "and nothing better is used in this process"
        )
        fix = f"unset {ENV_TIER} or set it to {want.name.lower()}, or ask for an allowed tier"
    elif want is Tier.HOST:
        cause = (
            f"{who} was asked for, but tier HOST means no accelerator and the target device is {caps.device}"
        )
        fix = "pass device='cpu', or ask for an allowed tier"
    else:
        found = " ".join(r for r in caps.reasons if r.startswith("No ")) or " ".join(caps.reasons)
        cause = f"{who} was asked for, but the probe found: {found}"
        fix = f"use stagebuf.make_buffer() (tier {caps.tier.name} here) or ask for an allowed tier"
    return TierUnavailableError(
        f"{head} on {caps.device}",
        setting="tier",
        value=want.name.lower(),
        cause=cause,
        allowed=allowed,
        fix=fix,
        hint=hint,
    )


def _checked_caps(want: Tier, device: DeviceLike, who: str) -> Capabilities:
    """The capabilities of ``device``, if tier ``want`` may be asked for there; else raise."""
    caps = capabilities(device)
    if want not in usable_tiers(caps):
        raise _unavailable(want, caps, who)
    return caps


def _device_type(device: DeviceLike, who: str) -> str:
    """The type of ``device`` (a str, an int or a torch.device), or raise saying what is allowed."""
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise ArgumentTypeError(
            f"{who}: device={device!r} is a {type(device).__name__}; allowed: None or 'cpu'"
        )
    try:
        return torch.device(device).type
    except (RuntimeError, ValueError, TypeError, OverflowError):
        raise InvalidArgumentError(
            f"{who}: device={device!r} is not a device; allowed: None or 'cpu'"
        ) from None


class HostBuffer(StagingBuffer):
    """Tier HOST, no accelerator: the CPU tensor is the device tensor.

    Parameters
    ----------
    size : int or sequence of int
        The shape, as for :class:`StagingBuffer`.
    dtype : torch.dtype, numpy.dtype, type or str
        The element type.
    device : torch.device, str or None, optional
        A CPU device; None (the default) is the CPU too. Anything else is refused.

    Raises
    ------
    InvalidArgumentError
        If ``size`` is not an int >= 0 or a tuple of them, or ``device`` is not None
        or a CPU device.
    ArgumentTypeError
        If ``dtype`` is not a supported dtype, or ``device`` is not None, a ``str``,
        an ``int`` or a ``torch.device``.
    """

    tier = Tier.HOST

    def __init__(self, size: int | Sequence[int], dtype: DTypeLike, device: DeviceLike = None):
        super().__init__(size, dtype)
        if device is not None and _device_type(device, "HostBuffer") != "cpu":
            raise InvalidArgumentError(f"HostBuffer: device={device!r}; allowed: None or 'cpu'")
        self.device = torch.device("cpu")
        self.cpu = alloc_host(self.shape, self.dtype, pinned=False)
        self.np = self.cpu.numpy()
        self.dev = self.cpu
        self._freeze()


class NonUvaBuffer(StagingBuffer):
    """Tier PAGEABLE: plain (pageable) host memory copied into a fixed device buffer.

    ``device="cpu"`` works on any machine: a separate CPU tensor stands in for
    device memory, which is how CPU-only CI exercises the copy path. The copy is
    issued with ``non_blocking=True``: from pageable memory CUDA stages the source
    before the call returns, so the host may rewrite ``.cpu`` at once. This tier can
    be asked for on every device.

    Parameters
    ----------
    size : int or sequence of int
        The shape, as for :class:`StagingBuffer`.
    dtype : torch.dtype, numpy.dtype, type or str
        The element type.
    device : torch.device, str, int or None, optional
        The target device, as for :func:`capabilities`; None is the default device.

    Raises
    ------
    InvalidArgumentError
        If ``size`` is not an int >= 0 or a tuple of them.
    ArgumentTypeError
        If ``dtype`` is not a supported dtype, or ``device`` is of a type that is not
        accepted.
    DeviceAllocationError
        If the device runs out of memory for ``dev``.
    SetupError
        As :func:`capabilities`: a bad setting or a device torch does not know.
    TierUnavailableError
        As :func:`capabilities`: a device or forced tier that cannot work here.
    """

    tier = Tier.PAGEABLE

    def __init__(self, size: int | Sequence[int], dtype: DTypeLike, device: DeviceLike = None):
        super().__init__(size, dtype)
        self.device = capabilities(device).device
        self.cpu = alloc_host(self.shape, self.dtype, pinned=False)
        self.np = self.cpu.numpy()
        self.dev = alloc_device(self.shape, self.dtype, self.device)
        self._freeze()

    def uva(self, n: int | None = None) -> torch.Tensor:
        dev, host = self.rows(n)
        return dev.copy_(host, non_blocking=True)


class PinnedBuffer(NonUvaBuffer):
    """Tier PINNED: pinned host memory and one asynchronous copy into a fixed device buffer.

    The device reads ``.cpu`` after ``uva()`` returns, so a host write before the
    copy is done would reach the device: rewrite a buffer only once its copy is
    consumed (pools and stagers guard this for you).

    Parameters
    ----------
    size : int or sequence of int
        The shape, as for :class:`StagingBuffer`.
    dtype : torch.dtype, numpy.dtype, type or str
        The element type.
    device : torch.device, str, int or None, optional
        The target device, as for :func:`capabilities`; None is the default device.

    Raises
    ------
    TierUnavailableError
        If tier PINNED cannot work on the device (the CPU, no pinned memory, or
        ``STAGEBUF_TIER`` forces PAGEABLE); the message lists the allowed tiers. Also
        as :func:`capabilities`.
    PinnedAllocationError
        If the pinned allocation fails at run time (memlock limit exhausted, say).
    DeviceAllocationError
        If the device runs out of memory for ``dev``.
    InvalidArgumentError
        If ``size`` is not an int >= 0 or a tuple of them.
    ArgumentTypeError
        If ``dtype`` is not a supported dtype, or ``device`` is of a type that is not
        accepted.
    SetupError
        As :func:`capabilities`: a bad setting or a device torch does not know.
    """

    tier = Tier.PINNED

    def __init__(self, size: int | Sequence[int], dtype: DTypeLike, device: DeviceLike = None):
        StagingBuffer.__init__(self, size, dtype)
        self.device = _checked_caps(Tier.PINNED, device, "PinnedBuffer").device
        self.cpu = alloc_host(self.shape, self.dtype, pinned=True)
        self.np = self.cpu.numpy()
        self.dev = alloc_device(self.shape, self.dtype, self.device)
        self._freeze()


class UvaBuffer(StagingBuffer):
    """Tier UVA: pinned host memory that kernels read through a device view, zero copies.

    ``uva()`` returns a view of the host memory: the device reads it while kernels
    run, so rewrite it only once they are done (pools and stagers guard this for
    you).

    Parameters
    ----------
    size : int or sequence of int
        The shape, as for :class:`StagingBuffer`.
    dtype : torch.dtype, numpy.dtype, type or str
        The element type.
    device : torch.device, str, int or None, optional
        The target device, as for :func:`capabilities`; None is the default device.

    Raises
    ------
    TierUnavailableError
        If tier UVA cannot work on the device (the CPU, no cuda-bindings, the UVA
        probe failed, or ``STAGEBUF_TIER`` forces a worse tier); the message lists
        the allowed tiers. Also as :func:`capabilities`.
    PinnedAllocationError
        If the pinned allocation fails at run time (memlock limit exhausted, say).
    UvaError
        If the device view of the new allocation cannot be made or does not alias it.
    InvalidArgumentError
        If ``size`` is not an int >= 0 or a tuple of them.
    ArgumentTypeError
        If ``dtype`` is not a supported dtype, or ``device`` is of a type that is not
        accepted.
    SetupError
        As :func:`capabilities`: a bad setting or a device torch does not know.
    """

    tier = Tier.UVA

    def __init__(self, size: int | Sequence[int], dtype: DTypeLike, device: DeviceLike = None):
        super().__init__(size, dtype)
        self.device = _checked_caps(Tier.UVA, device, "UvaBuffer").device
        self.cpu = alloc_host(self.shape, self.dtype, pinned=True)
        self.np = self.cpu.numpy()
        self.dev = _uva.device_view(self.cpu, self.device)
        self._freeze()


BUFFER_CLASSES: dict[Tier, type[StagingBuffer]] = {
    Tier.UVA: UvaBuffer,
    Tier.PINNED: PinnedBuffer,
    Tier.PAGEABLE: NonUvaBuffer,
    Tier.HOST: HostBuffer,
}


def make_buffer(
    size: int | Sequence[int], dtype: DTypeLike, device: DeviceLike = None, tier: Tier | str | None = None
) -> StagingBuffer:
    """A buffer of the tier chosen for ``device``, or of ``tier``.

    An allocation that fails at run time (memlock exhausted, WSL cap, a device view
    refused) falls back to the next tier that can work, with one warning per process;
    an explicit ``tier`` that cannot work here at all raises instead.

    Parameters
    ----------
    size : int or sequence of int
        The shape: a row count, or a tuple whose first entry is the row count.
    dtype : torch.dtype, numpy.dtype, type or str
        The element type (bool, uint8, int8, int16, int32, int64, float16, float32,
        float64).
    device : torch.device, str, int or None, optional
        The target device, as for :func:`capabilities`; None is the default device.
    tier : Tier, str or None, optional
        The tier to use (``"uva"``, ``"pinned"``, ``"pageable"``, ``"host"`` or a
        Tier); None (the default) is ``capabilities(device).tier``. On the CPU the
        allowed tiers are PAGEABLE and HOST; on an accelerator, the chosen tier and
        every worse copy tier.

    Returns
    -------
    StagingBuffer
        A :class:`UvaBuffer`, :class:`PinnedBuffer`, :class:`NonUvaBuffer` or
        :class:`HostBuffer`: of the tier asked for, or a worse one after a run-time
        fallback.

    Raises
    ------
    TierUnavailableError
        If ``tier`` is given and cannot work on the device; the message lists the
        allowed tiers. Also as :func:`capabilities`.
    InvalidArgumentError
        If ``tier`` names no tier, or ``size`` is not an int >= 0 or a tuple of them.
    ArgumentTypeError
        If ``dtype`` is not a supported dtype, or ``device`` is of a type that is not
        accepted.
    DeviceAllocationError
        If the device runs out of memory.
    SetupError
        As :func:`capabilities`: a bad setting or a device torch does not know.
    """
    if tier is None:
        caps = capabilities(device)
        want = caps.tier
    else:
        want = Tier.parse(tier)
        caps = _checked_caps(want, device, f"make_buffer(tier={want.name.lower()!r})")
    last = want if caps.device_type == "cpu" else Tier.PAGEABLE  # CPU tiers never fail to pin
    t = want
    while True:
        try:
            return BUFFER_CLASSES[t](size, dtype, caps.device)
        except (PinnedAllocationError, UvaError) as e:
            # no pinned memory: PINNED would fail the same way, so go straight to PAGEABLE
            nxt = Tier.PAGEABLE if isinstance(e, PinnedAllocationError) else Tier(t + 1)
            if t >= last:
                raise
            warn_once(
                ("runtime-fallback", str(caps.device), nxt),
                f"a {t.name} buffer could not be made on {caps.device} "
                f"({e}); falling back to tier {nxt.name} for it",
            )
            t = nxt
