"""What the micro and writes workloads compare stagebuf with: vLLM's own classes (:mod:`benchmarks.vllm_mrv2`;
MRV2's ``UvaBufferPool`` with and without pinned memory and ``StagedWriteTensor``, V1's ``CpuGpuBuffer``), a
round-robin UVA pool without a guard (the floor for "no tier slower") and per-row copies.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from stagebuf import UvaBuffer

from . import vllm_mrv2

MRV2_SLOTS = 2  # MRV2's default round-robin depth of a UVA buffer pool (``_DEFAULT_MAX_CONCURRENCY``).


class RoundRobinPool:
    """A UvaBufferPool.copy_to_uva as MRV2 designs it, on stagebuf's UvaBuffer: round robin over slots."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device, slots: int = MRV2_SLOTS):
        self._make = lambda n: UvaBuffer((n,), dtype, device)
        self._bufs = [self._make(size) for _ in range(slots)]
        self._curr = 0

    def copy_to_uva(self, x: np.ndarray | torch.Tensor | list[int]) -> torch.Tensor:
        self._curr = (self._curr + 1) % len(self._bufs)
        buf, n = self._bufs[self._curr], len(x)
        if n > buf.cpu.shape[0]:
            buf = self._bufs[self._curr] = self._make(1 << (n - 1).bit_length())
        if isinstance(x, torch.Tensor):
            buf.cpu[:n] = x
        else:
            buf.np[:n] = x
        return buf.uva(n)


class RowCopyTable:
    """An engine's table: a host copy edited in place, one indexed row copy per edit (writes)."""

    def __init__(self, shape: tuple[int, int], device: torch.device, pinned: bool):
        self.cpu = torch.zeros(shape, dtype=torch.int32, pin_memory=pinned)
        self.np = self.cpu.numpy()
        self.dev = torch.zeros(shape, dtype=torch.int32, device=device)
        self.non_blocking = pinned

    def write(self, row: int, start: int, values: list[int]) -> None:
        end = start + len(values)
        self.np[row, start:end] = values
        self.dev[row, start:end].copy_(self.cpu[row, start:end], non_blocking=self.non_blocking)


def _bu(device: torch.device, pin: bool, uva: bool | None = None) -> Any:
    return vllm_mrv2.load("vllm", pin=pin, device=device, uva=uva).buffer_utils


def mrv2_uva_pool(size: int, dtype: torch.dtype, device: torch.device) -> Any:
    """vLLM's own UvaBufferPool with pinned memory: device views of pinned slots, round robin."""
    if device.type != "cuda":
        raise ValueError(f"vLLM's UVA pool needs a CUDA device; got {device}")
    return _bu(device, True).UvaBufferPool(size, dtype)


def mrv2_fallback_pool(size: int, dtype: torch.dtype, device: torch.device) -> Any:
    """vLLM's own UvaBufferPool without pinned memory: its NonUvaBuffer fallback."""
    return _bu(device, False, False).UvaBufferPool(size, dtype)


def mrv2_staged_write(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> Any:
    """vLLM's own StagedWriteTensor (pinned memory and UVA where the device has them)."""
    return _bu(device, device.type == "cuda").StagedWriteTensor(shape, dtype, device)


def cpu_gpu_buffer(size: int, dtype: torch.dtype, device: torch.device) -> Any:
    """vLLM V1's own CpuGpuBuffer: one async copy per ``copy_to_gpu(n)``."""
    return vllm_mrv2.load("vllm", device=device).CpuGpuBuffer(size, dtype=dtype, device=device)


def triton_error() -> str | None:
    """Why Triton cannot be imported here (None: it can)."""
    try:
        import triton  # noqa: F401
    except Exception as e:  # not installed, or broken
        return f"triton is not importable ({type(e).__name__}: {e})"[:200]
    return None
