"""Designs stagebuf is compared with, rebuilt from their descriptions (no code of theirs is used).

* vLLM Model Runner V2 (MRV2): its UVA pool (``mrv2_uva_pool``: pinned buffers
  with device views, round robin, no guard, a view slice per call), its staged-write
  tensor (``Mrv2StagedWrite``: Python lists per edit; apply = three int32 UVA pools,
  the contents through a fresh pinned tensor and one async copy, one Triton program
  per edit), and its synchronous-copy fallback for machines without UVA
  (``Mrv2NonUvaBuffer``: pageable memory, a blocking ``copy_``).
* ``uva_pool_cached``: the same round-robin UVA pool on stagebuf's ``UvaBuffer``
  (cached row views): the strongest UVA-pool design, the floor for "no tier slower".
* vLLM V1's ``CpuGpuBuffer``: a fixed pinned buffer and a fixed device buffer, one
  async copy per array.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from stagebuf import UvaBuffer


def _pinned_zeros(shape: int | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, pin_memory=True)


# --- MRV2's synchronous-copy fallback, and a round-robin pool -----------------------------------


class Mrv2NonUvaBuffer:
    """MRV2's synchronous-copy fallback (NonUvaBuffer).

    Pageable memory, and a synchronous ``copy_`` into a fixed device buffer.
    """

    def __init__(self, size: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.cpu = torch.zeros(size, dtype=dtype)
        self.np = self.cpu.numpy()
        self._uva = torch.zeros(size, dtype=dtype, device=device)

    def uva(self, n: int | None = None) -> torch.Tensor:
        if n is None:
            return self._uva.copy_(self.cpu)
        return self._uva[:n].copy_(self.cpu[:n])


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


def mrv2_fallback_pool(size: int, dtype: torch.dtype, device: torch.device) -> RoundRobinPool:
    return RoundRobinPool(size, dtype, lambda shape: Mrv2NonUvaBuffer(shape, dtype, device))


def uva_pool_cached(size: int, dtype: torch.dtype, device: torch.device) -> RoundRobinPool:
    return RoundRobinPool(size, dtype, lambda shape: UvaBuffer(shape, dtype, device))


# --- vLLM Model Runner V2's buffer layer, rebuilt from its design as baselines -------------------

MRV2_SLOTS = 2
"""MRV2's default round-robin depth of a UVA buffer pool."""
MRV2_BLOCK = 1024
"""MRV2's staged-write kernel tile: each program loops over its edit in steps of this many elements."""


