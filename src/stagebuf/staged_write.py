"""Staged writes: sparse ``(row, start, values)`` edits to device tensors, applied in one launch.

Per-request device state (block tables, prompt token ids) lives in large device
tensors that change a little each step. ``StagedWriteTensor`` collects edits on
the host, checks every one of them when it is staged (row, start, end of row,
values representable in the dtype) and applies all of them with one kernel;
``FusedStagedWriter`` does the same for several tensors of one dtype at once.

One apply is one ``StepStager`` step: the contents and one packed int64
metadata block (work items, group offsets, rows, starts, lengths, source
offsets, and the target pointer table when it changed) are staged as a single
byte array, so a copy tier pays exactly one host-to-device transfer per apply.

Ordering of overlapping edits ("later wins")
---------------------------------------------
Edits are sorted stably by (tensor, row) on the host, which keeps staging order
inside each (tensor, row) group. The Triton kernel runs one program per column
tile (``BLOCK`` columns) of one group; the program walks the group's edits in
staging order, stores the part of each edit that falls in its tile and issues a
``tl.debug_barrier()`` before the next edit, so a later edit's stores come after
an earlier one's. Different programs own disjoint tiles and never write the
same element, so overlaps never race. The torch twin applies the same rule by
keeping, for each destination element, the last staged value.

Bounds: every store is masked to ``[start, start + len)`` of its edit, which was
checked on the host to lie inside the row: the kernel cannot write out of bounds.

Kernels: Triton on CUDA; on CPU tensors the torch twin, or the Triton kernel
under Triton's CPU interpreter when ``TRITON_INTERPRET=1`` (how CI checks the
kernel against the twin). ``.kernel`` says which one ran.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .buffers import UvaBuffer
from .capabilities import TierUnavailableError, capabilities
from .convert import host_array, numpy_dtype, shape_of, torch_dtype
from .log import warn_once
from .memory import PinnedAllocationError, alloc_device
from .pool import empty_stats
from .stager import ALIGN, StepStager
from .tier import Tier
from .uva import UvaError

ALLOWED_DTYPES = (torch.int32, torch.int64, torch.float32)
MIN_BLOCK = 16
MAX_BLOCK = 1024
"""Column tile of one kernel program (a power of 4 times MIN_BLOCK, at most this)."""
_TENSOR_CAPACITY = 1 << 14
_I64 = np.dtype(np.int64)

tl: Any = None  # triton.language, imported on first use (importing stagebuf stays cheap)
_triton_error: list[str] = []


# --- kernel selection -------------------------------------------------------------

def _triton_available() -> bool:
    global tl
    if tl is not None:
        return True
    if _triton_error:
        return False
    try:
        import triton.language as _tl  # type: ignore[import-not-found]
    except Exception as e:  # not installed, or broken
        _triton_error.append(f"{type(e).__name__}: {e}"[:200])
        return False
    tl = _tl
    return True


def select_kernel(device: torch.device) -> str:
    """``"triton"`` or ``"torch"``: the kernel an apply on ``device`` runs now."""
    if device.type == "cuda":
        if _triton_available():
            return "triton"
        warn_once(("staged-write-no-triton", str(device)),
                  f"stagebuf: staged writes on {device} use the torch twin: triton is not "
                  f"importable ({_triton_error[0]}). Fix: pip install triton")
        return "torch"
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1" and _triton_available():
        return "triton"
    return "torch"


def _staged_write_kernel(wi_group, wi_col0, goff, g_tid, g_row, e_start, e_len, e_src,
                         content, table, BLOCK: tl.constexpr):
    # One program: one BLOCK-column tile of one (tensor, row) group.
    p = tl.program_id(0)
    g = tl.load(wi_group + p)
    c0 = tl.load(wi_col0 + p)
    e0 = tl.load(goff + g)
    e1 = tl.load(goff + g + 1)
    tid = tl.load(g_tid + g)
    row = tl.load(g_row + g)
    base = tl.load(table + 2 * tid).to(tl.pointer_type(content.dtype.element_ty))
    stride = tl.load(table + 2 * tid + 1)
    cols = c0 + tl.arange(0, BLOCK)
    dst = base + row * stride + cols
    for e in range(e0, e1):  # staging order: a later edit's stores come after an earlier one's
        st = tl.load(e_start + e)
        ln = tl.load(e_len + e)
        src = tl.load(e_src + e)
        m = (cols >= st) & (cols < st + ln)
        v = tl.load(content + src + (cols - st), mask=m)
        tl.store(dst, v, mask=m)
        tl.debug_barrier()


_kernels: dict[bool, Any] = {}


def _triton_kernel(interpret: bool) -> Any:
    k = _kernels.get(interpret)
    if k is None:
        if interpret:
            from triton.runtime.interpreter import InterpretedFunction  # type: ignore[import-not-found]

            k = InterpretedFunction(_staged_write_kernel)
        else:
            from triton.runtime.jit import JITFunction  # type: ignore[import-not-found]

            k = JITFunction(_staged_write_kernel)
        _kernels[interpret] = k
    return k


def _block_for(extent: int) -> int:
    b = MIN_BLOCK
    while b < extent and b < MAX_BLOCK:
        b *= 4
    return min(b, MAX_BLOCK)


# --- host storage -----------------------------------------------------------------

def _reserve(arena: np.ndarray, nbytes: int, keep: int) -> np.ndarray:
    """``arena``, or a larger one (doubled, 16-byte multiple) holding its first ``keep`` bytes."""
    if nbytes <= arena.shape[0]:
        return arena
    cap = (max(2 * arena.shape[0], nbytes) + ALIGN - 1) & -ALIGN
    new = np.empty(cap, np.uint8)
    new[:keep] = arena[:keep]
    return new


class _HostEdits:
    """Staged edits in typed host storage: (row, start, len) triples and a contents arena."""

    __slots__ = ("dtype", "itemsize", "meta", "n", "arena", "vals", "nv")

    def __init__(self, dtype: np.dtype):
        self.dtype = dtype
        self.itemsize = dtype.itemsize
        self.meta = np.empty((16, 3), np.int64)
        self.n = 0
        self.arena = np.empty(4096, np.uint8)
        self.vals = self.arena.view(dtype)
        self.nv = 0

    def add(self, row: int, start: int, arr: np.ndarray) -> None:
        k = arr.shape[0]
        if self.n == self.meta.shape[0]:
            meta = np.empty((2 * self.n, 3), np.int64)
            meta[: self.n] = self.meta
            self.meta = meta
        end = self.nv + k
        if end > self.vals.shape[0]:
            self.reserve(end * self.itemsize)
        self.vals[self.nv:end] = arr
        self.meta[self.n] = (row, start, k)
        self.n += 1
        self.nv = end

    def reserve(self, nbytes: int) -> None:
        """Room for ``nbytes`` in the arena, keeping the staged contents."""
        arena = _reserve(self.arena, nbytes, self.nv * self.itemsize)
        if arena is not self.arena:
            self.arena = arena
            self.vals = arena.view(self.dtype)

    def clear(self) -> None:
        self.n = 0
        self.nv = 0


# --- packing: one byte array per apply ---------------------------------------------

_SECTIONS = ("table", "wi_group", "wi_col0", "goff", "g_tid", "g_row", "e_start", "e_len", "e_src")


@dataclass
class _Layout:
    n_elems: int
    n_edits: int
    n_groups: int
    n_items: int
    block: int
    meta_off: int
    nbytes: int
    sections: dict[str, tuple[int, int]]
    """name -> (first word, length) inside the int64 metadata block."""
    elem_ranges: list[tuple[int, int]]
    """Per target: its elements' range in the sorted element order (torch twin)."""
    dedup: bool


