"""Zero-copy device views of pinned host memory: ``cudaHostGetDevicePointer`` (cuda-bindings), wrapped by
torch through ``__cuda_array_interface__``. A view that does not alias the host memory (same address, right
device) raises UvaError, so the caller can fall back to a copy tier.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from .._common.errors import UvaError

_TYPESTR = {
    torch.bool: "|b1", torch.uint8: "|u1", torch.int8: "|i1", torch.int16: "<i2", torch.int32: "<i4",
    torch.int64: "<i8", torch.float16: "<f2", torch.float32: "<f4", torch.float64: "<f8",
}  # fmt: skip


def load_cudart() -> ModuleType:
    """cuda-bindings' runtime module (raises ImportError when not installed)."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        from cuda import cudart  # cuda-python < 12.6
    module: ModuleType = cudart
    return module


class _ArrayInterface:
    """Carries ``__cuda_array_interface__`` and keeps the host tensor alive."""

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str, owner: torch.Tensor):
        self.__cuda_array_interface__ = {
            "data": (ptr, False),
            "shape": shape,
            "typestr": typestr,
            "strides": None,
            "version": 3,
        }
        self.owner = owner


def _check(err: Any, what: str) -> None:
    code = int(err[0] if isinstance(err, tuple) else err)
    if code != 0:
        raise UvaError(f"{what} failed with CUDA error {code} ({err})")


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A device tensor aliasing the pinned, contiguous CPU tensor ``host``."""
    if host.numel() == 0:  # nothing to alias (torch reports empty tensors as unpinned)
        return torch.empty(host.shape, dtype=host.dtype, device=device)
    if not host.is_contiguous():
        raise UvaError("host tensor must be contiguous")
    if not host.is_pinned():
        raise UvaError("host tensor is not pinned (page-locked)")
    cudart = load_cudart()
    err, dptr = cudart.cudaHostGetDevicePointer(host.data_ptr(), 0)
    _check(err, "cudaHostGetDevicePointer")
    dptr = int(dptr)
    iface = _ArrayInterface(dptr, tuple(host.shape), _TYPESTR[host.dtype], host)
    with torch.cuda.device(device):
        view = torch.as_tensor(iface, device=device)
    if view.data_ptr() != dptr or view.device != device:
        raise UvaError(
            f"torch copied instead of aliasing (view at {view.data_ptr():#x} on {view.device}, "
            f"host mapping at {dptr:#x} for {device})"
        )
    return view
