"""Step mode of the vLLM plugin: a step's staged writes, publishes and copies in one transfer, one launch.

Between the start of ``execute_model`` and its ``async_tensor_h2d(..., out=...)`` (the
``query_start_loc`` copy), the step-mode classes and ``async_tensor_h2d`` defer into the device's
:class:`StepBatch`, flushed as one staged array and one Triton launch (docs/DESIGN.md, "Step mode").
Outside that window each call adds and flushes at once: the same path, one call at a time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from .._common.convert import check_rows, fill_host, numpy_dtype, shape_of, torch_dtype
from .._common.sealed import Cell, Sealed, read_only
from .._common.tier import Tier
from .._common.types import DeviceLike, DTypeLike
from .._device.memory import alloc_device, alloc_host
from .._rings.pool import UvaBackedTensor
from .._rings.staged_write import FusedStagedWriter, StagedWriteTensor
from .._rings.staged_write.launcher import Launcher, WriteBatch
from .._tiers.probe import capabilities
from .._tiers.settings import Kernel
from .vllm_step_batch import BATCHES, StepBatch, WordTarget, batch

_WINDOW: list[Any] = [False, None]
"""Whether calls are deferred now, and the batch the window's first deferred call joined."""


def _done(b: StepBatch) -> None:
    """After adding: inside the window, remember the window's batch; outside it, write at once."""
    if not _WINDOW[0]:
        b.flush()
    elif _WINDOW[1] is None:
        _WINDOW[1] = b


@contextmanager
def window() -> Iterator[None]:
    """Defer the step-mode calls made inside it; flush what is left on leaving."""
    if _WINDOW[0]:  # nested (execute_model calling itself): the outer one flushes
        yield
        return
    _WINDOW[0], _WINDOW[1] = True, None
    try:
        yield
    finally:
        close_window()


def close_window() -> None:
    """End the window now (the step's inputs are complete): flush, and stop deferring."""
    _WINDOW[0], _WINDOW[1] = False, None
    for b in BATCHES.values():
        if b.nwords or b.step is not None:
            b.flush()


def reset() -> None:
    """Forget every batch (tests; the plugin's unregister)."""
    for b in list(BATCHES.values()):
        b.flush()
    BATCHES.clear()
    _by_key.clear()
    _outs.clear()
    _WINDOW[0], _WINDOW[1] = False, None


# --- the step-mode classes --------------------------------------------------------------------


class StepLauncher(Launcher):
    """The launch step of the step-mode writers: an apply's checked batches join the device's step batch
    (written with the step's other writes in one launch; outside a window, at once)."""

    def __init__(self, device: torch.device, max_concurrency: int, capacity: int):
        super().__init__(device, max_concurrency, capacity)  # (its ring is never made: stats stay zero)
        self.batch = batch(device, capabilities(device).tier)

    def launch(self, batches: Sequence[WriteBatch]) -> Kernel:
        b = self.batch
        for g in batches:
            b.add_batch(g)
        _done(b)
        return b.kernel


class StepStagedWriteTensor(StagedWriteTensor):
    """``StagedWriteTensor`` whose applies join the step's batch (one launch for the step)."""

    launcher_class = StepLauncher


class StepFusedStagedWriter(FusedStagedWriter):
    """``FusedStagedWriter`` whose applies join the step's batch."""

    launcher_class = StepLauncher


@read_only({"gpu": "copy_to_uva() sets it; write the host values through .np or .cpu"})
class StepBackedTensor(Sealed):
    """``UvaBackedTensor``'s surface with a fixed device tensor: a publish is one edit of the step's batch.

    ``.gpu`` is always a view of the same device memory (the first ``n`` rows of the
    last ``copy_to_uva(n)``); the write is stream-ordered, so kernels enqueued before
    a publish read the values before it. For a dtype whose rows are not whole 32-bit
    words the class makes a plain :class:`UvaBackedTensor` instead. ``pool`` is None:
    no pool publishes the rows.
    """

    def __new__(cls, size: int | tuple[int, ...], dtype: DTypeLike, *args: Any, **kwargs: Any) -> Any:
        if numpy_dtype(torch_dtype(dtype)).itemsize % 4:  # (then __init__ does not run: not this class)
            return UvaBackedTensor(size, dtype, *args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        size: int | tuple[int, ...],
        dtype: DTypeLike,
        max_concurrency: int | None = None,
        device: DeviceLike = None,
    ):
        shape = shape_of(size)
        caps = capabilities(device)
        self.dtype = torch_dtype(dtype)
        self.cpu = alloc_host(shape, self.dtype, pinned=False)
        self.np = self.cpu.numpy()
        self.pool = None
        self.device = caps.device
        self._fixed = alloc_device(shape, self.dtype, caps.device)
        self._step_batch = batch(caps.device, caps.tier)
        self._target = self._step_batch.target(self._fixed)
        self._views: dict[int, tuple[torch.Tensor, np.ndarray]] = {}
        """Per row count: the device view, and the host rows as 32-bit words."""
        self._gpu = Cell(self._fixed)
        self._freeze()

    @property
    def gpu(self) -> torch.Tensor:
        """The device tensor: the rows of the last ``copy_to_uva()`` (at first, all rows, zeros)."""
        return self._gpu.value

    def copy_to_uva(self, n: int | None = None) -> torch.Tensor:
        """Publish the first ``n`` rows (None: all) into the fixed device tensor, in the step's batch; its
        first ``n`` rows, also kept as ``.gpu``. Raises as :meth:`UvaBackedTensor.copy_to_uva`."""
        rows = self.np.shape[0] if n is None else n
        got = self._views.get(rows) if type(rows) is int else None  # (True == 1: no cache hit for a bool)
        if got is None:
            if type(rows) is not int or not 0 <= rows <= self.np.shape[0]:
                rows = check_rows(n, self.np.shape[0])  # raises UvaBackedTensor's error, or an int-like n
            got = self._views[rows] = (self._fixed[:rows], self.np[:rows].reshape(-1).view(np.int32))
        self._gpu.value = got[0]
        if rows:
            b = self._step_batch
            b.add_whole(self._target, got[1].copy())
            _done(b)
        return got[0]

    @property
    def tier(self) -> Tier:
        """The tier of the device's step batch."""
        return self._step_batch.tier

    def release_thread(self) -> None:
        """Nothing to hand over: no pool, and the step's batch is the engine thread's."""

    def stats(self) -> dict[str, int]:
        """As :meth:`UvaBackedTensor.stats`; all zero (the step's batch copies for it)."""
        return {"transfers": 0, "bytes": 0, "growths": 0, "guard_waits": 0}

    _COPY_IN = ("np", "cpu")

    def _copy_in(self, name: str, value: Any) -> None:  # (Sealed's hook: assigning .np or .cpu copies in)
        fill_host(self.np, value, self.dtype, f"UvaBackedTensor.{name}")