def _plan(targets: Sequence[StagedWriteTensor], tiles: bool, table: np.ndarray | None,
          ) -> tuple[_Layout, dict[str, np.ndarray]]:
    """Sort the staged edits by (tensor, row), stably, and lay out the metadata."""
    eds = [t._edits for t in targets]
    if len(eds) == 1:
        m = eds[0].meta[: eds[0].n]
        tids = np.zeros(m.shape[0], np.int64)
        order = np.argsort(m[:, 0], kind="stable")
    else:
        counts = [e.n for e in eds]
        m = np.concatenate([e.meta[: e.n] for e in eds])
        tids = np.repeat(np.arange(len(eds), dtype=np.int64), counts)
        order = np.lexsort((m[:, 0], tids))  # stable: staging order kept inside a group
    lens = m[:, 2]
    src = np.cumsum(lens) - lens  # contents are packed in target order, staging order
    s_tid, s_row, s_start = tids[order], m[order, 0], m[order, 1]
    s_len, s_src = lens[order], src[order]
    n_edits = int(order.shape[0])
    new = np.empty(n_edits, bool)
    new[0] = True
    np.logical_or(s_row[1:] != s_row[:-1], s_tid[1:] != s_tid[:-1], out=new[1:])
    first = np.flatnonzero(new)
    n_groups = int(first.shape[0])
    goff = np.append(first, n_edits).astype(np.int64, copy=False)
    arrays: dict[str, np.ndarray] = {
        "goff": goff, "g_tid": s_tid[first], "g_row": s_row[first],
        "e_start": s_start, "e_len": s_len, "e_src": s_src,
    }
    block = n_items = 0
    if tiles:
        lo = np.minimum.reduceat(s_start, first)
        hi = np.maximum.reduceat(s_start + s_len, first)
        block = _block_for(int((hi - lo).max()))
        per = (hi - lo + block - 1) // block
        n_items = int(per.sum())
        base = np.cumsum(per) - per
        arrays["wi_group"] = np.repeat(np.arange(n_groups, dtype=np.int64), per)
        arrays["wi_col0"] = np.repeat(lo - base * block, per) + np.arange(n_items, dtype=np.int64) * block
    if table is not None:
        arrays["table"] = table
    sections: dict[str, tuple[int, int]] = {}
    words = 0
    for name in _SECTIONS:
        a = arrays.get(name)
        if a is not None:
            sections[name] = (words, a.shape[0])
            words += (a.shape[0] + 1) & -2  # 16-byte aligned sections
    n_elems = sum(e.nv for e in eds)
    meta_off = (n_elems * eds[0].itemsize + ALIGN - 1) & -ALIGN
    edges = np.searchsorted(s_tid, np.arange(len(eds) + 1))
    cum = np.concatenate(([0], np.cumsum(s_len)))
    elem_ranges = [(int(cum[edges[i]]), int(cum[edges[i + 1]])) for i in range(len(eds))]
    lay = _Layout(n_elems, n_edits, n_groups, n_items, block, meta_off, meta_off + 8 * words,
                  sections, elem_ranges, n_groups < n_edits)
    return lay, arrays


