"""Step mode of the vLLM plugin: a step's staged writes, publishes and copies in one transfer, one launch.

Between the start of ``execute_model`` and its ``async_tensor_h2d(..., out=...)`` (the
``query_start_loc`` copy), the step-mode classes and ``async_tensor_h2d`` defer into the device's
:class:`StepBatch`, flushed as one staged array and one Triton launch (docs/DESIGN.md, "Step mode").
Outside that window each call adds and flushes at once: the same path, one call at a time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from ._convert import check_rows, numpy_dtype, shape_of, torch_dtype
from ._memory import alloc_device, alloc_host
from ._pool import UvaBackedTensor
from ._probe import capabilities
from ._staged_write import FusedStagedWriter, StagedWriteTensor
from ._staged_write.kernel import MAX_BLOCK, _launch_triton, triton_usable
from ._staged_write.launcher import Gathered, expand_runs
from ._stager import Step, StepStager
from ._tier import Tier
from ._types import DeviceLike, DTypeLike

_BLOCK = MAX_BLOCK
"""Columns per Triton program: one value for every flush, so the kernel is compiled once (a new
specialisation mid-run would load a module in the middle of a step)."""

_WINDOW: list[Any] = [False, None]
"""Whether calls are deferred now, and the batch the window's first deferred call joined."""


class _Target:
    """A device tensor the batch writes, as 32-bit words."""

    __slots__ = ("tensor", "words", "words_np", "ptr", "factor")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.words = tensor.view(-1).view(torch.int32)
        self.words_np = self.words.numpy() if tensor.device.type == "cpu" else None
        self.ptr = tensor.data_ptr()
        self.factor = tensor.element_size() // 4
        """32-bit words per element."""


class StepBatch:
    """One device's deferred writes and copies of the current step (see the module docstring).

    Every write is kept as rows of the Triton kernel's metadata (target address, first word,
    word count, source word) and its words: one-edit writes as a tuple each, several-edit
    writes as an array block; the step's rows and words are packed once, at the flush.
    """

    def __init__(self, device: torch.device, tier: Tier):
        self.device = device
        self.tier = tier
        self.stager = StepStager(device, capacity=1 << 16)
        self.triton = tier is not Tier.HOST and triton_usable(device)
        self.step: Step | None = None
        self.targets: dict[int, _Target] = {}
        self.rows: list[tuple[int, int, int, int]] = []
        self.blocks: list[np.ndarray] = []
        self.words: list[np.ndarray] = []
        self.nwords = 0
        self.waves: list[tuple[list[tuple[int, int, int, int]], list[np.ndarray]]] = []
        """Earlier waves of this batch (a target written twice starts a new one)."""
        self.in_wave: set[int] = set()
        self.launches = 0
        self.flushes = 0

    @property
    def pending(self) -> bool:
        return self.nwords > 0

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

    def _wave(self, ptr: int) -> None:
        if ptr in self.in_wave:  # written already in this wave: a later launch keeps staging order
            self.waves.append((self.rows, self.blocks))
            self.rows, self.blocks, self.in_wave = [], [], set()
        self.in_wave.add(ptr)

    def add_whole(self, target: _Target, words: np.ndarray) -> None:
        """Defer writing ``words`` (int32, flat) from the target's first word on."""
        ptr = target.ptr
        self._wave(ptr)
        n = words.shape[0]
        self.rows.append((ptr, 0, n, self.nwords))
        self.words.append(words)
        self.nwords += n

    def add(self, target: _Target, dst: np.ndarray, lens: np.ndarray, vals: np.ndarray) -> None:
        """Defer writing ``vals`` (the target's dtype, flat) at element offsets ``dst``, ``lens`` each."""
        ptr = target.ptr
        self._wave(ptr)
        f = target.factor
        words = vals.view(np.int32) if vals.flags.c_contiguous else np.ascontiguousarray(vals).view(np.int32)
        e = dst.shape[0]
        src = self.nwords
        if e == 1:
            self.rows.append((ptr, int(dst[0]) * f, int(lens[0]) * f, src))
        else:
            blk = np.empty((e, 4), np.int64)
            blk[:, 0] = ptr
            if f == 1:
                blk[:, 1] = dst
                blk[:, 2] = lens
            else:
                np.multiply(dst, f, out=blk[:, 1])
                np.multiply(lens, f, out=blk[:, 2])
            np.cumsum(blk[:, 2], out=blk[:, 3])
            blk[:, 3] += src - blk[:, 2]
            self.blocks.append(blk)
        self.words.append(words)
        self.nwords += words.shape[0]

    def add_gathered(self, tensor: torch.Tensor, g: Gathered) -> None:
        if g.dup:  # overlapping edits: one element per edit, each destination's last value
            dest, vals = g.dest()
            self.add(self.target(tensor), dest, np.ones(dest.shape[0], np.int64), vals)
        else:
            self.add(self.target(tensor), g.dst, g.lens, g.vals)

    def flush(self) -> None:
        """Publish the step's staging and write every deferred edit (see the module docstring)."""
        if not self.nwords:
            st = self.step
            if st is not None:
                self.step = None
                st.flush()
            return
        self.flushes += 1
        waves = [*self.waves, (self.rows, self.blocks)]
        words = self.words[0] if len(self.words) == 1 else np.concatenate(self.words)
        self.rows, self.blocks, self.words, self.nwords, self.waves, self.in_wave = [], [], [], 0, [], set()
        metas = []
        for rows, blocks in waves:
            parts = [np.array(rows, np.int64).reshape(-1, 4)] if rows else []
            metas.append(parts[0] if not blocks else np.concatenate([*parts, *blocks]))
        if self.tier is Tier.HOST:  # numpy writes; the step's staged arrays (if any) published
            st_host, self.step = self.step, None
            if st_host is not None:
                st_host.flush()
            for meta in metas:
                self._write_host(meta, words)
            return
        st = self.open_step()
        self.step = None
        if self.triton:  # the rows (int64, as int32 pairs) and the words in one staged array
            meta = metas[0] if len(metas) == 1 else np.concatenate(metas)
            head = 8 * meta.shape[0]
            packed = np.empty(head + words.shape[0], np.int32)
            packed[:head] = meta.reshape(-1).view(np.int32)
            packed[head:] = words
            region = st.stage(packed)
            st.flush()
            d_meta, d_words = region[:head].view(torch.int64), region[head:]
            row = 0
            for m in metas:  # in order: a later wave rewrites what an earlier one wrote
                k = m.shape[0]
                launch_meta = d_meta if len(metas) == 1 else d_meta[4 * row : 4 * (row + k)]
                _launch_triton(self.device, launch_meta, d_words, k, _BLOCK)
                self.launches += 1
                row += k
            return
        d_words = st.stage(words)
        staged = [self._scatter_plan(meta, st) for meta in metas]
        st.flush()
        for plan in staged:  # without Triton: one gather and one index_copy_ per target
            for target, d_dest, d_src in plan:
                target.words.index_copy_(0, d_dest, d_words[d_src])
                self.launches += 2

    def _per_target(self, meta: np.ndarray) -> list[tuple[_Target, np.ndarray, np.ndarray]]:
        """Each target of ``meta``'s rows with the word index of every element and of its source."""
        out = []
        for ptr in dict.fromkeys(meta[:, 0].tolist()):
            rows = meta[meta[:, 0] == ptr]
            lens = rows[:, 2]
            out.append((self.targets[ptr], _expand(rows[:, 1], lens), _expand(rows[:, 3], lens)))
        return out

    def _write_host(self, meta: np.ndarray, words: np.ndarray) -> None:
        for target, dest, src in self._per_target(meta):
            flat = target.words_np
            assert flat is not None
            flat[dest] = words[src]

    def _scatter_plan(self, meta: np.ndarray, st: Step) -> list[tuple[_Target, torch.Tensor, torch.Tensor]]:
        return [(t, st.stage(dest), st.stage(src)) for t, dest, src in self._per_target(meta)]


