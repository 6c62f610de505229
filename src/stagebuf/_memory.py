"""Allocation, with failures turned into errors that say what to do."""

from __future__ import annotations

import torch

from ._errors import DeviceAllocationError, PinnedAllocationError


def alloc_host(shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """A zero-filled host tensor, page-locked when ``pinned`` (verified)."""
    if not pinned:
        return torch.zeros(shape, dtype=dtype)
    try:
        t = torch.zeros(shape, dtype=dtype, pin_memory=True)
    except Exception as e:
        raise PinnedAllocationError(
            f"pinned allocation of {shape} {dtype} failed: {str(e).strip()[:200]}"
        ) from e
    if t.numel() and not t.is_pinned():
        raise PinnedAllocationError(f"pinned allocation of {shape} {dtype} came back unpinned")
    return t


def alloc_device(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor on ``device``; out of memory raises DeviceAllocationError."""
    try:
        return torch.zeros(shape, dtype=dtype, device=device)
    except torch.OutOfMemoryError as e:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        raise DeviceAllocationError(
            f"out of device memory allocating {nbytes} bytes ({shape} {dtype}) on {device}: "
            "free device memory or lower the buffer size"
        ) from e
