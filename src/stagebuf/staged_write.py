"""Staged writes: sparse ``(row, start, values)`` edits to device tensors, applied in one launch.

Per-request device state (block tables, prompt token ids) lives in large device
tensors that change a little each step. ``StagedWriteTensor`` collects edits on
the host, checks every one of them when it is staged (row, start, end of row,
values representable in the dtype) and applies all of them with one kernel;
``FusedStagedWriter`` does the same for several tensors of one dtype at once.

Staged edits accumulate in typed host storage (a growable byte arena for the
contents, an int64 array of (row, start, length)): staging a long write costs
about one memcpy. One apply is one ``StepStager`` step: the contents and one
packed int64 metadata block (tiles, group offsets, group keys, per-edit start,
length and source offset, and the pointer table when the set of targets
changed; see ``_SECTIONS``) are staged as a single byte array, so a copy tier
pays exactly one host-to-device transfer per apply.

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
from .convert import cast_checked, host_array, numpy_dtype, shape_of, torch_dtype
from .log import warn_once
from .memory import PinnedAllocationError, alloc_device
from .pool import empty_stats, slot_count
from .probe import TierUnavailableError, capabilities
from .stager import ALIGN, StepStager
from .tier import Tier
from .uva import UvaError

ALLOWED_DTYPES = (torch.int32, torch.int64, torch.float32)
MIN_BLOCK = 16
MAX_BLOCK = 1024
"""Column tile of one kernel program (a power of 4 times MIN_BLOCK, at most this)."""
_TENSOR_CAPACITY = 1 << 14

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


def _staged_write_kernel(items, goff, gkey, edits, content, table, BLOCK: tl.constexpr):
    # One program: one BLOCK-column tile of one (tensor, row) group (layout: see _SECTIONS).
    p = tl.program_id(0)
    g = tl.load(items + 2 * p)
    c0 = tl.load(items + 2 * p + 1)
    e0 = tl.load(goff + g)
    e1 = tl.load(goff + g + 1)
    key = tl.load(gkey + g)
    tid = key >> 40  # KEY_SHIFT
    row = key & 0xFFFFFFFFFF
    base = tl.load(table + 2 * tid).to(tl.pointer_type(content.dtype.element_ty))
    stride = tl.load(table + 2 * tid + 1)
    cols = c0 + tl.arange(0, BLOCK)
    dst = base + row * stride + cols
    e = e0
    while e < e1:  # staging order: a later edit's stores come after an earlier one's
        st = tl.load(edits + 3 * e)
        ln = tl.load(edits + 3 * e + 1)
        src = tl.load(edits + 3 * e + 2)
        m = (cols >= st) & (cols < st + ln)
        v = tl.load(content + src + (cols - st), mask=m)
        tl.store(dst, v, mask=m)
        tl.debug_barrier()
        e += 1


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
    """Staged edits in typed host storage: (row, start, len, source offset) rows and a contents arena."""

    __slots__ = ("dtype", "itemsize", "meta", "n", "arena", "vals", "nv")

    def __init__(self, dtype: np.dtype):
        self.dtype = dtype
        self.itemsize = dtype.itemsize
        self.meta = np.empty((16, 4), np.int64)
        self.n = 0
        self.arena = np.empty(4096, np.uint8)
        self.vals = self.arena.view(dtype)
        self.nv = 0

    def add(self, row: int, start: int, arr: np.ndarray) -> None:
        k = arr.shape[0]
        if self.n == self.meta.shape[0]:
            meta = np.empty((2 * self.n, 4), np.int64)
            meta[: self.n] = self.meta
            self.meta = meta
        end = self.nv + k
        if end > self.vals.shape[0]:
            self.reserve(end * self.itemsize)
        self.vals[self.nv:end] = arr
        self.meta[self.n] = (row, start, k, self.nv)
        self.n += 1
        self.nv = end

    def add_scalar(self, row: int, start: int, value: int | float) -> None:
        """``add(row, start, [value])`` for a value already checked to fit the dtype."""
        if self.n == self.meta.shape[0] or self.nv == self.vals.shape[0]:
            self.add(row, start, np.array([value], self.dtype))
            return
        self.vals[self.nv] = value
        self.meta[self.n] = (row, start, 1, self.nv)
        self.n += 1
        self.nv += 1

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

# int64 metadata sections, in order; each starts 16-byte aligned. A group is one
# (tensor, row); its key is tensor << KEY_SHIFT | row.
#   table  (T, 2): base pointer, row stride       (only when the tensor set changed)
#   items  (W, 2): group, first column of the tile (Triton only)
#   goff   (G + 1): first edit of each group, then the edit count
#   gkey   (G): tensor << KEY_SHIFT | row
#   edits  (E, 3): start, length, source offset in the contents
_SECTIONS = ("table", "items", "goff", "gkey", "edits")
KEY_SHIFT = 40


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
    """name -> (first word, number of words) inside the int64 metadata block."""
    elem_ranges: list[tuple[int, int]]
    """Per target: the range of its elements in the sorted element order (torch twin)."""
    dedup: bool
    """Some group has several edits (they may overlap)."""


def _plan(targets: Sequence[StagedWriteTensor], tiles: bool, table: np.ndarray | None,
          ) -> tuple[_Layout, dict[str, np.ndarray]]:
    """Sort the staged edits by (tensor, row), stably, and lay out the metadata."""
    eds = [t._edits for t in targets]
    if len(eds) == 1:
        m = eds[0].meta[: eds[0].n]
        key = m[:, 0]
    else:
        m = np.concatenate([e.meta[: e.n] for e in eds])
        key = np.repeat(np.arange(len(eds), dtype=np.int64) << KEY_SHIFT, [e.n for e in eds])
        key |= m[:, 0]
        a = base = 0
        for e in eds:  # source offsets: the contents are packed in target order
            if base:
                m[a: a + e.n, 3] += base
            a += e.n
            base += e.nv
    n_edits = m.shape[0]
    if n_edits > 1 and (key[1:] < key[:-1]).any():
        order = np.argsort(key, kind="stable")  # stable: staging order kept inside a group
        key, m = key[order], m[order]
    edits = m[:, 1:]  # start, length, source offset
    brk = np.flatnonzero(key[1:] != key[:-1])
    n_groups = brk.shape[0] + 1
    if n_groups == n_edits:  # one edit per group: the common case
        first: np.ndarray | slice = slice(None)
        goff = np.arange(n_edits + 1, dtype=np.int64)
    else:
        first = np.empty(n_groups, np.int64)
        first[0] = 0
        np.add(brk, 1, out=first[1:])
        goff = np.append(first, n_edits)
    arrays: dict[str, np.ndarray] = {"goff": goff, "gkey": key[first], "edits": edits}
    block = n_items = 0
    if tiles:
        if n_groups == n_edits:
            lo, ext = edits[:, 0], edits[:, 1]
        else:
            lo = np.minimum.reduceat(edits[:, 0], first)
            ext = np.maximum.reduceat(edits[:, 0] + edits[:, 1], first) - lo
        emax = int(ext.max())
        block = _block_for(emax)
        if emax <= block:  # one tile per group
            n_items = n_groups
            items = np.empty((n_items, 2), np.int64)
            items[:, 0] = np.arange(n_groups)
            items[:, 1] = lo
        else:
            per = (ext + (block - 1)) // block
            n_items = int(per.sum())
            base = np.cumsum(per) - per
            items = np.empty((n_items, 2), np.int64)
            items[:, 0] = np.repeat(np.arange(n_groups, dtype=np.int64), per)
            items[:, 1] = np.repeat(lo - base * block, per) + np.arange(n_items, dtype=np.int64) * block
        arrays["items"] = items
    if table is not None:
        arrays["table"] = table
    sections: dict[str, tuple[int, int]] = {}
    words = 0
    for name in _SECTIONS:
        a = arrays.get(name)
        if a is not None:
            sections[name] = (words, a.size)
            words += (a.size + 1) & -2  # 16-byte aligned sections
    elem_ranges = []
    n_elems = 0
    for e in eds:  # a target's edits stay together after the sort, in target order
        elem_ranges.append((n_elems, n_elems + e.nv))
        n_elems += e.nv
    meta_off = (n_elems * eds[0].itemsize + ALIGN - 1) & -ALIGN
    lay = _Layout(n_elems, n_edits, n_groups, n_items, block, meta_off, meta_off + 8 * words,
                  sections, elem_ranges, n_groups < n_edits)
    return lay, arrays


def _write_meta(arena: np.ndarray, lay: _Layout, arrays: dict[str, np.ndarray]) -> None:
    words = arena[lay.meta_off: lay.nbytes].view(np.int64)
    for name, (off, n) in lay.sections.items():
        a = arrays[name]
        words[off: off + n].reshape(a.shape)[...] = a


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
    args = [sec["items"], sec["goff"], sec["gkey"], sec["edits"], contents, table]
    if device.type == "cuda":
        launch = _triton_kernel(interpret=False)[(lay.n_items,)]
        warps = max(1, min(4, lay.block // 128))
        if torch.cuda.current_device() == device.index:
            launch(*args, BLOCK=lay.block, num_warps=warps)
        else:
            with torch.cuda.device(device):
                launch(*args, BLOCK=lay.block, num_warps=warps)
    else:
        _triton_kernel(interpret=True)[(lay.n_items,)](*args, BLOCK=lay.block)


def _torch_twin(targets: Sequence[StagedWriteTensor], sec: dict[str, torch.Tensor],
                contents: torch.Tensor, lay: _Layout) -> None:
    """The kernel in plain torch ops on the device (the oracle for the Triton kernel).

    Vectorised: the flat destination and source index of every staged element,
    then, where a (tensor, row) group holds several edits, only the last staged
    write of each destination is kept, and one ``index_copy_`` per target.
    """
    dev = contents.device
    n_edits, n = lay.n_edits, lay.n_elems
    goff = sec["goff"]
    ed = sec["edits"].view(n_edits, 3)
    e_start, e_len, e_src = ed[:, 0], ed[:, 1], ed[:, 2]
    gkey = sec["gkey"]
    if lay.n_groups != n_edits:
        gkey = gkey[torch.repeat_interleave(goff[1:] - goff[:-1], output_size=n_edits)]
    edit_of = torch.repeat_interleave(e_len, output_size=n)  # the edit of each element
    j = torch.arange(n, device=dev) - (torch.cumsum(e_len, 0) - e_len)[edit_of]
    col = e_start[edit_of] + j
    src = e_src[edit_of] + j
    row = (gkey & ((1 << KEY_SHIFT) - 1))[edit_of]
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
        if shape[0] >= 1 << KEY_SHIFT:
            raise ValueError(f"size={size!r}: at most {(1 << KEY_SHIFT) - 1} rows")
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
        if self.dtype.is_floating_point:
            fmax = float(np.finfo(self._edits.dtype).max)
            self._scalar_type: type = float
            self._scalar_range: tuple[float, float] = (-fmax, fmax)
        else:
            info = np.iinfo(self._edits.dtype)
            self._scalar_type, self._scalar_range = int, (int(info.min), int(info.max))
        self._float_limit = None if self.dtype.is_floating_point else 2.0 ** (8 * self._edits.itemsize - 1)
        slot_count(max_concurrency)  # checked now; the stager is made at the first apply
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
        if type(values) is list and len(values) == 1 and col < cols:  # one Python number: fast path
            v = values[0]
            lo, hi = self._scalar_range
            if type(v) is self._scalar_type and lo <= v <= hi:
                self._edits.add_scalar(row, col, v)
                return
        if type(values) is np.ndarray and values.ndim == 1 and values.dtype == self._edits.dtype:
            arr = values  # already the target dtype: nothing to check
        else:
            arr = self._checked(values, f"values (edit index={row}, start={col})")
        end = col + arr.shape[0]
        if end > cols:
            raise ValueError(
                f"edit (index={row}, start={col}, {arr.shape[0]} values) ends at column {end}, "
                f"past the end of the row ({cols} columns)"
            )
        if arr.shape[0]:
            self._edits.add(row, col, arr)

    def _checked(self, values: Any, name: str) -> np.ndarray:
        """``values`` as a 1-D array of the target dtype; raises if a value would change."""
        lim = self._float_limit
        if lim is None:  # a float target: convert's checks are exact
            return host_array(values, self.dtype, name, ndims=(1,), iterables=True)
        if not isinstance(values, (list, tuple, np.ndarray, torch.Tensor, str, bytes, dict)) \
                and isinstance(values, Iterable):
            values = list(values)  # read a one-shot iterable once
        try:
            arr = host_array(values, None, name, ndims=(1,), iterables=True)
        except TypeError:  # e.g. a uint64 input: the dtype-aware path converts it or says why not
            return host_array(values, self.dtype, name, ndims=(1,), iterables=True)
        if arr.dtype.kind == "f" and arr.size:
            a64 = arr.astype(np.float64, copy=False)  # float16 cannot hold lim: compare in float64
            if (np.isfinite(a64) & ((a64 < -lim) | (a64 >= lim))).any():
                # convert.cast_checked compares with the dtype's max in float precision, where
                # 2.0**63 (float32: 2.0**31) equals it: a value one past the range would wrap.
                raise ValueError(f"{name} holds values outside {self._edits.dtype}'s range "
                                 f"[{-int(lim)}, {int(lim) - 1}]")
        return cast_checked(arr, self._edits.dtype, name)

    def stage_write_elem(self, index: int, value: Any) -> None:
        """Stage ``gpu[index, 0] = value`` (``gpu[index]`` on a 1-D target)."""
        lo, hi = self._scalar_range
        if type(value) is self._scalar_type and lo <= value <= hi and self.cols:  # fast path
            row = _int_in(index, "index", 0, self.rows, f"the target has {self.rows} rows")
            self._edits.add_scalar(row, 0, value)
            return
        if isinstance(value, (np.ndarray, torch.Tensor)):
            if value.ndim != 0:
                raise ValueError(f"value has shape {tuple(value.shape)}; stage_write_elem takes one scalar")
            value = value.reshape(1)
        else:
            value = [value]  # a list or other iterable becomes a rank-2 input and is rejected
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
        slot_count(max_concurrency)
        self.device = capabilities(device).device
        self.max_concurrency = max_concurrency
        self._launcher = _Launcher(self.device, max_concurrency, self._capacity(self.max_writes))
        self._launcher.stager = StepStager(self.device, capacity=self._launcher.capacity,
                                           max_concurrency=max_concurrency)
        self._launcher.arena = np.empty(self._launcher.capacity, np.uint8)
        self._edit_growths = 0
        self.kernel = select_kernel(self.device)

    @staticmethod
    def _capacity(max_writes: int) -> int:
        # metadata (about 8 int64 words per edit) plus room for about 16 8-byte values per edit
        return 1024 + 192 * max_writes

    def apply(self, tensors: Iterable[StagedWriteTensor]) -> None:
        """Apply and clear the staged edits of ``tensors`` (one dtype, this device) in one launch."""
        if isinstance(tensors, StagedWriteTensor) or not isinstance(tensors, Iterable):
            raise TypeError(f"tensors must be a list (or other iterable) of StagedWriteTensor; "
                            f"got {type(tensors).__name__}")
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
        if len(targets) >= 1 << (63 - KEY_SHIFT):
            raise ValueError(f"{len(targets)} tensors in one apply; at most {(1 << (63 - KEY_SHIFT)) - 1}")
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
