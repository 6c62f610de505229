"""Round-robin pools of staging buffers, and the host-backed tensor built on them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .._bytes.buffers import StagingBuffer, copy_rows
from .._bytes.checked import host_view
from .._bytes.make import make_buffer
from .._bytes.memory import alloc_host
from .._common.convert import check_rows, fill_host, host_array, numpy_dtype, shape_of, torch_dtype
from .._common.errors import ArgumentTypeError, InvalidArgumentError
from .._common.sealed import Cell, Sealed, read_only
from .._common.tier import Tier
from .._common.types import DeviceLike, DTypeLike, HostData
from .guard import GuardMode, slot_count
from .ring import Ring


class UvaBufferPool(Sealed):
    """``max_concurrency`` staging buffers used round-robin.

    Each ``copy_to_uva``/``copy_to_gpu`` call that changes the values takes the next
    slot, so the device readers of a slot must be done before the pool comes round
    to it again (after ``max_concurrency`` more such calls), growth included: a
    tensor from ``copy_to_uva`` holds its data for that long. The guard checks this
    (see ``guard``). A slot's first dimension grows to the next power of two when an
    input is longer; dtype, trailing dims and tier are kept.

    ``STAGEBUF_CHECK=1`` (check mode) poisons a released slot (int -1, float NaN)
    and keeps it poisoned for ``STAGEBUF_CHECK_QUARANTINE`` (default 16) more uses,
    so a read past a tensor's lifetime reads poison. The attributes are read-only:
    assigning one raises ReadOnlyAttributeError.

    Parameters
    ----------
    size : int or sequence of int
        A slot's shape: a row count, or a tuple whose first entry is the row count
        (the rows grow on demand; the trailing dims are fixed).
    dtype : torch.dtype, numpy.dtype, type or str
        The element type (bool, uint8, int8, int16, int32, int64, float16, float32,
        float64).
    max_concurrency : int or None, optional
        The slot count, >= 1 (values below 2 are raised to 2); None (the default) is
        :func:`set_default_max_concurrency`'s value.
    device : torch.device, str, int or None, optional
        The target device, as for :func:`capabilities`; None (the default) is the
        default device.
    guard : {"auto", "wait", "raise", "off"}, optional
        Before a slot is rewritten: ``"wait"`` for its readers (counted in
        ``stats()["guard_waits"]``), ``"raise"`` SlotInFlightError, or ``"off"``
        (trust the caller); ``"auto"`` (the default) is ``"wait"`` where the device
        reads host memory asynchronously (UVA, PINNED), else ``"off"``.

    Attributes
    ----------
    shape : tuple of int
        The shape the slots were made with (``size`` as a tuple).
    dtype : torch.dtype
        The element type.
    max_concurrency : int
        The slot count (at least 2).
    device : torch.device
        The target device.

    Raises
    ------
    InvalidArgumentError
        If ``size`` is not an int >= 0 or a tuple of them, ``max_concurrency`` is not
        None or an int >= 1, or ``guard`` is not one of the allowed modes.
    ArgumentTypeError
        If ``dtype`` is not a supported dtype, or ``device`` is of a type that is not
        accepted.
    DeviceAllocationError
        If the device runs out of memory for the slots.
    SetupError, TierUnavailableError
        As :func:`capabilities` raises them for ``device`` and the settings.
    """

    def __init__(
        self,
        size: int | Sequence[int],
        dtype: DTypeLike,
        max_concurrency: int | None = None,
        device: DeviceLike = None,
        guard: GuardMode = "auto",
    ):
        self.size = size
        """The size as passed (an int or a tuple), as MRV2 keeps it; ``shape`` is the tuple."""
        self.shape = shape_of(size)
        self._trailing = self.shape[1:]
        self.dtype = torch_dtype(dtype)
        self._np_dtype = numpy_dtype(self.dtype)
        self._row_bytes = self._np_dtype.itemsize * math.prod(self._trailing)
        self.max_concurrency = slot_count(max_concurrency)
        self._ring = Ring(
            self.max_concurrency,
            lambda: make_buffer(self.shape, self.dtype, device),
            guard,
            "pool slot",
            quarantined=True,
        )
        self.device = self._ring.device
        self._published: Cell[tuple[int, Any]] = Cell((-1, None))
        """The rows the current slot last published (-1: none) and its buffer: what a call with equal
        values may reuse."""
        self._freeze()

    @property
    def tier(self) -> Tier:
        """The tier of the slots (the worst one, if a run-time fallback split them)."""
        return self._ring.tier

    def _next(self, x: HostData, reuse: bool = False, gpu: bool = False) -> tuple[StagingBuffer, int, bool]:
        """Write ``x`` into the next slot and take it, counting the copy its caller issues next (one
        from the slot on the copy tiers; with ``gpu``, into device memory on every tier but HOST).
        A call that raises takes no slot and writes nothing.

        With ``reuse``, values equal to what the current slot last published reuse that
        slot (no copy, no new slot): the third value says so.
        """
        trailing = self._trailing
        if type(x) is np.ndarray and x.dtype == self._np_dtype and x.shape[1:] == trailing and x.ndim:
            arr = x  # already right: nothing to check or convert
        else:
            arr = host_array(x, self.dtype, "x", ndims=(len(self.shape),), trailing=trailing)
        n = arr.shape[0]
        ring = self._ring
        published, last = self._published.value
        if reuse and n <= published and last.np[:n].tobytes() == arr.tobytes():
            ring.touch()
            return last, n, True
        cur, buf = ring.acquire()
        if n > buf.shape[0]:
            cap = 1 << (n - 1).bit_length()
            buf = ring.grow(cur, lambda tier: make_buffer((cap, *trailing), self.dtype, self.device, tier))
        buf.np[:n] = arr
        copies = buf.tier is not Tier.HOST if gpu else buf.tier.copies
        ring.publish(cur, n * self._row_bytes if copies else None)
        self._published.value = (n, buf)
        return buf, n, False

    def copy_to_uva(self, x: HostData) -> torch.Tensor:
        """Stage ``x`` in the next slot; the device tensor of its first ``len(x)`` rows.

        The slot is published at return: a view of the slot's host memory on tiers UVA
        and HOST (no copy), the slot's device buffer after one asynchronous copy (on the
        current stream) on PINNED and PAGEABLE. Values equal to the last call's (its
        first ``len(x)`` rows) reuse its slot: the same device tensor comes back, with
        no copy and no new slot, on every tier. A call that raises takes no slot and
        writes nothing.

        Parameters
        ----------
        x : numpy.ndarray, torch.Tensor, list or tuple
            Host data of the pool's rank and trailing shape (a CPU tensor, a numpy
            array or a nested list), any number of rows; its values must fit ``dtype``
            exactly.

        Returns
        -------
        torch.Tensor
            ``len(x)`` rows on ``device``. It holds ``x`` until the pool has taken
            ``max_concurrency`` more slots (calls with unchanged values take none);
            in check mode it reads poison from then on.

        Raises
        ------
        ArgumentTypeError
            If ``x`` is not a list, tuple, numpy array or CPU tensor, or its dtype is
            not supported.
        InvalidArgumentError
            If ``x`` has another rank or trailing shape, is a tensor on another
            device, or holds values ``dtype`` cannot represent (fractions, NaN or
            out-of-range values into an integer dtype, say).
        SlotInFlightError
            With ``guard="raise"``, if the device may still read the next slot.
        StepRuleError
            In check mode, if the step clock would have released a slot the device may
            still read (call :func:`begin_step` at the start of every step).
        DeviceAllocationError
            If growing the slot for a longer ``x`` runs out of device memory.
        CudaError
            If recording or querying the guard's CUDA event fails.
        """
        buf, n, reused = self._next(x, reuse=True)
        if reused:
            return buf.rows(n)[0]
        return buf.uva(n)

    def copy_to_gpu(self, x: HostData, out: torch.Tensor | None = None) -> torch.Tensor:
        """Stage ``x`` in the next slot and copy it into device memory (``out`` or a new tensor).

        The copy is issued on the current stream (asynchronously from pinned memory);
        the result is device memory of its own, not a view of the slot, so it stays
        valid however often the pool comes round. On tier HOST the copy is a CPU copy.

        Parameters
        ----------
        x : numpy.ndarray, torch.Tensor, list or tuple
            Host data of the pool's rank and trailing shape, as for
            :meth:`copy_to_uva`.
        out : torch.Tensor or None, optional
            The destination: exactly ``(len(x), *shape[1:])`` of ``dtype`` on
            ``device``; None (the default) allocates one.

        Returns
        -------
        torch.Tensor
            ``out``, or the new tensor, holding ``x``.

        Raises
        ------
        ArgumentTypeError
            If ``x`` is not a list, tuple, numpy array or CPU tensor (or of an
            unsupported dtype), or ``out`` is not None or a tensor.
        InvalidArgumentError
            If ``x`` has another rank or trailing shape, is a tensor on another
            device, or holds values ``dtype`` cannot represent; or if ``out`` has
            another shape, dtype or device.
        SlotInFlightError
            With ``guard="raise"``, if the device may still read the next slot.
        StepRuleError
            In check mode, if the step clock would have released a slot the device may
            still read.
        DeviceAllocationError
            If growing the slot, or allocating the result, runs out of device memory.
        CudaError
            If recording or querying the guard's CUDA event fails.
        """
        arr = host_array(x, self.dtype, "x", ndims=(len(self.shape),), trailing=self.shape[1:])
        if out is not None:
            self._check_out(out, arr.shape[0])
        buf, n, _ = self._next(arr, gpu=True)
        self._published.value = (-1, None)  # the slot's device side did not receive these values
        if out is None:
            out = torch.empty((n, *self.shape[1:]), dtype=self.dtype, device=self.device)
        return copy_rows(buf, out, n)

    def _check_out(self, out: torch.Tensor, n: int) -> None:
        want = (n, *self.shape[1:])
        if not isinstance(out, torch.Tensor):
            raise ArgumentTypeError(f"out must be a torch.Tensor or None; got {type(out).__name__}")
        if tuple(out.shape) != want or out.dtype != self.dtype or out.device != self.device:
            raise InvalidArgumentError(
                f"out has shape {tuple(out.shape)}, dtype {out.dtype}, device {out.device}; "
                f"expected shape {want}, dtype {self.dtype}, device {self.device}"
            )

    def stats(self) -> dict[str, int]:
        """The pool's counters.

        Returns
        -------
        dict of str to int
            ``transfers`` (host-to-device copies: ``copy_to_uva`` on PINNED and
            PAGEABLE, ``copy_to_gpu`` on every tier but HOST), ``bytes`` (their
            size), ``growths`` (slots replaced by larger ones) and ``guard_waits``
            (times the guard waited for the device).
        """
        return self._ring.stats()


@read_only({"gpu": "copy_to_uva() sets it; write the host values through .np or .cpu"})
class UvaBackedTensor(Sealed):
    """A host tensor that is the source of truth, published to the device on request.

    ``.cpu``/``.np`` are written by the host; ``copy_to_uva(n)`` publishes the
    first ``n`` rows (all when None) through a :class:`UvaBufferPool` and sets
    ``.gpu``. Publishing snapshots the host rows into a pool slot, so host writes
    after it do not reach ``.gpu``; publishing unchanged values takes no slot and
    returns the same tensor. ``.gpu`` holds its data for ``max_concurrency`` more
    publishes that change the values (in check mode it reads poison after).

    Assigning ``.np`` or ``.cpu`` copies the values in (one scalar, or an array of
    the tensor's shape), with stagebuf's value checks: InvalidArgumentError for
    another shape or a value that does not fit the dtype, ArgumentTypeError for an
    unsupported type. Assigning any other attribute raises ReadOnlyAttributeError.

    Parameters
    ----------
    size, dtype, max_concurrency, device
        The pool's, as for :class:`UvaBufferPool`.

    Attributes
    ----------
    cpu : torch.Tensor
        The host values (zero-filled at construction), written by the host.
    np : numpy.ndarray
        A numpy view of ``cpu``.
    dtype : torch.dtype
        The element type.
    pool : UvaBufferPool
        The pool that publishes the rows (``guard="auto"``).
    device : torch.device
        The target device.

    Raises
    ------
    InvalidArgumentError, ArgumentTypeError, DeviceAllocationError, SetupError, TierUnavailableError
        As :class:`UvaBufferPool` raises them for these arguments.
    """

    def __init__(
        self, size: int | Sequence[int], dtype: DTypeLike, max_concurrency: int | None = None,
        device: DeviceLike = None,
    ):  # fmt: skip
        self.dtype = torch_dtype(dtype)
        self.pool = UvaBufferPool(size, self.dtype, max_concurrency, device)
        self.cpu = alloc_host(self.pool.shape, self.dtype, pinned=False, tier=self.pool.tier)
        self.np = host_view(self.cpu, "UvaBackedTensor.np")
        self.device = self.pool.device
        self._gpu: Cell[torch.Tensor] = Cell(self.pool.copy_to_uva(self.np))
        self._freeze()

    _COPY_IN = ("np", "cpu")

    def _copy_in(self, name: str, value: Any) -> None:
        fill_host(self.np, value, self.dtype, f"UvaBackedTensor.{name}")  # copy in, checked

    @property
    def gpu(self) -> torch.Tensor:
        """The device tensor of the last ``copy_to_uva()`` (at first: the zeros published at construction)."""
        return self._gpu.value

    @property
    def tier(self) -> Tier:
        """The pool's tier (the worst one, if a run-time fallback split its slots)."""
        return self.pool.tier

    def copy_to_uva(self, n: int | None = None) -> torch.Tensor:
        """Publish the first ``n`` rows (all when None); the device tensor, also kept as ``.gpu``.

        Parameters
        ----------
        n : int or None, optional
            The row count, ``0 <= n <= rows``; None (the default) is every row.

        Returns
        -------
        torch.Tensor
            The first ``n`` rows on ``device``, as :meth:`UvaBufferPool.copy_to_uva`
            returns them (the same tensor again when the values did not change).

        Raises
        ------
        InvalidArgumentError
            If ``n`` is not None or an int in ``[0, rows]``.
        StepRuleError
            In check mode, if the step clock would have released a slot the device may
            still read.
        CudaError
            If recording or querying the guard's CUDA event fails.
        """
        src = self.np if n is None else self.np[: check_rows(n, self.np.shape[0])]
        gpu = self._gpu.value = self.pool.copy_to_uva(src)
        return gpu

    def stats(self) -> dict[str, int]:
        """The pool's counters, as :meth:`UvaBufferPool.stats`: transfers, bytes, growths, guard_waits."""
        return self.pool.stats()