def _write_meta(arena: np.ndarray, lay: _Layout, arrays: dict[str, np.ndarray]) -> None:
    words = arena[lay.meta_off: lay.nbytes].view(np.int64)
    for name, (off, n) in lay.sections.items():
        words[off: off + n] = arrays[name]


class _Launcher:
    """The stager, pack arena and cached pointer table behind one writer."""

    def __init__(self, device: torch.device, max_concurrency: int | None, capacity: int):
        self.device = device
        self.max_concurrency = max_concurrency
        self.capacity = capacity
        self.stager: StepStager | None = None
        self.arena = np.empty(0, np.uint8)
        self.table_key: tuple[tuple[int, int], ...] | None = None
        self.table: torch.Tensor | None = None

    def stats(self) -> dict[str, int]:
        if self.stager is None:
            return {**empty_stats(), "steps": 0}
        return self.stager.stats()

    def apply(self, targets: Sequence[StagedWriteTensor]) -> str:
        """Apply and clear the staged edits of ``targets`` with one launch; the kernel's name."""
        kernel = select_kernel(self.device)
        if sum(t._edits.n for t in targets) == 0:
            return kernel
        triton = kernel == "triton"
        key = tuple((t.gpu.data_ptr(), t.row_stride) for t in targets) if triton else None
        table = None
        if triton and key != self.table_key:
            table = np.array(key, dtype=np.int64).reshape(-1)
        lay, arrays = _plan(targets, triton, table)
        if len(targets) == 1:
            eds = targets[0]._edits
            eds.reserve(lay.nbytes)
            arena = eds.arena
        else:
            arena = self.arena = _reserve(self.arena, lay.nbytes, 0)
            off = 0
            for t in targets:
                nb = t._edits.nv * t._edits.itemsize
                arena[off: off + nb] = t._edits.arena[:nb]
                off += nb
        _write_meta(arena, lay, arrays)
        if self.stager is None:
            self.stager = StepStager(self.device, capacity=max(self.capacity, ALIGN),
                                     max_concurrency=self.max_concurrency)
        with self.stager.step() as st:
            dev = st.stage(arena[: lay.nbytes])
        dtype = targets[0].dtype
        contents = dev[: lay.n_elems * targets[0]._edits.itemsize].view(dtype)
        words = dev[lay.meta_off: lay.nbytes].view(torch.int64)
        sec = {name: words[off: off + n] for name, (off, n) in lay.sections.items()}
        if triton:
            if table is not None:
                self.table = sec["table"].clone()  # device-side copy: later applies reuse it
                self.table_key = key
            _launch_triton(self.device, sec, contents, self.table, lay)
        else:
            _torch_twin(targets, sec, contents, lay)
        self.stager.mark_consumed()
        for t in targets:
            t._edits.clear()
        return kernel


