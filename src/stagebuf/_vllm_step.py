"""Step mode of the vLLM plugin: a step's staged writes, publishes and copies in one transfer, one launch.

vLLM's model runner applies its staged writes (``RequestState``, ``BlockTables``),
publishes the sampler's per-request parameters and copies ``idx_mapping`` and
``query_start_loc`` one object at a time: a transfer and a launch each. In step
mode the objects are this module's subclasses, and every such call made between
the start of ``execute_model`` and its ``async_tensor_h2d(..., out=...)`` (the
``query_start_loc`` copy, the last before the first kernel reads the step's
inputs) is *deferred* into the device's :class:`StepBatch`:

* a staged-write apply adds its checked edits (``edits.gather``: a bad value still
  raises at the apply, and nothing of it is deferred);
* a ``UvaBackedTensor`` publish adds one edit that writes its host rows into its
  *fixed* device tensor (``.gpu`` keeps one address, as a CUDA graph wants);
* ``async_tensor_h2d(x)`` stages ``x`` in the batch's ``StepStager`` step and
  returns its device view; with ``out=`` it adds an edit of ``out`` and flushes.

Flushing packs every edit as 32-bit words (target address, first word, length,
source) into the same stager step, publishes it (one copy on PINNED and PAGEABLE,
none on UVA) and runs one Triton launch that writes them all (without Triton: one
``index_copy_`` per target; on HOST: numpy). A target written twice in one batch
starts a second wave (a second launch), so later writes still win. Outside the
window each call adds and flushes at once: the same path, one call at a time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from ._convert import numpy_dtype, shape_of, torch_dtype
from ._memory import alloc_device, alloc_host
from ._pool import UvaBackedTensor
from ._probe import capabilities
from ._staged_write import FusedStagedWriter, StagedWriteTensor
from ._staged_write.kernel import _block_for, _launch_triton, triton_usable
from ._staged_write.launcher import Gathered
from ._stager import Step, StepStager
from ._tier import Tier
from ._types import DeviceLike, DTypeLike

_WINDOW: list[Any] = [False, None]
"""Whether calls are deferred now (between execute_model's start and its flush), and the batch the
window's first deferred call joined (``async_tensor_h2d`` stages into it)."""


class _Target:
    """A device tensor the batch writes, as 32-bit words."""

    __slots__ = ("tensor", "words", "words_np", "ptr")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.words = tensor.view(-1).view(torch.int32)
        self.words_np = self.words.numpy() if tensor.device.type == "cpu" else None
        self.ptr = tensor.data_ptr()


class StepBatch:
    """One device's deferred writes and copies of the current step (see the module docstring)."""

    def __init__(self, device: torch.device, tier: Tier):
        self.device = device
        self.tier = tier
        self.stager = StepStager(device, capacity=1 << 16)
        self.triton = tier is not Tier.HOST and triton_usable(device)
        self.step: Step | None = None
        self.targets: dict[int, _Target] = {}
        self.items: list[tuple[_Target, np.ndarray, np.ndarray, np.ndarray]] = []
        """Per deferred write: target, first word of each edit, word count of each edit, the words."""
        self.wave_starts: list[int] = [0]
        self.in_wave: set[int] = set()
        self.launches = 0
        self.flushes = 0

    def open_step(self) -> Step:
        st = self.step
        if st is None:
            st = self.step = self.stager.step()
        return st

    def target(self, tensor: torch.Tensor) -> _Target:
        t = self.targets.get(tensor.data_ptr())
        if t is None or t.tensor is not tensor:
            t = self.targets[tensor.data_ptr()] = _Target(tensor)
        return t

    def add(self, target: _Target, dst: np.ndarray, lens: np.ndarray, vals: np.ndarray) -> None:
        """Defer writing ``vals`` (the target's dtype, flat) at element offsets ``dst``, ``lens`` each."""
        f = vals.dtype.itemsize // 4
        words = vals.view(np.int32) if vals.flags.c_contiguous else np.ascontiguousarray(vals).view(np.int32)
        if f != 1:
            dst, lens = dst * f, lens * f
        if target.ptr in self.in_wave:  # written already in this wave: a later launch keeps order
            self.wave_starts.append(len(self.items))
            self.in_wave = set()
        self.in_wave.add(target.ptr)
        self.items.append((target, dst, lens, words))

    def add_gathered(self, tensor: torch.Tensor, g: Gathered) -> None:
        if g.dup:  # overlapping edits: one element per edit, each destination's last value
            dest, vals = g.dest()
            self.add(self.target(tensor), dest, np.ones(dest.shape[0], np.int64), vals)
        else:
            self.add(self.target(tensor), g.dst, g.lens, g.vals)

    def flush(self) -> None:
        """Publish the step's staging and write every deferred edit (see the module docstring)."""
        items = self.items
        if not items:
            st = self.step
            if st is not None:
                self.step = None
                st.flush()
            return
        self.flushes += 1
        waves = [*self.wave_starts, len(items)]
        self.items, self.wave_starts, self.in_wave = [], [0], set()
        if self.tier is Tier.HOST:
            st = self.step
            if st is not None:
                self.step = None
                st.flush()
            for target, dst, lens, words in items:
                flat = target.words_np
                assert flat is not None
                flat[_expand(dst, lens)] = words
            return
        st = self.open_step()
        self.step = None
        if self.triton:
            meta = _meta(items)
            words = np.concatenate([it[3] for it in items]) if len(items) > 1 else items[0][3]
            d_words = st.stage(words)
            d_meta = st.stage(meta)
            st.flush()
            if len(waves) == 2:  # the common case: every target once
                _launch_triton(self.device, d_meta, d_words, meta.shape[0], _block_for(int(meta[:, 2].max())))
                self.launches += 1
                return
            rows = np.cumsum([0] + [it[1].shape[0] for it in items])
            for a, b in zip(waves, waves[1:]):  # in order: a later wave rewrites what an earlier wrote
                r0, r1 = int(rows[a]), int(rows[b])
                longest = int(meta[r0:r1, 2].max())
                _launch_triton(self.device, d_meta[r0:r1], d_words, r1 - r0, _block_for(longest))
                self.launches += 1
            return
        pieces = []
        for target, dst, lens, words in items:
            pieces.append((target, st.stage(_expand(dst, lens)), st.stage(words)))
        st.flush()
        for target, d_dest, d_words in pieces:
            target.words.index_copy_(0, d_dest, d_words)
            self.launches += 1


def _expand(dst: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The word index of every element of edits starting at ``dst``, ``lens`` long."""
    if dst.shape[0] == 1:
        return np.arange(int(dst[0]), int(dst[0]) + int(lens[0]), dtype=np.int64)
    n = int(lens.sum())
    return np.repeat(dst - (np.cumsum(lens) - lens), lens) + np.arange(n, dtype=np.int64)


def _meta(items: list[tuple[_Target, np.ndarray, np.ndarray, np.ndarray]]) -> np.ndarray:
    """The Triton kernel's rows (target address, first word, words, source word) of ``items``."""
    counts = [it[1].shape[0] for it in items]
    m = np.empty((sum(counts), 4), np.int64)
    row = src = 0
    for (target, dst, lens, words), k in zip(items, counts):
        m[row : row + k, 0] = target.ptr
        m[row : row + k, 1] = dst
        m[row : row + k, 2] = lens
        np.cumsum(lens, out=m[row : row + k, 3])
        m[row : row + k, 3] += src - lens
        src += words.shape[0]
        row += k
    return m


_batches: dict[tuple[str, Tier], StepBatch] = {}


def batch(device: torch.device, tier: Tier) -> StepBatch:
    """The batch of the objects made for ``device`` on ``tier`` (one per process in an engine)."""
    b = _batches.get((str(device), tier))
    if b is None:
        b = _batches[(str(device), tier)] = StepBatch(device, tier)
    return b


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
    for b in _batches.values():
        if b.items or b.step is not None:
            b.flush()


def reset() -> None:
    """Forget every batch (tests; the plugin's unregister)."""
    for b in list(_batches.values()):
        b.flush()
    _batches.clear()
    _by_key.clear()
    _WINDOW[0], _WINDOW[1] = False, None


# --- the step-mode classes --------------------------------------------------------------------


class StepStagedWriteTensor(StagedWriteTensor):
    """``StagedWriteTensor`` whose applies join the step's batch (one launch for the step)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._step_batch = batch(self.device, self.tier)

    def _write(self, parts: list[Gathered]) -> Any:
        b = self._step_batch
        for g in parts:
            b.add_gathered(self.gpu, g)
        _done(b)
        return "triton" if b.triton else ("host" if b.tier is Tier.HOST else "scatter")


class StepFusedStagedWriter(FusedStagedWriter):
    """``FusedStagedWriter`` whose applies join the step's batch."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._step_batch = batch(self.device, capabilities(self.device).tier)

    def _write(self, parts: list[Gathered]) -> Any:
        b = self._step_batch
        for g in parts:
            b.add_gathered(g.target.flat, g)
        _done(b)
        return "triton" if b.triton else ("host" if b.tier is Tier.HOST else "scatter")


class StepBackedTensor(UvaBackedTensor):
    """``UvaBackedTensor`` with a fixed device tensor: a publish is one edit of the step's batch.

    ``.gpu`` is always a view of the same device memory (the first ``n`` rows of the
    last ``copy_to_uva(n)``); the write is stream-ordered, so kernels enqueued before
    a publish read the values before it. Dtypes whose rows are not whole 32-bit
    words publish through the parent's pool instead.
    """

    def __init__(
        self,
        size: int | tuple[int, ...],
        dtype: DTypeLike,
        max_concurrency: int | None = None,
        device: DeviceLike = None,
    ):
        dt = torch_dtype(dtype)
        if numpy_dtype(dt).itemsize % 4:
            super().__init__(size, dt, max_concurrency, device)
            self._fixed = None
            return
        shape = shape_of(size)
        caps = capabilities(device)
        self.dtype = dt
        self.cpu = alloc_host(shape, dt, pinned=False)
        self.np = self.cpu.numpy()
        self.pool = None  # type: ignore[assignment]
        self.device = caps.device
        self._fixed = alloc_device(shape, dt, caps.device)
        self._step_batch = batch(caps.device, caps.tier)
        self._views: dict[int, torch.Tensor] = {shape[0]: self._fixed}
        self._gpu = self._fixed
        self._freeze()

    @property
    def tier(self) -> Tier:
        return self._step_batch.tier if self._fixed is not None else super().tier

    def copy_to_uva(self, n: int | None = None) -> torch.Tensor:
        fixed = self._fixed
        if fixed is None:
            return super().copy_to_uva(n)
        rows = self.np.shape[0] if n is None else n
        view = self._views.get(rows)
        if view is None:
            if not isinstance(rows, int) or isinstance(rows, bool) or not 0 <= rows <= self.np.shape[0]:
                return super().copy_to_uva(n)  # the parent raises its error
            view = self._views[rows] = fixed[:rows]
        self._gpu = view
        if rows:
            b = self._step_batch
            src = self.np[:rows].reshape(-1)
            b.add(b.target(fixed), _ZERO, np.array([src.shape[0]], np.int64), src.copy())
            _done(b)
        return view

    def stats(self) -> dict[str, int]:
        if self._fixed is None:
            return super().stats()
        return {"transfers": 0, "bytes": 0, "growths": 0, "guard_waits": 0}


_ZERO = np.zeros(1, np.int64)


def wrap_h2d(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """vLLM's ``async_tensor_h2d`` in step mode: staged in the step's batch inside the window."""

    @functools.wraps(original)
    def async_tensor_h2d(
        data: Any, device: Any = None, dtype: torch.dtype | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        if not _WINDOW[0]:
            return original(data, device=device, dtype=dtype, out=out)
        key = out.device if out is not None else device
        arr = _host(data)
        b = _WINDOW[1] or _by_key.get(key) or _batch_for(key)
        if b is None or arr is None:  # not a case step mode stages: vLLM's own copy, in order
            close_window()
            return original(data, device=device, dtype=dtype, out=out)
        if out is None:
            want = numpy_dtype(dtype) if dtype is not None else arr.dtype
            return b.open_step().stage(arr.astype(want, copy=False))
        if (
            not out.is_contiguous()
            or numpy_dtype(out.dtype).itemsize % 4
            or arr.size != out.numel()
            or (dtype is not None and dtype != out.dtype)
        ):
            close_window()
            return original(data, device=device, dtype=dtype, out=out)
        vals = np.ascontiguousarray(arr.reshape(-1).astype(numpy_dtype(out.dtype), copy=False))
        b.add(b.target(out), _ZERO, np.array([vals.shape[0]], np.int64), vals)
        close_window()  # the step's inputs are complete: its kernels come next
        return out

    return async_tensor_h2d


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
