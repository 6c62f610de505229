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

MAX_BYTES = 2**63 - 1
"""The most bytes one tensor can hold: torch counts sizes and bytes in int64."""


def _check_size(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Refuse a shape torch cannot count (past int64): torch would raise its own TypeError or RuntimeError."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > MAX_BYTES or any(n > MAX_BYTES for n in shape):
        raise InvalidArgumentError(
            f"a tensor of shape {shape} and dtype {dtype} would hold {nbytes} bytes; "
            f"allowed: at most {MAX_BYTES} bytes (2**63 - 1: torch counts bytes in int64)"
        )


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


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
    """A zero-filled host tensor, page-locked when ``pinned`` (verified).

    A shape past 2**63 - 1 bytes raises InvalidArgumentError (torch's own error would be a
    TypeError or RuntimeError). Plain host memory running out raises HostAllocationError (a
    MemoryError) naming the bytes and ``tier`` (the tier the memory is for, where known).
    """
    _check_size(shape, dtype)
    if not pinned:
        try:
            return torch.zeros(shape, dtype=dtype)
        except (RuntimeError, MemoryError) as e:  # torch's CPU allocator raises RuntimeError
            n = _nbytes(shape, dtype)
            raise HostAllocationError(
                f"out of host memory: allocating {n} bytes ({_human(n)}, {shape} {dtype}){_for(tier)} "
                f"failed ({str(e).strip().splitlines()[0][:160]}); free host memory or ask for a "
                "smaller size"
            ) from e
    try:
        t = torch.zeros(shape, dtype=dtype, pin_memory=True)
    except Exception as e:
        n = _nbytes(shape, dtype)
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
    """A zero-filled tensor on ``device``; out of memory raises DeviceAllocationError.

    A shape past 2**63 - 1 bytes raises InvalidArgumentError, as in ``alloc_host``; the
    error names ``tier`` where given. (A CPU ``device`` stands in for device memory on
    tier PAGEABLE: its allocator failing is out of memory too.)
    """
    _check_size(shape, dtype)
    try:
        return torch.zeros(shape, dtype=dtype, device=device)
    except (torch.OutOfMemoryError, MemoryError) as e:
        oom: BaseException = e
    except RuntimeError as e:
        if device.type != "cpu":
            raise
        oom = e  # a CPU stand-in for device memory: torch's CPU allocator raises RuntimeError
    n = _nbytes(shape, dtype)
    raise DeviceAllocationError(
        f"out of device memory: allocating {n} bytes ({_human(n)}, {shape} {dtype}) on {device}"
        f"{_for(tier)} failed; free device memory or ask for a smaller size"
    ) from oom