def _launch_triton(device: torch.device, sec: dict[str, torch.Tensor], contents: torch.Tensor,
                   table: torch.Tensor | None, lay: _Layout) -> None:
    assert table is not None
    args = [sec[n] for n in _SECTIONS[1:]] + [contents, table]
    if device.type == "cuda":
        kernel = _triton_kernel(interpret=False)
        with torch.cuda.device(device):
            kernel[(lay.n_items,)](*args, BLOCK=lay.block, num_warps=max(1, min(4, lay.block // 128)))
    else:
        _triton_kernel(interpret=True)[(lay.n_items,)](*args, BLOCK=lay.block)


def _torch_twin(targets: Sequence[StagedWriteTensor], sec: dict[str, torch.Tensor],
                contents: torch.Tensor, lay: _Layout) -> None:
    """The kernel in plain torch ops on the device (the oracle for the Triton kernel)."""
    dev = contents.device
    n_edits, n = lay.n_edits, lay.n_elems
    goff, e_len = sec["goff"], sec["e_len"]
    row_e = torch.repeat_interleave(sec["g_row"], goff[1:] - goff[:-1], output_size=n_edits)
    edit_of = torch.repeat_interleave(torch.arange(n_edits, device=dev), e_len, output_size=n)
    j = torch.arange(n, device=dev) - (torch.cumsum(e_len, 0) - e_len)[edit_of]
    col = sec["e_start"][edit_of] + j
    src = sec["e_src"][edit_of] + j
    row = row_e[edit_of]
    for t, (a, b) in zip(targets, lay.elem_ranges):
        if a == b:
            continue
        dest = row[a:b] * t.row_stride + col[a:b]
        s = src[a:b]
        if lay.dedup:  # keep the last staged value of each element (stable sort keeps order)
            dest, perm = torch.sort(dest, stable=True)
            keep = torch.ones_like(dest, dtype=torch.bool)
            keep[:-1] = dest[1:] != dest[:-1]
            dest, s = dest[keep], s[perm][keep]
        t.gpu.view(-1).index_copy_(0, dest, contents[s])


# --- public classes -----------------------------------------------------------------

def _dtype(dtype: Any) -> torch.dtype:
    allowed = ", ".join(str(d).replace("torch.", "") for d in ALLOWED_DTYPES)
    try:
        dt = torch_dtype(dtype)
    except TypeError:
        dt = None
    if dt not in ALLOWED_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported for staged writes; allowed: {allowed}")
    return dt


def _int_in(x: Any, name: str, lo: int, hi: int | None, what: str) -> int:
    """``x`` as an int in [lo, hi) (no upper bound when ``hi`` is None), else ValueError."""
    ok = not isinstance(x, (bool, np.bool_)) and isinstance(x, (int, np.integer))
    if ok and lo <= x and (hi is None or x < hi):
        return int(x)
    if hi is None:
        allowed = f"an int >= {lo}"
    elif hi <= lo:
        allowed = f"nothing: {what}"
    else:
        allowed = f"an int in [{lo}, {hi - 1}] ({what})"
    raise ValueError(f"{name}={x!r} is not a valid {name}; allowed: {allowed}")


class StagedWriteTensor:
    """A zero-filled device tensor edited by staged ``(row, start, values)`` writes.

    ``size`` is ``(rows, cols)`` or ``n`` (n rows of one column: ``stage_write_elem(i, v)``
    sets ``gpu[i]``). ``uva_instead_of_gpu`` keeps the tensor in pinned host memory
    that kernels read through UVA (tier UVA only; elsewhere it is a device tensor,
    logged once). Edits are checked when staged and applied by ``apply_write()``
    with one launch; overlapping edits to one row apply in staging order.
    """

    def __init__(
        self,
        size: int | Sequence[int],
        dtype: Any,
        device: Any,
        max_concurrency: int | None = None,
        uva_instead_of_gpu: bool = False,
    ):
        shape = shape_of(size)
        if len(shape) not in (1, 2):
            raise ValueError(f"size={size!r} has rank {len(shape)}; allowed: 1 (n) or 2 (rows, cols)")
        self.shape = shape
        self.dtype = _dtype(dtype)
        caps = capabilities(device)
        self.device = caps.device
        self.tier = caps.tier
        self.rows = shape[0]
        self.cols = shape[1] if len(shape) == 2 else 1
        self.row_stride = self.cols if len(shape) == 2 else 1
        self.uva_buffer: UvaBuffer | None = None
        self.gpu = self._alloc(uva_instead_of_gpu)
        self._edits = _HostEdits(numpy_dtype(self.dtype))
        self._launcher = _Launcher(self.device, max_concurrency, _TENSOR_CAPACITY)
        self.kernel = select_kernel(self.device)

    def _alloc(self, uva: bool) -> torch.Tensor:
        if uva:
            why = ""
            if self.tier is Tier.UVA:
                try:
                    self.uva_buffer = UvaBuffer(self.shape, self.dtype, self.device)
                    return self.uva_buffer.dev
                except (PinnedAllocationError, UvaError, TierUnavailableError) as e:
                    why = f"the UVA allocation failed ({e})"
            else:
                why = f"the tier of {self.device} is {self.tier.name}, not UVA"
            warn_once(("staged-write-uva", str(self.device), self.tier),
                      f"stagebuf: StagedWriteTensor(uva_instead_of_gpu=True) on {self.device} is a "
                      f"device tensor: {why}")
        return alloc_device(self.shape, self.dtype, self.device)

    @property
    def in_host_memory(self) -> bool:
        """True when ``.gpu`` is pinned host memory read through UVA."""
        return self.uva_buffer is not None

    @property
    def num_staged(self) -> int:
        """Edits staged and not yet applied (empty ones are not kept)."""
        return self._edits.n

    def stage_write(self, index: int, start: int, values: Any) -> None:
        """Stage ``gpu[index, start:start + len(values)] = values``; checked now, applied later."""
        rows, cols = self.rows, self.cols
        row = _int_in(index, "index", 0, rows, f"the target has {rows} rows")
        col = _int_in(start, "start", 0, None, "")
        arr = values if type(values) is np.ndarray and values.ndim == 1 and values.dtype == self._edits.dtype \
            else host_array(values, self.dtype, f"values (edit index={row}, start={col})",
                            ndims=(1,), iterables=True)
        end = col + arr.shape[0]
        if end > cols:
            raise ValueError(
                f"edit (index={row}, start={col}, {arr.shape[0]} values) ends at column {end}, "
                f"past the end of the row ({cols} columns)"
            )
        if arr.shape[0]:
            self._edits.add(row, col, arr)

    def stage_write_elem(self, index: int, value: Any) -> None:
        """Stage ``gpu[index, 0] = value`` (``gpu[index]`` on a 1-D target)."""
        if isinstance(value, (np.ndarray, torch.Tensor)) and value.ndim == 0:
            value = value.reshape(1)
        elif not isinstance(value, (np.ndarray, torch.Tensor, Iterable)) or isinstance(value, (str, bytes)):
            value = [value]
        self.stage_write(index, 0, value)

    def apply_write(self) -> None:
        """Apply every staged edit with one kernel launch (one transfer on copy tiers), then clear."""
        self.kernel = self._launcher.apply([self])

    def clear_staged_writes(self) -> None:
        """Drop the staged edits without applying them."""
        self._edits.clear()

    def stats(self) -> dict[str, int]:
        """This tensor's stager counters: transfers, bytes, growths, guard_waits, steps."""
        return self._launcher.stats()

    def __repr__(self) -> str:
        return (f"StagedWriteTensor(shape={self.shape}, dtype={self.dtype}, device={self.device}, "
                f"tier={self.tier.name}, staged={self.num_staged})")


class FusedStagedWriter:
    """Applies the staged edits of several StagedWriteTensors of one dtype with one launch.

    Base pointers and row strides are kept in a small device table, rebuilt
    (inside the same transfer) only when the set of tensors changes.
    ``max_writes`` is the expected number of edits per apply; it grows to the
    next power of two when an apply stages more.
    """

    def __init__(self, device: Any, max_writes: int, max_concurrency: int | None = None):
        self.max_writes = _int_in(max_writes, "max_writes", 1, None, "")
        self.device = capabilities(device).device
        self.max_concurrency = max_concurrency
        self._launcher = _Launcher(self.device, max_concurrency, self._capacity(self.max_writes))
        self._launcher.stager = StepStager(self.device, capacity=self._launcher.capacity,
                                           max_concurrency=max_concurrency)
        self._edit_growths = 0
        self.kernel = select_kernel(self.device)

    @staticmethod
    def _capacity(max_writes: int) -> int:
        # metadata (about 8 int64 words per edit) plus room for about 16 8-byte values per edit
        return 1024 + 192 * max_writes

    def apply(self, tensors: Iterable[StagedWriteTensor]) -> None:
        """Apply and clear the staged edits of ``tensors`` (one dtype, this device) in one launch."""
        targets: list[StagedWriteTensor] = []
        for i, t in enumerate(tensors):
            if not isinstance(t, StagedWriteTensor):
                raise TypeError(f"tensors[{i}] is a {type(t).__name__}; expected StagedWriteTensor")
            if t.device != self.device:
                raise ValueError(f"tensors[{i}] is on {t.device}; this writer targets {self.device}")
            if targets and t.dtype != targets[0].dtype:
                raise ValueError(f"tensors[{i}] has dtype {t.dtype} but tensors[0] has {targets[0].dtype}; "
                                 "one fused apply needs one dtype")
            if not any(t is u for u in targets):
                targets.append(t)
        n = sum(t.num_staged for t in targets)
        if n > self.max_writes:
            self.max_writes = 1 << (n - 1).bit_length()
            self._edit_growths += 1
            self._launcher.arena = _reserve(self._launcher.arena, self._capacity(self.max_writes), 0)
        self.kernel = self._launcher.apply(targets) if targets else select_kernel(self.device)

    def stats(self) -> dict[str, int]:
        """The stager's counters (transfers, bytes, growths, guard_waits, steps) and max_writes growths."""
        return {**self._launcher.stats(), "edit_growths": self._edit_growths}

    def __repr__(self) -> str:
        return f"FusedStagedWriter(device={self.device}, max_writes={self.max_writes})"
