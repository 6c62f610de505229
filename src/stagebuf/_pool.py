"""Round-robin pools of staging buffers, and the host-backed tensor built on them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ._buffers import StagingBuffer, fill_host, make_buffer
from ._convert import check_rows, host_array, numpy_dtype, shape_of, torch_dtype
from ._errors import ArgumentTypeError, InvalidArgumentError
from ._guard import GuardMode, slot_count
from ._ring import Ring
from ._sealed import Sealed
from ._tier import Tier
from ._types import DeviceLike, DTypeLike, HostData


class UvaBufferPool(Sealed):
    """``max_concurrency`` staging buffers used round-robin.

    Reuse contract: each ``copy_to_uva``/``copy_to_gpu`` takes the next slot, so
    the device readers of a slot must be done before the pool comes round to it
    again (after ``max_concurrency`` more calls), growth included. The guard
    checks this: ``guard="auto"`` (default) waits where the device reads host
    memory asynchronously (UVA, PINNED), ``"raise"`` raises, ``"off"`` trusts
    the caller. A slot's first dimension grows to the next power of two when an
    input is longer; dtype, trailing dims and tier are kept.
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
        self.max_concurrency = slot_count(max_concurrency)
        self._ring = Ring(
            self.max_concurrency,
            lambda: make_buffer(self.shape, self.dtype, device),
            guard,
            "pool slot",
            quarantined=True,
        )
        self.device = self._ring.bufs[0].device
        self._published = -1
        """Rows the current slot last published (-1: none) (what a call with equal values may reuse)."""
        self._freeze()

    @property
    def tier(self) -> Tier:
        """The tier of the slots (the lowest one, if a run-time fallback split them)."""
        return self._ring.tier

    def _next(self, x: HostData, reuse: bool = False) -> tuple[StagingBuffer, int, bool]:
        """Write ``x`` into the next slot. A call that raises takes no slot and writes nothing.

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
        if reuse and n <= self._published and ring.cur >= 0:
            buf = ring.bufs[ring.cur]
            if buf.np[:n].tobytes() == arr.tobytes():
                ring.touch()
                return buf, n, True
        cur = ring.next()
        ring.poison_released()  # check mode: what the use max_concurrency back returned reads poison now
        buf = ring.bufs[cur]
        if n > buf.shape[0]:
            cap = 1 << (n - 1).bit_length()
            buf = ring.grow(cur, lambda tier: make_buffer((cap, *trailing), self.dtype, self.device, tier))
        buf.np[:n] = arr
        ring.take(cur)
        self.__dict__["_published"] = n
        return buf, n, False

    def copy_to_uva(self, x: HostData) -> torch.Tensor:
        """Stage ``x`` in the next slot; the device tensor of its first len(x) rows.

        Values equal to the last call's (its first len(x) rows) reuse its slot: the same
        device tensor comes back, with no copy and no new slot, on every tier.
        """
        buf, n, reused = self._next(x, reuse=True)
        if reused:
            return buf.rows(n)[0]
        if buf.tier.copies:
            self._count(n, buf)
        return buf.uva(n)

    def copy_to_gpu(self, x: HostData, out: torch.Tensor | None = None) -> torch.Tensor:
        """Stage ``x`` and copy it into device memory (``out`` or a new tensor)."""
        arr = host_array(x, self.dtype, "x", ndims=(len(self.shape),), trailing=self.shape[1:])
        if out is not None:
            self._check_out(out, arr.shape[0])
        buf, n, _ = self._next(arr)
        self.__dict__["_published"] = -1  # the slot's device side did not receive these values
        if out is None:
            out = torch.empty((n, *self.shape[1:]), dtype=self.dtype, device=self.device)
        if buf.tier is not Tier.HOST:
            self._count(n, buf)
        return buf._copy_rows(out, n)

    def _check_out(self, out: torch.Tensor, n: int) -> None:
        want = (n, *self.shape[1:])
        if not isinstance(out, torch.Tensor):
            raise ArgumentTypeError(f"out must be a torch.Tensor or None; got {type(out).__name__}")
        if tuple(out.shape) != want or out.dtype != self.dtype or out.device != self.device:
            raise InvalidArgumentError(
                f"out has shape {tuple(out.shape)}, dtype {out.dtype}, device {out.device}; "
                f"expected shape {want}, dtype {self.dtype}, device {self.device}"
            )

    def _count(self, n: int, buf: StagingBuffer) -> None:
        self._ring.count(n * (buf.nbytes // max(buf.shape[0], 1)))

    def stats(self) -> dict[str, int]:
        """transfers, bytes, growths, guard_waits."""
        return self._ring.stats()


class UvaBackedTensor(Sealed):
    """A host tensor that is the source of truth, published to the device on request.

    ``.cpu``/``.np`` are written by the host; ``copy_to_uva(n)`` publishes the
    first ``n`` rows (all when None) through a pool and sets ``.gpu``.
    """

    def __init__(
        self,
        size: int | Sequence[int],
        dtype: DTypeLike,
        max_concurrency: int | None = None,
        device: DeviceLike = None,
    ):
        self.dtype = torch_dtype(dtype)
        self.cpu = torch.zeros(shape_of(size), dtype=self.dtype)
        self.np = self.cpu.numpy()
        self.pool = UvaBufferPool(size, self.dtype, max_concurrency, device)
        self.device = self.pool.device
        self._gpu = self.pool.copy_to_uva(self.np)
        self._freeze()

    _COPY_IN = ("np", "cpu")

    def _copy_in(self, name: str, value: Any) -> None:
        fill_host(self.np, value, self.dtype, f"UvaBackedTensor.{name}")  # copy in, checked

    @property
    def gpu(self) -> torch.Tensor:
        """The device tensor of the last ``copy_to_uva()``."""
        return self._gpu

    @property
    def tier(self) -> Tier:
        return self.pool.tier

    def copy_to_uva(self, n: int | None = None) -> torch.Tensor:
        """Publish the first ``n`` rows (all when None); the device tensor, also kept as ``.gpu``."""
        src = self.np if n is None else self.np[: check_rows(n, self.np.shape[0])]
        gpu = self.__dict__["_gpu"] = self.pool.copy_to_uva(src)  # (a plain store: no __setattr__ hook)
        return gpu

    def stats(self) -> dict[str, int]:
        return self.pool.stats()
