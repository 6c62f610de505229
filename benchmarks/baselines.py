"""What stagebuf is compared with.

* vLLM Model Runner V2 (MRV2): vLLM's own classes (``vllm_mrv2.NEWEST``'s), fetched at run time and
  loaded by ``vllm_mrv2`` (never committed): its ``UvaBufferPool`` with pinned memory
  (``mrv2_uva_pool``) and without (``mrv2_fallback_pool``: its NonUvaBuffer fallback),
  and its ``StagedWriteTensor`` (``mrv2_staged_write``).
* ``uva_pool_cached``: the same round-robin UVA pool on stagebuf's ``UvaBuffer``
  (cached row views): the strongest UVA-pool design, the floor for "no tier slower".
* vLLM V1's ``CpuGpuBuffer`` (``vllm/v1/utils.py``, still in every release of ``vllm_mrv2.RELEASES``),
  its own class: a fixed pinned buffer and a fixed device buffer, one async copy per array.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from stagebuf import UvaBuffer

from . import vllm_mrv2


def _pinned_zeros(shape: int | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, pin_memory=True)


# --- a round-robin pool on stagebuf's UvaBuffer ------------------------------------------------


class _Buf(Protocol):
    cpu: torch.Tensor
    np: np.ndarray

    def uva(self, n: int | None = None) -> torch.Tensor: ...


class RoundRobinPool:
    """A UvaBufferPool.copy_to_uva as MRV2 designs it: round robin over slots, no guard."""

    def __init__(
        self, size: int, dtype: torch.dtype, make: Callable[[tuple[int, ...]], _Buf], slots: int = 2
    ):
        self._make = make
        self._bufs = [make((size,)) for _ in range(slots)]
        self._n = slots
        self._curr = 0

    def copy_to_uva(self, x: np.ndarray | torch.Tensor | list[int]) -> torch.Tensor:
        self._curr = (self._curr + 1) % self._n
        buf = self._bufs[self._curr]
        n = len(x)
        if n > buf.cpu.shape[0]:
            buf = self._make((1 << (n - 1).bit_length(), *buf.cpu.shape[1:]))
            self._bufs[self._curr] = buf
        if isinstance(x, torch.Tensor):
            buf.cpu[:n] = x
        else:
            buf.np[:n] = x
        return buf.uva(n)


def uva_pool_cached(size: int, dtype: torch.dtype, device: torch.device) -> RoundRobinPool:
    return RoundRobinPool(size, dtype, lambda shape: UvaBuffer(shape, dtype, device))


# --- vLLM Model Runner V2's buffer layer: vLLM's own classes (vllm_mrv2.NEWEST's) ----------------

MRV2_SLOTS = 2
"""MRV2's default round-robin depth of a UVA buffer pool (``_DEFAULT_MAX_CONCURRENCY``)."""


class Pool(Protocol):
    def copy_to_uva(self, x: Any) -> torch.Tensor: ...


PoolMaker = Callable[[int, torch.dtype, torch.device], Pool]


def _vllm(device: torch.device, pin: bool, uva: bool | None = None) -> Any:
    """vLLM's own ``buffer_utils`` (``vllm_mrv2.NEWEST``'s), on a machine with or without pinned memory."""
    return vllm_mrv2.load("vllm", pin=pin, device=device, uva=uva).buffer_utils


def mrv2_uva_pool(size: int, dtype: torch.dtype, device: torch.device) -> Pool:
    """vLLM's own UvaBufferPool with pinned memory: device views of pinned slots, round robin."""
    if device.type != "cuda":
        raise ValueError(f"vLLM's UVA pool needs a CUDA device; got {device}")
    return _vllm(device, pin=True).UvaBufferPool(size, dtype)  # type: ignore[no-any-return]


def mrv2_fallback_pool(size: int, dtype: torch.dtype, device: torch.device) -> Pool:
    """vLLM's own UvaBufferPool without pinned memory: its NonUvaBuffer fallback (a copy per call;
    on a CPU the CPU stands in for the device)."""
    return _vllm(device, pin=False, uva=False).UvaBufferPool(size, dtype)  # type: ignore[no-any-return]


def mrv2_staged_write(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> Any:
    """vLLM's own StagedWriteTensor (pinned memory and UVA where the device has them)."""
    return _vllm(device, pin=device.type == "cuda").StagedWriteTensor(shape, dtype, device)


def triton_error() -> str | None:
    """Why Triton cannot be imported here (None: it can)."""
    try:
        import triton  # noqa: F401
    except Exception as e:  # not installed, or broken
        return f"triton is not importable ({type(e).__name__}: {e})"[:200]
    return None


def vllm_error() -> str | None:
    """Why vLLM's MRV2 modules (``vllm_mrv2.NEWEST``'s) cannot be loaded here (None: they can)."""
    return vllm_mrv2.available()


def cpu_gpu_buffer(size: int, dtype: torch.dtype, device: torch.device) -> Any:
    """vLLM V1's own CpuGpuBuffer (``vllm_mrv2.NEWEST``'s): a fixed pinned buffer and a fixed device buffer,
    one async copy per ``copy_to_gpu(n)``."""
    return vllm_mrv2.load("vllm", pin=True, device=device).CpuGpuBuffer(size, dtype=dtype, device=device)
