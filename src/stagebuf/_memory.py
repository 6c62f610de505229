"""Allocation, with failures turned into errors that say what to do."""

from __future__ import annotations

import math

import torch

from ._errors import DeviceAllocationError, InvalidArgumentError, PinnedAllocationError

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


def alloc_host(shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """A zero-filled host tensor, page-locked when ``pinned`` (verified).

    A shape past 2**63 - 1 bytes raises InvalidArgumentError (torch's own error would be a
    TypeError or RuntimeError).
    """
    _check_size(shape, dtype)
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
    """A zero-filled tensor on ``device``; out of memory raises DeviceAllocationError.

    A shape past 2**63 - 1 bytes raises InvalidArgumentError, as in ``alloc_host``.
    """
    _check_size(shape, dtype)
    try:
        return torch.zeros(shape, dtype=dtype, device=device)
    except torch.OutOfMemoryError as e:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        raise DeviceAllocationError(
            f"out of device memory allocating {nbytes} bytes ({shape} {dtype}) on {device}: "
            "free device memory or lower the buffer size"
        ) from e