class Mrv2UvaBuffer:
    """MRV2's UvaBuffer: zeroed pinned memory and a device view of it.

    stagebuf's :class:`UvaBuffer` allocates the pinned tensor and builds the view;
    unlike it (it caches its row slices), ``uva(n)`` slices the view on every call,
    as MRV2's pool does (``buf.uva[:n]``).
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        inner = UvaBuffer(shape, dtype, device)
        self.cpu = inner.cpu
        self.np = inner.np
        self.view = inner.dev

    def uva(self, n: int | None = None) -> torch.Tensor:
        return self.view if n is None else self.view[:n]


PoolMaker = Callable[[int, torch.dtype, torch.device], RoundRobinPool]


def mrv2_uva_pool(size: int, dtype: torch.dtype, device: torch.device) -> RoundRobinPool:
    """MRV2's UvaBufferPool: ``MRV2_SLOTS`` pinned buffers with device views, round robin, no guard.

    copy_to_uva(x) writes x into the next slot's numpy view (its torch view for a
    tensor) and returns a fresh slice of that slot's device view. The ring is the
    :class:`RoundRobinPool`.
    """
    return RoundRobinPool(size, dtype, lambda shape: Mrv2UvaBuffer(shape, dtype, device), slots=MRV2_SLOTS)


tl: Any = None  # triton.language, set on the first use of the MRV2 kernel (CPU-only installs lack it)
_triton_import_error: list[str] = []


def triton_error() -> str | None:
    """Why Triton cannot be imported here (None: it can); imported once, on first call."""
    global tl
    if tl is None and not _triton_import_error:
        try:
            import triton.language as _tl
        except Exception as e:  # not installed, or broken
            _triton_import_error.append(f"triton is not importable ({type(e).__name__}: {e})"[:200])
        else:
            tl = _tl
    return _triton_import_error[0] if _triton_import_error else None


# Triton reads a kernel's parameter annotations (they select its specialisation): leave them off.
def _mrv2_write_kernel(out, out_stride, rows, starts, contents, cu_lens, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    # One program per staged edit: copy its values into out[row, start:start + len] in BLOCK tiles.
    e = tl.program_id(0)
    row = tl.load(rows + e).to(tl.int64)
    col = tl.load(starts + e)
    end = tl.load(cu_lens + e)
    begin = tl.load(cu_lens + e - 1, mask=e > 0, other=0)
    length = end - begin
    dst = out + row * out_stride + col
    src = contents + begin
    for i in range(0, length, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        m = offs < length
        tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


def _mrv2_kernel(interpret: bool) -> Any:
    """The MRV2 staged-write kernel, compiled by Triton (``interpret``: Triton's CPU interpreter)."""
    from stagebuf._staged_write import triton_function

    err = triton_error()
    if err is not None:
        raise RuntimeError(f"mrv2_staged_write needs Triton: {err}")
    return triton_function(_mrv2_write_kernel, interpret)


def _mrv2_torch_apply(
    out: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor, contents: torch.Tensor, cu_lens: torch.Tensor
) -> None:
    """What the kernel does, in torch ops (CPU tests: no Triton launch without a GPU)."""
    lens = torch.diff(cu_lens.long(), prepend=cu_lens.new_zeros(1, dtype=torch.int64))
    edit = torch.repeat_interleave(torch.arange(rows.shape[0], device=rows.device), lens)
    j = torch.arange(contents.shape[0], device=rows.device) - (cu_lens.long() - lens)[edit]
    out[rows.long()[edit], starts.long()[edit] + j] = contents


Mrv2Launch = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def _mrv2_launcher(kernel: str, device: torch.device) -> Mrv2Launch:
    if kernel == "torch":
        return _mrv2_torch_apply
    if kernel not in ("triton", "interpret"):
        raise ValueError(f"kernel={kernel!r}; allowed: 'triton', 'interpret', 'torch'")
    jit = _mrv2_kernel(interpret=kernel == "interpret")
    other_device = (
        device.type == "cuda" and device.index is not None and (device.index != torch.cuda.current_device())
    )

    def launch(
        out: torch.Tensor,
        rows: torch.Tensor,
        starts: torch.Tensor,
        contents: torch.Tensor,
        cu_lens: torch.Tensor,
    ) -> None:
        grid = (rows.shape[0],)
        if other_device:
            with torch.cuda.device(device):
                jit[grid](out, out.stride(0), rows, starts, contents, cu_lens, BLOCK=MRV2_BLOCK)
        else:
            jit[grid](out, out.stride(0), rows, starts, contents, cu_lens, BLOCK=MRV2_BLOCK)

    return launch


class Mrv2StagedWrite:
    """MRV2's StagedWriteTensor, rebuilt from its design.

    Staging appends to Python lists (rows, starts, cumulative lengths; the values
    with ``list.extend``). ``apply_write`` moves rows, starts and cumulative lengths
    through three int32 UVA pools, the values through a new pinned tensor and one
    asynchronous copy, launches one kernel with one program per edit, then clears
    the lists. ``make_pool``, ``kernel`` and ``pin_contents`` exist for CPU tests
    only (a pageable pool stand-in, the torch twin or Triton's interpreter); the
    bench uses the defaults: UVA pools, compiled Triton, pinned contents.
    """

    def __init__(
        self,
        shape: tuple[int, int],
        dtype: torch.dtype,
        device: torch.device,
        make_pool: PoolMaker = mrv2_uva_pool,
        kernel: str = "triton",
        pin_contents: bool = True,
    ):
        self.dtype = dtype
        self.device = device
        self.gpu = torch.zeros(shape, dtype=dtype, device=device)
        self._indices: list[int] = []
        self._starts: list[int] = []
        self._contents: list[int | float] = []
        self._cu_lens: list[int] = []
        self._index_pool = make_pool(shape[0], torch.int32, device)
        self._start_pool = make_pool(shape[0], torch.int32, device)
        self._cu_len_pool = make_pool(shape[0], torch.int32, device)
        self._pin = pin_contents
        self._launch = _mrv2_launcher(kernel, device)
        self.kernel = kernel

    def stage_write(self, index: int, start: int, values: list[int]) -> None:
        assert index >= 0
        assert start >= 0
        if not values:
            return
        self._indices.append(index)
        self._starts.append(start)
        self._contents.extend(values)
        self._cu_lens.append(len(self._contents))

    def apply_write(self) -> None:
        if not self._indices:
            return
        rows = self._index_pool.copy_to_uva(self._indices)
        starts = self._start_pool.copy_to_uva(self._starts)
        cu_lens = self._cu_len_pool.copy_to_uva(self._cu_lens)
        contents = torch.tensor(self._contents, dtype=self.dtype, pin_memory=self._pin).to(
            self.device, non_blocking=True
        )
        self._launch(self.gpu, rows, starts, contents, cu_lens)
        self.clear_staged_writes()

    def clear_staged_writes(self) -> None:
        self._indices.clear()
        self._starts.clear()
        self._contents.clear()
        self._cu_lens.clear()


class CpuGpuBuffer:
    """vLLM V1's CpuGpuBuffer: a fixed pinned buffer and a fixed device buffer, one async copy."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device):
        self.cpu = _pinned_zeros(size, dtype)
        self.np = self.cpu.numpy()
        self.gpu = torch.zeros(size, dtype=dtype, device=device)

    def copy_to_gpu(self, n: int) -> torch.Tensor:
        return self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)
