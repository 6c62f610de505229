"""Round-robin pools of staging buffers, and the host-backed tensor built on them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .._bytes.buffers import StagingBuffer, copy_rows, ensure_buffers_room
from .._bytes.checked import host_view
from .._bytes.make import make_buffer
from .._common.convert import check_rows, fill_host, host_array, numpy_dtype, shape_of, torch_dtype
from .._common.errors import ArgumentTypeError, InvalidArgumentError
from .._common.sealed import Cell, Sealed, read_only
from .._common.tier import Tier
from .._common.types import DeviceLike, DTypeLike, HostData
from .._device.memory import alloc_host
from .._tiers.probe import capabilities
from .guard import GuardMode, slot_count
from .ring import Ring


class UvaBufferPool(Sealed):
    """``max_concurrency`` staging buffers used round-robin.

    Each ``copy_to_uva``/``copy_to_gpu`` call that changes the values takes the next slot, so a slot's device
    readers must be done before the pool comes round to it again (after ``max_concurrency`` more such calls,
    growth included); ``guard`` checks this. A slot's rows grow to the next power of two for a longer input
    (same dtype, trailing dims and tier). In check mode (``STAGEBUF_CHECK=1``) a released slot reads poison
    (int -1, float NaN) for ``STAGEBUF_CHECK_QUARANTINE`` (default 16) more uses. ``shape`` (``size`` as a
    tuple), ``dtype``, ``max_concurrency`` (at least 2) and ``device`` are the arguments, resolved, and
    read-only (ReadOnlyAttributeError).

    Parameters
    ----------
    size, dtype, device
        As for :class:`StagingBuffer`, per slot.
    max_concurrency : int or None, optional
        The slot count, 1 to 1024 (raised to at least 2); None: :func:`set_default_max_concurrency`'s.
    guard : {"auto", "wait", "raise", "off"}, default "auto"
        Before a slot is rewritten: ``"wait"`` for its readers, ``"raise"`` SlotInFlightError, or ``"off"``
        (trust the caller); ``"auto"`` waits where the device reads host memory asynchronously (UVA, PINNED).

    Raises
    ------
    InvalidArgumentError, ArgumentTypeError, DeviceAllocationError, HostAllocationError, SetupError,
    TierUnavailableError
        As :class:`StagingBuffer` raises them for ``size``, ``dtype``, ``device`` and the slots' memory
        (HostAllocationError where the host cannot hold every slot, checked before the first is made);
        InvalidArgumentError also if ``max_concurrency`` or ``guard`` is not as allowed above.
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
        caps = capabilities(device)  # the host memory of every slot, checked before the first is made
        what = f"UvaBufferPool(size={self.shape}, dtype={self.dtype}): {self.max_concurrency} slots"
        ensure_buffers_room(what, self.max_concurrency, self.shape, self.dtype, caps.tier, caps.device.type)
        self._ring = Ring(
            self.max_concurrency,
            lambda: make_buffer(self.shape, self.dtype, device),
            guard,
            "pool slot",
            quarantined=True,
            owner="UvaBufferPool",
        )
        self.device = self._ring.device
        self._published: Cell[tuple[int, Any, Any]] = Cell((-1, None, None))
        """(rows the current slot last published, -1: none; its buffer; those rows' host view): what equal
        values may reuse."""
        self._freeze()

    @property
    def tier(self) -> Tier:
        """The tier of the slots (the worst one, if a run-time fallback split them)."""
        return self._ring.tier

    def _next(self, x: HostData, reuse: bool = False, gpu: bool = False) -> tuple[StagingBuffer, int, bool]:
        """Write ``x`` into the next slot and take it, counting the copy its caller issues next (from the
        slot on the copy tiers; with ``gpu``, into device memory on all tiers but HOST); raising, it takes
        nothing. With ``reuse``, values equal to the current slot's last publish reuse it (third value)."""
        trailing = self._trailing
        if type(x) is np.ndarray and x.dtype == self._np_dtype and x.shape[1:] == trailing and x.ndim:
            arr = x  # already right: nothing to check or convert
        else:
            arr = host_array(x, self.dtype, "x", ndims=(len(self.shape),), trailing=trailing)
        n = arr.shape[0]
        ring = self._ring
        published, last, seen = self._published.value
        if reuse and n <= published and (seen if n == published else last.np[:n]).tobytes() == arr.tobytes():
            ring.touch()
            return last, n, True
        cur, buf = ring.acquire()
        if n > buf.shape[0]:
            cap = 1 << (n - 1).bit_length()
            ensure_buffers_room(
                f"UvaBufferPool: growing a slot to {cap} rows (for {n})",
                1,
                (cap, *trailing),
                self.dtype,
                buf.tier,
                self.device.type,
                fix="Nothing was staged by this call and the pool's earlier tensors stay valid. Stage fewer "
                "rows at once, or free host memory",
            )
            buf = ring.grow(cur, lambda tier: make_buffer((cap, *trailing), self.dtype, self.device, tier))
        host = buf.np[:n]
        host[...] = arr
        # a transfer: a copy into device memory (with gpu: wherever the device is not the host itself)
        copies = buf.dev is not buf.cpu if gpu else buf.copies
        ring.publish(cur, n * self._row_bytes if copies else None)
        self._published.value = (n, buf, host)
        return buf, n, False

    def copy_to_uva(self, x: HostData) -> torch.Tensor:
        """Stage ``x`` in the next slot; the device tensor of its ``len(x)`` rows.

        ``x`` is host data (a numpy array, CPU tensor, list or tuple) of the pool's rank and trailing shape,
        any number of rows, whose values fit ``dtype`` exactly. Published at return: a view of the slot's host
        memory on tiers UVA and HOST (no copy), its device buffer after one asynchronous copy on the current
        stream on PINNED and PAGEABLE. It holds ``x`` until the pool has taken ``max_concurrency`` more slots
        (in check mode it reads poison after). Values equal to the last call's first ``len(x)`` rows reuse its
        slot and tensor, with no copy. A call that raises takes no slot and writes nothing.

        Raises
        ------
        ArgumentTypeError, InvalidArgumentError
            ArgumentTypeError if ``x`` or its dtype is not supported; InvalidArgumentError if ``x`` has
            another rank or trailing shape, is on another device, or holds values ``dtype`` cannot hold.
        SlotInFlightError
            With ``guard="raise"``, if the device may still read the next slot.
        StepRuleError
            In check mode, if the step clock would have released a slot the device may still read (call
            :func:`begin_step` at the start of every step).
        DeviceAllocationError, HostAllocationError
            If growing the slot for a longer ``x`` runs out of device memory, or of host memory (checked
            before allocating; earlier tensors stay valid).
        CudaError
            If recording or querying the guard's CUDA event fails.
        """
        buf, n, reused = self._next(x, reuse=True)
        if reused:
            return buf.rows(n)[0]
        return buf.uva(n)

    def copy_chunks_to_uva(self, chunks: Sequence[HostData], n: int) -> torch.Tensor:
        """Stage the ``n`` rows of ``chunks`` joined in order, as :meth:`copy_to_uva` stages one array.

        vLLM 0.34's call shape: each chunk is host data as for :meth:`copy_to_uva` (an ``array.array`` or
        ndarray is read as one block), and ``n`` must be their total row count. Unlike vLLM's (a cast with
        ``casting="unsafe"``), a value ``dtype`` cannot hold exactly is refused, before any slot is taken.

        Raises
        ------
        ArgumentTypeError, InvalidArgumentError
            As :meth:`copy_to_uva` for a chunk (named by its position); ArgumentTypeError if ``chunks`` is
            not a sequence; InvalidArgumentError if ``n`` is not the chunks' total row count.
        SlotInFlightError, StepRuleError, DeviceAllocationError, HostAllocationError, CudaError
            As :meth:`copy_to_uva`.
        """
        if not isinstance(chunks, (list, tuple)):
            raise ArgumentTypeError(
                f"chunks must be a list or tuple of host arrays; got {type(chunks).__name__}"
            )
        rank, trailing = len(self.shape), self._trailing
        parts = [
            host_array(c, self.dtype, f"chunks[{i}]", ndims=(rank,), trailing=trailing)
            for i, c in enumerate(chunks)
        ]
        total = sum(p.shape[0] for p in parts)
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n != total:
            raise InvalidArgumentError(f"n={n!r} is not the chunks' row count; allowed: {total}")
        joined = np.concatenate(parts) if parts else np.empty((0, *trailing), self._np_dtype)
        return self.copy_to_uva(joined)

    def copy_to_gpu(self, x: HostData, out: torch.Tensor | None = None) -> torch.Tensor:
        """Stage ``x`` as :meth:`copy_to_uva` does and copy it to ``out`` or a new device tensor; that tensor.

        ``out`` must be None or exactly ``(len(x), *shape[1:])`` of ``dtype`` on ``device``. The copy is
        issued on the current stream (a CPU copy on tier HOST); the result is device memory of its own, not a
        view of the slot, so it stays valid however often the pool comes round.

        Raises
        ------
        ArgumentTypeError, InvalidArgumentError, SlotInFlightError, StepRuleError, CudaError
            As :meth:`copy_to_uva`; also if ``out`` is not None or a tensor (ArgumentTypeError) or has another
            shape, dtype or device (InvalidArgumentError).
        DeviceAllocationError, HostAllocationError
            If growing the slot, or allocating the result, runs out of device (or host) memory.
        """
        arr = host_array(x, self.dtype, "x", ndims=(len(self.shape),), trailing=self.shape[1:])
        if out is not None:
            self._check_out(out, arr.shape[0])
        buf, n, _ = self._next(arr, gpu=True)
        self._published.value = (-1, None, None)  # the slot's device side did not receive these values
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

    def release_thread(self) -> None:
        """Hand this object to another thread: in check mode (``STAGEBUF_CHECK=1``) an object belongs to the
        first thread that uses it, and another thread's call raises UsageError; call this on the owning thread
        (or before any use), and the next thread to use it takes it. Without check mode it does nothing."""
        self._ring.release_thread()

    def stats(self) -> dict[str, int]:
        """The pool's counters: ``transfers`` (host-to-device copies: ``copy_to_uva`` on PINNED and PAGEABLE,
        ``copy_to_gpu`` on every tier but HOST), ``bytes`` (their size), ``growths`` (slots replaced by larger
        ones) and ``guard_waits`` (times the guard waited for the device)."""
        return self._ring.stats()


