"""Allocation, with failures turned into errors that say what to do."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .._common.errors import (
    DeviceAllocationError,
    HostAllocationError,
    InvalidArgumentError,
    PinnedAllocationError,
)

if TYPE_CHECKING:
    from .._common.tier import Tier

MAX_BYTES = 2**63 - 1  # the most bytes one tensor can hold: torch counts sizes and bytes in int64


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """The bytes of ``shape``, refused past int64 (where torch raises its own TypeError or RuntimeError)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > MAX_BYTES or any(n > MAX_BYTES for n in shape):
        raise InvalidArgumentError(
            f"a tensor of shape {shape} and dtype {dtype} would hold {nbytes} bytes; "
            f"allowed: at most {MAX_BYTES} bytes (2**63 - 1: torch counts bytes in int64)"
        )
    return nbytes


def _human(nbytes: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes} B"


def _for(tier: Tier | None) -> str:
    return f" for tier {tier.name}" if tier is not None else ""


def alloc_host(
    shape: tuple[int, ...], dtype: torch.dtype, pinned: bool, tier: Tier | None = None
) -> torch.Tensor:
    """A zero-filled host tensor, page-locked (verified) when ``pinned``; raises InvalidArgumentError past
    2**63 - 1 bytes, HostAllocationError or PinnedAllocationError, naming ``tier`` where given."""
    n = _nbytes(shape, dtype)
    if not pinned:
        try:
            return torch.zeros(shape, dtype=dtype, device="cpu")
        except (RuntimeError, MemoryError) as e:  # torch's CPU allocator raises RuntimeError
            raise HostAllocationError(
                f"out of host memory: allocating {n} bytes ({_human(n)}, {shape} {dtype}){_for(tier)} "
                f"failed ({str(e).strip().splitlines()[0][:160]}); free host memory or ask for a smaller size"
            ) from e
    try:
        t = torch.zeros(shape, dtype=dtype, device="cpu", pin_memory=True)
    except Exception as e:
        raise PinnedAllocationError(
            f"pinned allocation of {shape} {dtype} ({n} bytes, {_human(n)}{_for(tier)}) failed: "
            f"{str(e).strip()[:200]}"
        ) from e
    if t.numel() and not t.is_pinned():
        raise PinnedAllocationError(f"pinned allocation of {shape} {dtype} came back unpinned")
    return t


def alloc_device(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, tier: Tier | None = None
) -> torch.Tensor:
    """A zero-filled tensor on ``device``; raises InvalidArgumentError past 2**63 - 1 bytes and
    DeviceAllocationError out of memory (a CPU stand-in's allocator failing too), naming ``tier`` if given."""
    n = _nbytes(shape, dtype)
    try:
        return torch.zeros(shape, dtype=dtype, device=device)
    except (torch.OutOfMemoryError, MemoryError) as e:
        oom: BaseException = e
    except RuntimeError as e:
        if device.type != "cpu":
            raise
        oom = e  # torch's CPU allocator raises RuntimeError
    raise DeviceAllocationError(
        f"out of device memory: allocating {n} bytes ({_human(n)}, {shape} {dtype}) on {device}"
        f"{_for(tier)} failed; free device memory or ask for a smaller size"
    ) from oom