def wrap_h2d(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """vLLM's ``async_tensor_h2d`` in step mode: staged in the step's batch inside the window."""

    @functools.wraps(original)
    def async_tensor_h2d(
        data: Any, device: Any = None, dtype: torch.dtype | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        if not _WINDOW[0]:
            return original(data, device=device, dtype=dtype, out=out)
        arr = _host(data)
        b: StepBatch | None = _WINDOW[1]
        if b is None:
            key = out.device if out is not None else device
            b = _by_key.get(key) or _batch_for(key)
        if b is None or arr is None:  # not a case step mode stages: vLLM's own copy, in order
            close_window()
            return original(data, device=device, dtype=dtype, out=out)
        if out is None:
            want = numpy_dtype(dtype) if dtype is not None else arr.dtype
            return b.open_step().stage(arr.astype(want, copy=False))
        got = _outs.get((id(out), id(b)))
        if got is None or got[0] is not out:
            got = _outs[(id(out), id(b))] = (out, _out_layout(out, b))
        layout = got[1]
        if layout is None or arr.size != layout[1] or (dtype is not None and dtype != out.dtype):
            close_window()
            return original(data, device=device, dtype=dtype, out=out)
        # no copy where it is contiguous and of out's dtype: the flush below reads it at once
        b.add_whole(layout[2], np.ascontiguousarray(arr.reshape(-1), layout[0]).view(np.int32))
        close_window()  # the step's inputs are complete: its kernels come next
        return out

    return async_tensor_h2d


_outs: dict[tuple[int, int], tuple[torch.Tensor, tuple[np.dtype, int, WordTarget] | None]] = {}
"""Per ``out`` tensor of ``async_tensor_h2d`` and batch: its numpy dtype, size and batch target (None: not one
step mode writes: not contiguous, or not whole 32-bit words)."""


def _out_layout(out: torch.Tensor, b: StepBatch) -> tuple[np.dtype, int, WordTarget] | None:
    dt = numpy_dtype(out.dtype)
    if not out.is_contiguous() or dt.itemsize % 4:
        return None
    return dt, out.numel(), b.target(out)


_by_key: dict[Any, StepBatch] = {}
"""async_tensor_h2d's ``device`` (or ``out.device``) as given -> its device's batch."""


def _batch_for(key: Any) -> StepBatch | None:
    """The batch of the device ``key`` names (cached per key), or None if stagebuf does not run there."""
    if key is None:
        return None
    try:
        dev = capabilities(key).device
    except Exception:
        return None
    b = _by_key[key] = batch(dev, capabilities(dev).tier)
    return b


def _host(data: Any) -> np.ndarray | None:
    """``data`` as a 1-D or 2-D numpy array of a supported dtype, or None (then vLLM's own copy)."""
    if isinstance(data, np.ndarray):
        arr = data
    elif isinstance(data, torch.Tensor) and data.device.type == "cpu" and not data.requires_grad:
        try:
            arr = data.numpy()
        except (TypeError, RuntimeError):
            return None
    else:
        return None
    if arr.ndim not in (1, 2) or arr.dtype.kind not in "iuf" or arr.size == 0:
        return None
    return arr


def wrap_execute_model(original: Callable[..., Any]) -> Callable[..., Any]:
    """``GPUModelRunner.execute_model`` in step mode: its input staging inside one window."""

    @functools.wraps(original)
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        dummy = kwargs.get("dummy_run", args[1] if len(args) > 1 else False)
        if dummy or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            return original(self, scheduler_output, *args, **kwargs)
        with window():
            return original(self, scheduler_output, *args, **kwargs)

    execute_model.__stagebuf_step__ = True  # type: ignore[attr-defined]
    return execute_model
