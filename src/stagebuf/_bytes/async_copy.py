"""``async_copy_to_gpu``: one array to the device, pinned only where pinning works."""

from __future__ import annotations

import numpy as np
import torch

from .._common.convert import host_array, torch_dtype
from .._common.errors import ArgumentTypeError, InvalidArgumentError
from .._common.log import warn_once
from .._common.types import DeviceLike, DTypeLike, HostData
from .._tiers.probe import capabilities

_ANY_RANK = tuple(range(0, 9))


def async_copy_to_gpu(
    x: HostData, out: torch.Tensor | None = None, device: DeviceLike = None, dtype: DTypeLike | None = None
) -> torch.Tensor:
    """Copy host data to the device, asynchronously: ``out``, or a new tensor; it never aliases ``x``.

    Through a temporary pinned copy where pinning works, else CUDA stages the data from pageable memory:
    either way ``x`` may change once the call returns. Ordered on the current stream (synchronous on the CPU).

    Parameters
    ----------
    x : list, tuple, numpy.ndarray or torch.Tensor
        The host data, of rank 0 to 8: a (nested) list or tuple of numbers, an array or a CPU tensor.
    out : torch.Tensor, optional
        A tensor to fill and return instead of a new one: of ``x``'s shape, on the target device.
    device : torch.device, str, int or None, optional
        The target device, as for :func:`capabilities`.
    dtype : torch.dtype, numpy.dtype, type or str, optional
        The result's dtype, which ``x``'s values must fit exactly (no fractions, NaN or inf into an integer
        dtype, say); None: ``out``'s, else ``x``'s own.

    Raises
    ------
    ArgumentTypeError
        If ``out`` is neither a tensor nor None, ``dtype``, ``out``'s or ``x``'s dtype is not supported, or
        ``x`` is of another type or mixes bools and numbers (in itself, or with the dtype).
    InvalidArgumentError
        If ``dtype`` and ``out.dtype`` differ, ``out`` has another shape than ``x`` or another device, or
        ``x`` is a tensor on an accelerator, ragged, of rank over 8 or holds a value the dtype cannot hold.
    SetupError, TierUnavailableError, ArgumentTypeError
        As :func:`capabilities` raises them for ``device`` and the settings.
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
    if caps.device_type == "cpu":  # tier HOST, or PAGEABLE forced on the CPU
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
