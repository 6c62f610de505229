"""One buffer interface, one small class per tier.

Every buffer has ``.cpu`` (a CPU tensor the host writes), ``.np`` (a numpy view
of it), ``.uva(n)`` (a device tensor of the first ``n`` rows) and ``.tier``;
``copy_to(out, n)`` moves the first ``n`` rows into another device tensor.
``make_buffer`` picks the class from ``capabilities()`` and falls back, one tier
at a time, when an allocation fails at run time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from . import uva as _uva
from .convert import check_rows, shape_of, torch_dtype
from .log import warn_once
from .memory import PinnedAllocationError, alloc_device, alloc_host
from .probe import TierUnavailableError, capabilities
from .tier import Tier


class StagingBuffer:
    """A host buffer and the way its rows reach the device (the tier)."""

    tier: ClassVar[Tier]
    cpu: torch.Tensor
    np: np.ndarray
    device: torch.device
    dev: torch.Tensor
    """The device-side storage ``uva()`` publishes into, at a fixed address."""

    def __init__(self, size: int | Sequence[int], dtype: Any, device: Any = None):
        self.shape = shape_of(size)
        self.dtype = torch_dtype(dtype)
        self._rows: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = {}

    def rows(self, n: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(device side, host side) of the first ``n`` rows, cached: slicing costs a torch call."""
        pair = self._rows.get(n)
        if pair is None:
            k = check_rows(n, self.shape[0])
            if len(self._rows) >= 256:
                self._rows.clear()
            pair = self._rows[n] = (self.dev[:k], self.cpu[:k])
        return pair

    def uva(self, n: int | None = None) -> torch.Tensor:
        """A device tensor holding the first ``n`` rows (all when None)."""
        return self.rows(n)[0]

    def copy_to(self, out: torch.Tensor, n: int | None = None) -> torch.Tensor:
        """Copy the first ``n`` rows into the device tensor ``out`` (stream-ordered)."""
        n = check_rows(n, self.shape[0])
        dst = out[:n]
        dst.copy_(self.cpu[:n], non_blocking=True)
        return dst

    @property
    def nbytes(self) -> int:
        return self.cpu.numel() * self.cpu.element_size()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={self.shape}, dtype={self.dtype}, device={self.device})"


def _accelerator(device: Any, cls: str) -> torch.device:
    caps = capabilities(device)
    if caps.device_type == "cpu":
        raise TierUnavailableError(f"{cls} needs an accelerator; device={caps.device}")
    return caps.device


class HostBuffer(StagingBuffer):
    """No accelerator: the CPU tensor is the device tensor."""

    tier = Tier.HOST

    def __init__(self, size: int | Sequence[int], dtype: Any, device: Any = None):
        super().__init__(size, dtype)
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"HostBuffer: device={device!r}; allowed: None or 'cpu'")
        self.device = torch.device("cpu")
        self.cpu = alloc_host(self.shape, self.dtype, pinned=False)
        self.np = self.cpu.numpy()
        self.dev = self.cpu



class NonUvaBuffer(StagingBuffer):
    """Plain (pageable) host memory copied into a fixed device buffer.

    ``device="cpu"`` works on any machine: a separate CPU tensor stands in for
    device memory, which is how CPU-only CI exercises the copy path. The copy is
    issued with ``non_blocking=True``: from pageable memory CUDA stages the source
    before the call returns, so the host may rewrite ``.cpu`` at once.
    """

    tier = Tier.PAGEABLE

    def __init__(self, size: int | Sequence[int], dtype: Any, device: Any = None):
        super().__init__(size, dtype)
        self.device = capabilities(device).device
        self.cpu = alloc_host(self.shape, self.dtype, pinned=False)
        self.np = self.cpu.numpy()
        self.dev = alloc_device(self.shape, self.dtype, self.device)

    def uva(self, n: int | None = None) -> torch.Tensor:
        dev, host = self.rows(n)
        return dev.copy_(host, non_blocking=True)


class PinnedBuffer(NonUvaBuffer):
    """Pinned host memory and one asynchronous copy into a fixed device buffer."""

    tier = Tier.PINNED

    def __init__(self, size: int | Sequence[int], dtype: Any, device: Any = None):
        StagingBuffer.__init__(self, size, dtype)
        self.device = _accelerator(device, "PinnedBuffer")
        if not capabilities(self.device).pin_memory:
            raise TierUnavailableError(
                f"PinnedBuffer: no pinned memory on {self.device}: "
                + " ".join(capabilities(self.device).reasons)
            )
        self.cpu = alloc_host(self.shape, self.dtype, pinned=True)
        self.np = self.cpu.numpy()
        self.dev = alloc_device(self.shape, self.dtype, self.device)


class UvaBuffer(StagingBuffer):
    """Pinned host memory that kernels read through a device view: zero copies."""

    tier = Tier.UVA

    def __init__(self, size: int | Sequence[int], dtype: Any, device: Any = None):
        super().__init__(size, dtype)
        self.device = _accelerator(device, "UvaBuffer")
        caps = capabilities(self.device)
        if not caps.uva:
            raise TierUnavailableError(
                f"UVA is not available on {self.device}: " + " ".join(caps.reasons)
                + " Use stagebuf.make_buffer() to fall back automatically."
            )
        self.cpu = alloc_host(self.shape, self.dtype, pinned=True)
        self.np = self.cpu.numpy()
        self.dev = _uva.device_view(self.cpu, self.device)



BUFFER_CLASSES: dict[Tier, type[StagingBuffer]] = {
    Tier.UVA: UvaBuffer,
    Tier.PINNED: PinnedBuffer,
    Tier.PAGEABLE: NonUvaBuffer,
    Tier.HOST: HostBuffer,
}


def make_buffer(
    size: int | Sequence[int], dtype: Any, device: Any = None, tier: Tier | str | None = None
) -> StagingBuffer:
    """A buffer of the best tier that works for ``device`` (or of ``tier``, if it can).

    Never raises for a missing platform feature: a tier that cannot work here, or
    an allocation that fails at run time (memlock exhausted, WSL cap), falls back
    to the next tier with one warning per process.
    """
    caps = capabilities(device)
    want = caps.tier if tier is None else Tier.parse(tier)
    if caps.device_type == "cpu":
        best, last = (want, want) if want >= Tier.PAGEABLE else (caps.tier, caps.tier)
    else:
        best = Tier.UVA if caps.uva else Tier.PINNED if caps.pin_memory else Tier.PAGEABLE
        last = Tier.PAGEABLE
    if want < best or want > last:
        warn_once(("make_buffer", str(caps.device), want),
                  f"stagebuf: tier {want.name} cannot work on {caps.device}; using {best.name}")
        want = best
    t = want
    while True:
        try:
            return BUFFER_CLASSES[t](size, dtype, caps.device)
        except (PinnedAllocationError, _uva.UvaError) as e:
            # no pinned memory: PINNED would fail the same way, so go straight to PAGEABLE
            nxt = Tier.PAGEABLE if isinstance(e, PinnedAllocationError) else Tier(t + 1)
            if t >= last:
                raise
            warn_once(("runtime-fallback", str(caps.device), nxt),
                      f"stagebuf: a {t.name} buffer could not be made on {caps.device} "
                      f"({e}); falling back to tier {nxt.name} for it")
            t = nxt
    raise AssertionError("unreachable: the last tier never falls back")