def _expand(first: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The index of every element of runs starting at ``first``, ``lens`` long."""
    return expand_runs(first, lens, int(lens.sum()))


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
        if b.nwords or b.step is not None:
            b.flush()


def reset() -> None:
    """Forget every batch (tests; the plugin's unregister)."""
    for b in list(_batches.values()):
        b.flush()
    _batches.clear()
    _by_key.clear()
    _outs.clear()
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
        self._target = self._step_batch.target(self._fixed)
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
        view = self._views.get(rows) if type(rows) is int else None  # (True == 1: no cache hit for a bool)
        if view is None:
            if type(rows) is not int or not 0 <= rows <= self.np.shape[0]:
                rows = check_rows(n, self.np.shape[0])  # raises the parent's error, or an int-like n
            view = self._views[rows] = fixed[:rows]
        self._gpu = view
        if rows:
            b = self._step_batch
            b.add_whole(self._target, self.np[:rows].reshape(-1).view(np.int32).copy())
            _done(b)
        return view

    def stats(self) -> dict[str, int]:
        if self._fixed is None:
            return super().stats()
        return {"transfers": 0, "bytes": 0, "growths": 0, "guard_waits": 0}


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
        vals = np.ascontiguousarray(arr.reshape(-1).astype(layout[0], copy=False))
        b.add_whole(layout[2], vals.view(np.int32))
        close_window()  # the step's inputs are complete: its kernels come next
        return out

    return async_tensor_h2d


_outs: dict[tuple[int, int], tuple[torch.Tensor, tuple[np.dtype, int, _Target] | None]] = {}
"""Per ``out`` tensor of ``async_tensor_h2d`` and batch: its numpy dtype, size and batch target (None: not one
step mode writes: not contiguous, or not whole 32-bit words)."""


def _out_layout(out: torch.Tensor, b: StepBatch) -> tuple[np.dtype, int, _Target] | None:
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
