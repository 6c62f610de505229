"""``async_copy_to_gpu``: one array to the device, pinned only where pinning works."""

from __future__ import annotations

import numpy as np
import torch

from ._convert import host_array, torch_dtype
from ._errors import ArgumentTypeError, InvalidArgumentError
from ._log import warn_once
from ._probe import capabilities
from ._tier import Tier
from ._types import DeviceLike, DTypeLike, HostData

_ANY_RANK = tuple(range(0, 9))


def async_copy_to_gpu(
    x: HostData, out: torch.Tensor | None = None, device: DeviceLike = None, dtype: DTypeLike | None = None
) -> torch.Tensor:
    """Copy host data ``x`` (list, ndarray or CPU tensor) to the device, asynchronously.

    Where pinned memory is available the data goes through a temporary pinned
    copy (torch's pinned allocator keeps it alive until the copy is done);
    elsewhere it is copied from pageable memory, which CUDA stages before the
    call returns. The result never aliases ``x``. ``out``, when given, must have
    ``x``'s shape and the target device (and ``dtype``, when both are given); it is
    filled and returned.
    """
    if out is not None and not isinstance(out, torch.Tensor):
        raise ArgumentTypeError(f"out must be a torch.Tensor or None; got {type(out).__name__}")
    if dtype is not None:
        want: torch.dtype | None = torch_dtype(dtype)
        if out is not None and out.dtype != want:
            # copy_ would convert silently (and truncate fractions): refuse the mismatch instead
            raise InvalidArgumentError(
                f"dtype={want} but out.dtype={out.dtype}; pass one of them, or the same"
            )
    elif out is not None:
        want = torch_dtype(out.dtype, "out.dtype")  # values must fit what they are copied into
    else:
        want = None
    arr = host_array(x, want, "x", ndims=_ANY_RANK)
    caps = capabilities(device)
    if out is not None and (tuple(out.shape) != arr.shape or out.device != caps.device):
        raise InvalidArgumentError(
            f"out has shape {tuple(out.shape)} on {out.device}; expected shape {arr.shape} on {caps.device}"
        )
    src = torch.from_numpy(np.ascontiguousarray(arr))
    if caps.tier is Tier.HOST or caps.device_type == "cpu":
        return out.copy_(src) if out is not None else src.clone()
    if caps.pin_memory:
        try:
            src = src.pin_memory()
        except Exception as e:  # memlock exhausted at run time
            warn_once(
                ("async-copy-pin", str(caps.device)),
                f"pinning for async_copy_to_gpu failed on {caps.device} ({e}); copying from pageable memory",
            )
    if out is not None:
        return out.copy_(src, non_blocking=True)
    return src.to(caps.device, non_blocking=True)