@read_only({"gpu": "copy_to_uva() sets it; write the host values through .np or .cpu"})
class UvaBackedTensor(Sealed):
    """A host tensor that is the source of truth, published to the device on request.

    The host writes ``.cpu``/``.np``; ``copy_to_uva(n)`` snapshots the first ``n`` rows into a slot of a
    :class:`UvaBufferPool` and sets ``.gpu``, which later host writes do not reach and which lives as that
    pool's :meth:`~UvaBufferPool.copy_to_uva` result does. Assigning ``.np`` or ``.cpu`` copies the values in,
    checked as for :class:`StagingBuffer`; any other attribute is read-only (ReadOnlyAttributeError).

    Parameters
    ----------
    size, dtype, max_concurrency, device
        The pool's, as for :class:`UvaBufferPool` (which says what they raise).

    Attributes
    ----------
    cpu : torch.Tensor
        The host values (zero-filled at construction); ``np`` is a numpy view of it.
    pool : UvaBufferPool
        The pool that publishes the rows (``guard="auto"``); ``dtype`` and ``device`` are the pool's.
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
        self.pool.release_thread()  # (its first use is the caller's, not this constructor's)
        self._freeze()

    _COPY_IN = ("np", "cpu")

    def _copy_in(self, name: str, value: Any) -> None:
        fill_host(self.np, value, self.dtype, f"UvaBackedTensor.{name}")  # copy in, checked

    @property
    def gpu(self) -> torch.Tensor:
        """The device tensor of the last ``copy_to_uva()`` (at first, the zeros published at construction)."""
        return self._gpu.value

    @property
    def tier(self) -> Tier:
        """The pool's tier (the worst one, if a run-time fallback split its slots)."""
        return self.pool.tier

    def copy_to_uva(self, n: int | None = None) -> torch.Tensor:
        """Publish the first ``n`` rows (None, the default: all); the device tensor, also kept as ``.gpu``, as
        :meth:`UvaBufferPool.copy_to_uva` returns it. Raises InvalidArgumentError unless ``n`` is None or an
        int in ``[0, rows]``; StepRuleError and CudaError as that method."""
        src = self.np if n is None else self.np[: check_rows(n, self.np.shape[0])]
        gpu = self._gpu.value = self.pool.copy_to_uva(src)
        return gpu

    def release_thread(self) -> None:
        """Hand this object to another thread, as :meth:`UvaBufferPool.release_thread`."""
        self.pool.release_thread()

    def stats(self) -> dict[str, int]:
        """The pool's counters, as :meth:`UvaBufferPool.stats`: transfers, bytes, growths, guard_waits."""
        return self.pool.stats()
