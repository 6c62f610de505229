"""Staged writes: sparse ``(row, start, values)`` edits to device tensors, one transfer and one launch.

Per-request device state (block tables, prompt token ids) lives in large device
tensors that change a little each step. ``StagedWriteTensor`` collects edits on
the host and applies all of them at once; ``FusedStagedWriter`` does the same
for several tensors of one dtype.

Staging is as cheap as appending to a list: ``stage_write`` checks the row and
the column range (O(1) integer checks) and appends; values given as a Python
list are checked at apply, vectorised over the whole batch. ``stage_writes``
stages a batch of edits from numpy arrays with a few array operations.

Apply (one per call, whatever the number of edits):

1. Gather and check every staged edit (numpy). A bad value raises
   ``StagedWriteError`` naming the edit (its position and its row and start);
   then nothing is written and every staged edit stays staged.
2. Pack them into the next slot of the writer's own guarded ring (written in
   place: the slots are private): one host-to-device transfer on the copy
   tiers, none on UVA.
3. Write them with one launch, the cheaper of two kernels for the batch:

   * ``scatter``: the flat destination index of every element, computed on the
     host, and one ATen ``index_copy_`` on the target's flat view;
   * ``triton``: one program per edit (``_staged_write_kernel``), reading
     (tensor, offset, length, source) per edit, so large edits move their
     values only; several targets go through one launch via a pointer table.

   On the HOST tier the scatter is one numpy assignment into the target.

Overlapping edits apply in staging order ("later wins"): when two edits share
a row (a Python set for a few edits, else one scatter into a per-row marker
array), the elements are
de-duplicated on the host, keeping each destination's last staged value, and
the scatter kernel runs. ``_torch_twin`` is the Triton kernel in plain torch
ops over the same packed layout: the oracle the kernel is tested against.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from ._sealed import Sealed
from ._types import DeviceLike, DTypeLike, HostData
from .buffers import StagingBuffer, UvaBuffer, make_buffer
from .convert import _NUMPY_TO_TORCH, cast_checked, host_array, numpy_dtype, shape_of, torch_dtype
from .guard import SlotRing
from .log import warn_once
from .memory import PinnedAllocationError, alloc_device
from .pool import empty_stats, slot_count
from .probe import TierUnavailableError, capabilities
from .stager import ALIGN
from .tier import Tier
from .uva import UvaError

ALLOWED_DTYPES = (torch.int32, torch.int64, torch.float32)
KERNELS = ("auto", "scatter", "triton")
ENV_KERNEL = "STAGEBUF_WRITE_KERNEL"
"""Forces the apply kernel (``scatter`` or ``triton``); ``auto`` (default) picks per batch."""
TRITON_MIN_ELEMS = 1 << 13
"""``auto`` uses the Triton kernel from this many staged elements on (measured: docs/DESIGN.md)."""
MIN_BLOCK = 16
MAX_BLOCK = 1024
"""Columns one Triton program writes per iteration (a power of two in [MIN_BLOCK, MAX_BLOCK])."""
_CAPACITY = 1 << 14
_GUARD_MODE = "auto"
"""The staging slots' guard (tests force ``wait`` to exercise it on the CPU tiers)."""

tl: Any = None  # triton.language, imported on first use (importing stagebuf stays cheap)
_triton_error: list[str] = []


class StagedWriteError(ValueError):
    """A staged edit cannot be applied; ``position``, ``index`` and ``start`` name it.

    Nothing was written and every staged edit is still staged: inspect them with
    ``pending_writes()``, drop them with ``clear_staged_writes()``.
    """

    def __init__(self, message: str, position: int, index: int, start: int):
        super().__init__(message)
        self.position = position
        self.index = index
        self.start = start


# --- kernels ------------------------------------------------------------------------


def _triton_available() -> bool:
    global tl
    if tl is not None:
        return True
    if _triton_error:
        return False
    try:
        import triton.language as _tl
    except Exception as e:  # not installed, or broken
        _triton_error.append(f"{type(e).__name__}: {e}"[:200])
        return False
    tl = _tl
    return True


def triton_usable(device: torch.device) -> bool:
    """Whether the Triton kernel can run on ``device`` (CUDA, or the CPU interpreter)."""
    if device.type == "cuda":
        return _triton_available()
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1" and _triton_available()


# Triton reads a kernel's parameter annotations (they select its specialisation): leave them off.
def _staged_write_kernel(meta, content, table, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    # One program per edit; meta row: target, flat offset of the first element, length, source offset.
    e = tl.program_id(0)
    tid = tl.load(meta + 4 * e)
    dst = tl.load(meta + 4 * e + 1)
    ln = tl.load(meta + 4 * e + 2)
    src = tl.load(meta + 4 * e + 3)
    base = tl.load(table + tid).to(tl.pointer_type(content.dtype.element_ty))
    cols = tl.arange(0, BLOCK)
    c0 = 0
    while c0 < ln:
        m = c0 + cols < ln
        v = tl.load(content + src + c0 + cols, mask=m)
        tl.store(base + dst + c0 + cols, v, mask=m)
        c0 += BLOCK


_triton_functions: dict[tuple[Callable[..., None], bool], Any] = {}


def triton_function(fn: Callable[..., None], interpret: bool) -> Any:
    """The Triton kernel ``fn``: a ``JITFunction``, or with ``interpret`` an ``InterpretedFunction``
    (Triton's CPU interpreter); made once per (``fn``, ``interpret``)."""
    k = _triton_functions.get((fn, interpret))
    if k is None:
        if interpret:
            from triton.runtime.interpreter import InterpretedFunction

            k = InterpretedFunction(fn)
        else:
            from triton.runtime.jit import JITFunction

            k = JITFunction(fn)
        _triton_functions[(fn, interpret)] = k
    return k


def _triton_kernel(interpret: bool) -> Any:
    return triton_function(_staged_write_kernel, interpret)


def _block_for(longest: int) -> int:
    b = MIN_BLOCK
    while b < longest and b < MAX_BLOCK:
        b *= 2
    return b


def _launch_triton(
    device: torch.device,
    meta: torch.Tensor,
    content: torch.Tensor,
    table: torch.Tensor,
    n_edits: int,
    block: int,
) -> None:
    if device.type == "cuda":
        launch = _triton_kernel(interpret=False)[(n_edits,)]
        warps = max(1, min(4, block // 128))
        if torch.cuda.current_device() == device.index:
            launch(meta, content, table, BLOCK=block, num_warps=warps)
        else:
            with torch.cuda.device(device):
                launch(meta, content, table, BLOCK=block, num_warps=warps)
    else:
        _triton_kernel(interpret=True)[(n_edits,)](meta, content, table, BLOCK=block)


def _torch_twin(flats: Sequence[torch.Tensor], meta: torch.Tensor, content: torch.Tensor) -> None:
    """The Triton kernel in plain torch ops, on the same packed layout (its test oracle)."""
    n = content.shape[0]
    tid, dst, ln, src = meta.unbind(1)
    edit_of = torch.repeat_interleave(ln, output_size=n)
    j = torch.arange(n, device=content.device) - (torch.cumsum(ln, 0) - ln)[edit_of]
    dest, source, owner = dst[edit_of] + j, src[edit_of] + j, tid[edit_of]
    for k, flat in enumerate(flats):
        sel = owner == k
        flat.index_copy_(0, dest[sel], content[source[sel]])


# --- gathering and checking the staged edits ------------------------------------------


class _Batch:
    """Edits staged by one ``stage_writes`` call (checked), or sealed list edits (values unchecked).

    ``dst`` is each edit's flat offset in the target (``row * row_stride + start``).
    """

    __slots__ = ("dst", "lens", "vals", "checked")

    def __init__(self, dst: Any, lens: Any, vals: Any, checked: bool):
        self.dst, self.lens, self.vals, self.checked = dst, lens, vals, checked


class _Gathered:
    """One target's staged edits as arrays: first-element offsets, lengths, values."""

    __slots__ = ("target", "dst", "lens", "vals", "dup", "width")

    def __init__(
        self,
        target: StagedWriteTensor,
        dst: np.ndarray,
        lens: np.ndarray,
        vals: np.ndarray,
        dup: bool,
        width: int = 0,
    ):
        self.target, self.dst, self.lens, self.vals, self.dup = target, dst, lens, vals, dup
        self.width = width
        """The length of every edit where they are all one length (0: unknown or mixed)."""

    def dest(self) -> tuple[np.ndarray, np.ndarray]:
        """Flat destination of every element, and the values, de-duplicated (later wins) if needed."""
        first = self.dst
        n = self.vals.shape[0]
        if n == first.shape[0]:  # one element per edit
            dest = first
        elif self.width:  # every edit of one length: one broadcast add
            dest = (first[:, None] + _arange(self.width)).reshape(-1)
        else:
            lens = self.lens
            dest = np.repeat(first - (np.cumsum(lens) - lens), lens) + np.arange(n, dtype=np.int64)
        vals = self.vals
        if self.dup:
            rev = dest[::-1]
            _, last = np.unique(rev, return_index=True)  # each destination's last staged element
            keep = (n - 1) - last
            dest, vals = dest[keep], vals[keep]
        return dest, vals


_ARANGE = np.arange(1024, dtype=np.int64)


def _arange(n: int) -> np.ndarray:
    """``np.arange(n)`` (int64) from a cached array where it is long enough (read-only use)."""
    return _ARANGE[:n] if n <= _ARANGE.shape[0] else np.arange(n, dtype=np.int64)


def _ints(x: Any, name: str) -> np.ndarray:
    """A 1-D int64 array of the integers in ``x`` (bools and fractions are refused)."""
    a = x if isinstance(x, np.ndarray) else host_array(x, None, name, ndims=(1,))
    if a.ndim != 1:
        raise ValueError(f"{name} has rank {a.ndim} (shape {a.shape}); allowed: a 1-D array of ints")
    if a.dtype.kind not in "iu":
        if a.dtype.kind == "f" and a.size and np.isfinite(a).all() and (a == np.trunc(a)).all():
            pass  # integral floats are accepted, as elsewhere in stagebuf
        elif a.size:
            raise TypeError(f"{name} has dtype {a.dtype}; allowed: an integer array")
    if a.dtype.kind == "u" and a.size and int(a.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{name} holds values beyond int64")
    return a.astype(np.int64, copy=False)


# --- the launcher: one packed transfer, one launch --------------------------------------


class _Launcher:
    """The staging slots behind one writer: one packed transfer and one launch per apply.

    A ring of ``max_concurrency`` byte arenas of the writer's tier (guarded like
    every ring: see :mod:`stagebuf.guard`). An apply writes its index (or per-edit
    metadata) array at offset 0 and the values after it, directly in the slot's
    host memory (private to the writer, so no scratch copy is needed), publishes
    the used prefix with one copy on the copy tiers (none on UVA) and launches.
    Device views of each layout are cached per slot.
    """

    def __init__(self, device: torch.device, max_concurrency: int, capacity: int):
        self.device = device
        self.n = max_concurrency
        self.capacity = max(capacity, ALIGN)
        self.bufs: list[StagingBuffer] = []
        self.views: list[
            dict[tuple[Any, ...], tuple[np.ndarray, np.ndarray, torch.Tensor, torch.Tensor, int]]
        ] = []
        self.bases: list[dict[Any, torch.Tensor]] = []
        """Per slot: its whole device arena viewed as each dtype (views are slices of these)."""
        self.retired: list[list[StagingBuffer]] = []
        self.ring: SlotRing | None = None
        self.stats_ = {**empty_stats(), "steps": 0}
        self.table_key: tuple[int, ...] | None = None
        self.table: torch.Tensor | None = None
        forced = os.environ.get(ENV_KERNEL, "auto").strip().lower() or "auto"
        if forced not in KERNELS:
            raise ValueError(f"{ENV_KERNEL}={forced!r}; allowed: {', '.join(KERNELS)}")
        self.forced = forced

    def stats(self) -> dict[str, int]:
        ring = self.ring
        return {
            **self.stats_,
            "guard_waits": ring.waits if ring is not None else 0,
            "steps": ring.seq if ring is not None else 0,
        }

    def _start(self) -> SlotRing:
        self.bufs = [make_buffer(self.capacity, torch.uint8, self.device) for _ in range(self.n)]
        self.views = [{} for _ in range(self.n)]
        self.bases = [{} for _ in range(self.n)]
        self.retired = [[] for _ in range(self.n)]
        tier = max(b.tier for b in self.bufs)
        self.ring = SlotRing(self.n, self.device, _GUARD_MODE, tier, "staged-write slot")
        return self.ring

    def _slot(
        self, cur: int, idx: np.ndarray, vals: np.ndarray
    ) -> tuple[StagingBuffer, tuple[np.ndarray, np.ndarray, torch.Tensor, torch.Tensor, int]]:
        """Slot ``cur``'s buffer and its views for this layout (made, and the slot grown, if needed)."""
        buf = self.bufs[cur]
        key = (idx.shape, vals.dtype, vals.shape[0])
        v = self.views[cur].get(key)
        if v is not None:
            return buf, v
        a_bytes = idx.nbytes
        off = (a_bytes + ALIGN - 1) & -ALIGN
        used = off + vals.nbytes
        if used > buf.shape[0]:
            if buf.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "staged writes: a slot must grow while a CUDA graph is being captured; "
                    "apply once with the largest batch before capturing"
                )
            cap = 1 << max(used - 1, 1).bit_length()
            self.retired[cur].append(buf)  # read by this slot's last launch, until it comes round
            buf = self.bufs[cur] = make_buffer(cap, torch.uint8, self.device, buf.tier)
            self.views[cur].clear()
            self.bases[cur].clear()
            self.stats_["growths"] += 1
        elif len(self.views[cur]) >= 1024:
            self.views[cur].clear()
        # one slice per view, from whole-arena views of each dtype (a layout seen before is a lookup)
        bases = self.bases[cur]
        i64 = bases.get(np.int64)
        if i64 is None:
            i64 = bases[np.int64] = buf.dev.view(torch.int64)
        vt = bases.get(vals.dtype)
        if vt is None:
            vt = bases[vals.dtype] = buf.dev.view(_NUMPY_TO_TORCH[vals.dtype])
        n_idx = idx.size
        d_idx = i64[:n_idx] if idx.ndim == 1 else i64[:n_idx].view(idx.shape)
        first = off // vals.dtype.itemsize
        d_val = vt[first : first + vals.shape[0]]
        h_idx = buf.np[:a_bytes].view(np.int64).reshape(idx.shape)
        h_val = buf.np[off:used].view(vals.dtype)
        v = self.views[cur][key] = (h_idx, h_val, d_idx, d_val, used)
        return buf, v

    def _pack(self, idx: np.ndarray, vals: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``idx`` and ``vals`` into the next slot and publish them; their device views."""
        ring = self.ring if self.ring is not None else self._start()
        cur = ring.next()
        self.retired[cur].clear()  # the guard says this slot's last launch is done
        buf, (h_idx, h_val, d_idx, d_val, used) = self._slot(cur, idx, vals)
        h_idx[...] = idx
        h_val[...] = vals
        ring.take(cur)
        if buf.tier.copies:
            buf.uva(used)
            self.stats_["transfers"] += 1
            self.stats_["bytes"] += used
        return d_idx, d_val

    def kernel_for(self, parts: Sequence[_Gathered], n_elems: int) -> str:
        if parts[0].target.tier is Tier.HOST:
            return "host"
        if parts[0].dup if len(parts) == 1 else any(p.dup for p in parts):
            return "scatter"  # overlaps: de-duplicated on the host, then one scatter
        want = self.forced
        if want == "auto":
            want = "triton" if n_elems >= TRITON_MIN_ELEMS or len(parts) > 1 else "scatter"
        if want == "triton" and not triton_usable(self.device):
            if self.forced == "triton":
                warn_once(
                    ("staged-write-no-triton", str(self.device)),
                    f"staged writes on {self.device} use the scatter kernel: Triton cannot run "
                    f"here ({_triton_error[0] if _triton_error else 'not on this device'})",
                )
            return "scatter"
        return want

    def apply(self, parts: Sequence[_Gathered]) -> str:
        """Write the gathered edits of ``parts``; the kernel's name."""
        n_elems = parts[0].vals.shape[0] if len(parts) == 1 else sum(p.vals.shape[0] for p in parts)
        kernel = self.kernel_for(parts, n_elems)
        if kernel == "host":
            for p in parts:
                dest, vals = p.dest()
                flat = p.target._flat_np
                assert flat is not None  # set on every HOST-tier target; all parts share one device
                flat[dest] = vals
            return kernel
        if kernel == "scatter":
            pieces = [p.dest() for p in parts]
            if len(pieces) == 1:
                dest, vals = pieces[0]
            else:
                dest = np.concatenate([d for d, _ in pieces])
                vals = np.concatenate([v for _, v in pieces])
            d_dest, d_vals = self._pack(dest, vals)
            if len(parts) == 1:
                parts[0].target._flat.index_copy_(0, d_dest, d_vals)
            else:
                a = 0
                for p, (d, _) in zip(parts, pieces):
                    b = a + d.shape[0]
                    p.target._flat.index_copy_(0, d_dest[a:b], d_vals[a:b])
                    a = b
        else:
            meta, vals, longest = _edit_meta(parts)
            key = tuple(p.target.gpu.data_ptr() for p in parts)
            if key != self.table_key:
                self.table = torch.tensor(key, dtype=torch.int64).to(self.device)
                self.table_key = key
            assert self.table is not None
            d_meta, d_vals = self._pack(meta, vals)
            _launch_triton(self.device, d_meta, d_vals, self.table, meta.shape[0], _block_for(longest))
        assert self.ring is not None
        self.ring.mark()
        return kernel


def _edit_meta(parts: Sequence[_Gathered]) -> tuple[np.ndarray, np.ndarray, int]:
    """The Triton kernel's per-edit rows (target, offset, length, source), the values, the longest edit."""
    metas, vals = [], []
    src = 0
    longest = 1
    for k, p in enumerate(parts):
        e = p.dst.shape[0]
        m = np.empty((e, 4), np.int64)
        m[:, 0] = k
        m[:, 1] = p.dst
        m[:, 2] = p.lens
        np.cumsum(p.lens, out=m[:, 3])
        m[:, 3] += src - p.lens
        src += p.vals.shape[0]
        longest = max(longest, int(p.lens.max()))
        metas.append(m)
        vals.append(p.vals)
    if len(parts) == 1:
        return metas[0], vals[0], longest
    return np.concatenate(metas), np.concatenate(vals), longest


# --- public classes -----------------------------------------------------------------


def _dtype(dtype: DTypeLike) -> torch.dtype:
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


def _stage_write_fn(t: StagedWriteTensor) -> Any:
    rows, cols, stride = t.rows, t.cols, t.row_stride
    dst_append, lens_append, vals_extend = t._dst.append, t._lens.append, t._vals.extend
    checked = t._stage_checked

    def stage_write(index: int, start: int, values: Any) -> None:
        if type(values) is list and type(index) is int and type(start) is int:
            n = len(values)
            if 0 <= index < rows and start >= 0 and start + n <= cols and n:
                dst_append(index * stride + start)
                lens_append(n)
                vals_extend(values)
                return
        checked(index, start, values)

    stage_write.__doc__ = StagedWriteTensor.stage_write.__doc__
    return stage_write


def _stage_write_elem_fn(t: StagedWriteTensor) -> Any:
    rows, stride = t.rows, t.row_stride
    dst_append, lens_append, vals_append = t._dst.append, t._lens.append, t._vals.append
    checked = t._stage_elem_checked

    def stage_write_elem(index: int, value: Any) -> None:
        if type(index) is int and 0 <= index < rows and (type(value) is int or type(value) is float):
            dst_append(index * stride)
            lens_append(1)
            vals_append(value)
            return
        checked(index, value)

    stage_write_elem.__doc__ = StagedWriteTensor.stage_write_elem.__doc__
    return stage_write_elem


class StagedWriteTensor(Sealed):
    """A zero-filled device tensor edited by staged ``(row, start, values)`` writes.

    ``size`` is ``(rows, cols)`` or ``n`` (n rows of one column: ``stage_write_elem(i, v)``
    sets ``gpu[i]``). ``device=None`` is the current accelerator, else the CPU.
    ``uva_instead_of_gpu`` keeps the tensor in pinned host memory that kernels read
    through UVA (tier UVA only; elsewhere it is a device tensor, logged once).
    ``apply_write()`` applies every staged edit with one transfer and one launch;
    overlapping edits apply in staging order.
    """

    def __init__(
        self,
        size: int | Sequence[int],
        dtype: DTypeLike,
        device: DeviceLike = None,
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
        self.num_rows = self.rows = shape[0]
        self.cols = shape[1] if len(shape) == 2 else 1
        self.row_stride = self.cols
        self.max_concurrency = slot_count(max_concurrency)
        self.uva_buffer: UvaBuffer | None = None
        self.gpu = self._alloc(uva_instead_of_gpu)
        self._flat = self.gpu.view(-1)
        self._flat_np = self._flat.numpy() if self.tier is Tier.HOST else None
        self._np_dtype = numpy_dtype(self.dtype)
        self._float_limit = None if self.dtype.is_floating_point else 2.0 ** (8 * self._np_dtype.itemsize - 1)
        if self._float_limit is not None:
            self._int_lo, self._int_hi = int(np.iinfo(self._np_dtype).min), int(np.iinfo(self._np_dtype).max)
        # list-staged edits: flat offset of the first element, length, and the values (appended as
        # given); bound methods, so a stage_write costs three list operations and no lookups
        self._dst: list[int] = []
        self._lens: list[int] = []
        self._vals: list[Any] = []
        self._dst_append = self._dst.append
        self._lens_append = self._lens.append
        self._vals_extend = self._vals.extend
        self._vals_append = self._vals.append
        self._batches: list[_Batch] = []
        self._lens_cache: dict[tuple[int, int], np.ndarray] = {}
        self._mark: np.ndarray | None = None
        self._launcher = _Launcher(self.device, self.max_concurrency, _CAPACITY)
        # The staging calls as closures over this tensor's bounds and lists: the same code as the
        # methods below, about a third cheaper per call (no bound-method object, no attribute loads).
        self.stage_write = _stage_write_fn(self)  # type: ignore[method-assign]
        self.stage_write_elem = _stage_write_elem_fn(self)  # type: ignore[method-assign]
        self._kernel = "host" if self.tier is Tier.HOST else "scatter"
        self._freeze()

    _READ_ONLY: ClassVar[dict[str, str]] = {
        "gpu": "applies write the tensor made at construction; edit it with stage_write() + apply_write()",
        "stage_write": "it is this tensor's staging call",
        "stage_write_elem": "it is this tensor's staging call",
    }

    @property
    def kernel(self) -> str:
        """The kernel the last apply ran: ``host``, ``scatter`` or ``triton``."""
        return self._kernel

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
            warn_once(
                ("staged-write-uva", str(self.device), self.tier),
                f"StagedWriteTensor(uva_instead_of_gpu=True) on {self.device} is a device tensor: {why}",
            )
        return alloc_device(self.shape, self.dtype, self.device)

    @property
    def in_host_memory(self) -> bool:
        """True when ``.gpu`` is pinned host memory read through UVA."""
        return self.uva_buffer is not None

    @property
    def num_staged(self) -> int:
        """Edits staged and not yet applied (empty ones are not kept)."""
        return len(self._dst) + sum(len(b.dst) for b in self._batches)

    # --- staging ---

    def stage_write(self, index: int, start: int, values: HostData) -> None:
        """Stage ``gpu[index, start:start + len(values)] = values``, applied by ``apply_write()``.

        The row and the column range are checked now; values given as a list are
        checked at apply (with the whole batch), other inputs now. (Each tensor
        replaces this method with the closure ``_stage_write_fn`` makes.)
        """
        _stage_write_fn(self)(index, start, values)

    def _stage_checked(self, index: Any, start: Any, values: Any) -> None:
        row = _int_in(index, "index", 0, self.rows, f"the target has {self.rows} rows")
        col = _int_in(start, "start", 0, None, "")
        if type(values) is list:
            arr_len = len(values)
            arr: np.ndarray | None = None
        else:
            arr = self._checked(values, f"values (edit index={row}, start={col})")
            arr_len = arr.shape[0]
        end = col + arr_len
        if end > self.cols:
            raise ValueError(
                f"edit (index={row}, start={col}, {arr_len} values) ends at column {end}, "
                f"past the end of the row ({self.cols} columns)"
            )
        if not arr_len:
            return
        if arr is None:
            assert type(values) is list
            self._dst_append(row * self.row_stride + col)
            self._lens_append(arr_len)
            self._vals_extend(values)
            return
        self._seal()
        self._batches.append(
            _Batch(
                np.array([row * self.row_stride + col], np.int64),
                np.array([arr_len], np.int64),
                arr.copy(),
                True,
            )
        )

    def stage_write_elem(self, index: int, value: Any) -> None:
        """Stage ``gpu[index, 0] = value`` (``gpu[index]`` on a 1-D target).

        (Each tensor replaces this method with the closure ``_stage_write_elem_fn`` makes.)
        """
        _stage_write_elem_fn(self)(index, value)

    def _stage_elem_checked(self, index: Any, value: Any) -> None:
        """``stage_write_elem`` for what its fast path does not take: checked now."""
        if isinstance(value, (list, tuple)):
            raise ValueError(f"value is a {type(value).__name__}; stage_write_elem takes one scalar")
        if isinstance(value, (np.ndarray, torch.Tensor)):
            if value.ndim != 0:
                raise ValueError(f"value has shape {tuple(value.shape)}; stage_write_elem takes one scalar")
            value = value.reshape(1)
        else:
            if isinstance(value, (bool, np.bool_)):
                raise TypeError(f"value={value!r} is a bool; allowed: an int or float")
            if not isinstance(value, (int, float, np.number)):
                raise TypeError(f"value={value!r} is a {type(value).__name__}; allowed: an int or float")
            value = np.array([value])
        self._stage_checked(index, 0, value)

    def stage_writes(
        self, rows: HostData, starts: HostData, values: HostData, lengths: HostData | None = None
    ) -> None:
        """Stage a batch of edits from arrays: edit i writes row ``rows[i]`` from column ``starts[i]``.

        ``values`` is ``(E, L)`` (each edit writes L values), ``(E,)`` (one value
        each), or, with ``lengths``, a flat array whose consecutive runs of
        ``lengths[i]`` values are the edits. Everything is checked now, with
        numpy; a bad edit raises naming its position and stages nothing.
        """
        if (
            lengths is None
            and type(rows) is np.ndarray
            and type(starts) is np.ndarray
            and type(values) is np.ndarray
            and values.dtype == self._np_dtype
            and rows.ndim == 1
            and rows.dtype.kind in "iu"
            and starts.dtype.kind in "iu"
            and values.ndim in (1, 2)
            and rows.shape[0] == starts.shape[0] == values.shape[0] > 0
        ):
            # the common case, checked with four reductions: typed arrays, every edit of one length
            e = rows.shape[0]
            width = 1 if values.ndim == 1 else values.shape[1]
            if (
                width
                and rows.min() >= 0
                and rows.max() < self.rows
                and starts.min() >= 0
                and starts.max() + width <= self.cols
            ):
                dst = rows.astype(np.int64)
                dst *= self.row_stride
                dst += starts
                self._seal()
                self._batches.append(_Batch(dst, self._full_lens(e, width), values.reshape(-1).copy(), True))
                return
        r = _ints(rows, "rows")
        s = _ints(starts, "starts")
        e = r.shape[0]
        if s.shape[0] != e:
            raise ValueError(f"starts has {s.shape[0]} entries but rows has {e}; allowed: one start per row")
        try:
            v = host_array(values, None, "values", ndims=(1, 2) if lengths is None else (1,))
        except TypeError:  # e.g. uint64: converted to the target dtype with checks, or refused
            v = host_array(values, self.dtype, "values", ndims=(1, 2) if lengths is None else (1,))
        if lengths is None:
            if v.shape[0] != e:
                raise ValueError(f"values has {v.shape[0]} rows but rows has {e}; allowed: one per edit")
            width = 1 if v.ndim == 1 else v.shape[1]
            lens = np.full(e, width, np.int64)
        else:
            lens = _ints(lengths, "lengths")
            if lens.shape[0] != e:
                raise ValueError(
                    f"lengths has {lens.shape[0]} entries but rows has {e}; allowed: one per edit"
                )
            if e and (lens < 0).any():
                i = int(np.flatnonzero(lens < 0)[0])
                raise ValueError(f"lengths[{i}]={lens[i]} is negative; allowed: an int >= 0")
            total = int(lens.sum()) if e else 0
            if v.shape[0] != total:
                raise ValueError(f"values has {v.shape[0]} elements but lengths add up to {total}")
        try:
            flat = self._checked(v.reshape(-1), "values")
        except ValueError as err:  # name the first edit whose values do not fit
            bad = self._unfit(v.reshape(-1)) if v.dtype.kind in "iuf" else None
            if bad is None:
                raise
            i = int(np.searchsorted(np.cumsum(lens), int(np.flatnonzero(bad)[0]), side="right"))
            raise ValueError(f"edit {i} (rows[{i}]={r[i]}, starts[{i}]={s[i]}): {err}") from None
        if e:
            bad = (r < 0) | (r >= self.rows)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise ValueError(f"rows[{i}]={r[i]} is out of range; allowed: [0, {self.rows - 1}]")
            bad = s < 0
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise ValueError(f"starts[{i}]={s[i]} is negative; allowed: an int >= 0")
            bad = s + lens > self.cols
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise ValueError(
                    f"edit {i} (rows[{i}]={r[i]}, starts[{i}]={s[i]}, {lens[i]} values) ends at "
                    f"column {s[i] + lens[i]}, past the end of the row ({self.cols} columns)"
                )
            keep = lens > 0
            if not keep.all():
                r, s, lens = r[keep], s[keep], lens[keep]
        if not r.shape[0]:
            return
        self._seal()
        self._batches.append(_Batch(r * self.row_stride + s, lens.copy(), np.array(flat, copy=True), True))

    def _full_lens(self, e: int, width: int) -> np.ndarray:
        """``np.full(e, width)`` (int64), cached: read-only downstream."""
        key = (e, width)
        a = self._lens_cache.get(key)
        if a is None:
            if len(self._lens_cache) >= 64:
                self._lens_cache.clear()
            a = self._lens_cache[key] = np.full(e, width, np.int64)
        return a

    def _seal(self) -> None:
        """Move the list-staged edits into a batch, so later batches keep staging order."""
        if self._dst:
            self._batches.append(_Batch(self._dst[:], self._lens[:], self._vals[:], False))
            self._clear_lists()

    def _clear_lists(self) -> None:
        self._dst.clear()
        self._lens.clear()
        self._vals.clear()

    def _where(self, dst: int) -> tuple[int, int]:
        """(index, start) of a flat offset."""
        return divmod(int(dst), self.row_stride)

    def _checked(self, values: Any, name: str) -> np.ndarray:
        """``values`` as a 1-D array of the target dtype; raises if a value would change."""
        lim = self._float_limit
        if lim is None:  # a float target: convert's checks are exact
            return host_array(values, self.dtype, name, ndims=(1,), iterables=True)
        if not isinstance(values, (list, tuple, np.ndarray, torch.Tensor, str, bytes, dict)) and isinstance(
            values, Iterable
        ):
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
                raise ValueError(
                    f"{name} holds values outside {self._np_dtype}'s range [{-int(lim)}, {int(lim) - 1}]"
                )
        return cast_checked(arr, self._np_dtype, name)

    # --- inspecting, applying ---

    def pending_writes(self) -> list[tuple[int, int, list[Any]]]:
        """The staged edits, in staging order: ``(index, start, values)``."""
        out: list[tuple[int, int, list[Any]]] = []
        for b in [*self._batches, _Batch(self._dst, self._lens, self._vals, False)]:
            vals = b.vals.tolist() if isinstance(b.vals, np.ndarray) else b.vals
            a = 0
            for d, n in zip(b.dst, b.lens):
                out.append((*self._where(d), list(vals[a : a + int(n)])))
                a += int(n)
        return out

    def _gather(self) -> _Gathered | None:
        """Every staged edit as checked arrays (raises StagedWriteError; nothing is changed then)."""
        if not self._batches:  # the common case: list edits only
            if not self._dst:
                return None
            dl, ll = self._dst, self._lens
            e = len(dl)
            if e <= 32:  # a few edits: the overlap and length checks are cheaper in Python
                w = ll[0] if ll.count(ll[0]) == e else 0
                n = self._full_lens(e, w) if w else np.array(ll, np.int64)
                v = self._list_values(_Batch(dl, ll, self._vals, False), n, 0)
                stride = self.row_stride
                dup = e > 1 and len({d // stride for d in dl} if stride != 1 else set(dl)) != e
                return _Gathered(self, np.array(dl, np.int64), n, v, dup, w)
            n = np.array(ll, np.int64)
            v = self._list_values(_Batch(dl, ll, self._vals, False), n, 0)
            return self._with_overlaps(np.array(dl, np.int64), n, v)
        batches = [*self._batches]
        if self._dst:
            batches.append(_Batch(self._dst, self._lens, self._vals, False))
        dsts, lens, vals = [], [], []
        pos = 0
        for b in batches:
            if b.checked:
                dsts.append(b.dst)
                lens.append(b.lens)
                vals.append(b.vals)
                pos += b.dst.shape[0]
                continue
            lens_b = np.array(b.lens, np.int64)
            vals.append(self._list_values(b, lens_b, pos))
            dsts.append(np.array(b.dst, np.int64))
            lens.append(lens_b)
            pos += len(b.dst)
        if len(batches) == 1:
            d, n, v = dsts[0], lens[0], vals[0]
        else:
            d, n, v = (np.concatenate(x) for x in (dsts, lens, vals))
        return self._with_overlaps(d, n, v)

    def _with_overlaps(self, d: np.ndarray, n: np.ndarray, v: np.ndarray) -> _Gathered:
        """The gathered edits, noting whether two share a row (then they may overlap)."""
        e = d.shape[0]
        dup = False
        if e > 1:  # two edits on one row may overlap: then apply them in order, on the host
            mark = self._mark
            if mark is None:
                mark = self._mark = np.empty(self.rows, np.int64)
            r = d // self.row_stride if self.row_stride != 1 else d
            ar = _arange(e)
            mark[r] = ar
            dup = bool((mark[r] != ar).any())  # exact whichever duplicate numpy wrote last
        return _Gathered(self, d, n, v, dup)

    def _list_values(self, b: _Batch, lens: np.ndarray, pos: int) -> np.ndarray:
        """The values of list-staged edits as the target dtype, checked in bulk.

        The batch is read as one array; where that cannot be trusted per edit (it
        is not numeric, a value does not fit, an edit may be all bools, or int64
        values may have gone through float64), each edit is read on its own and
        the first bad one raises.
        """
        try:
            a = np.array(b.vals)
        except (ValueError, TypeError, OverflowError):
            a = None
        if a is not None and a.ndim == 1 and a.dtype.kind in "iu" and a.size:
            # ints (or bools among them): one range check, and a bool scan only where an edit
            # could be all bools (every value 0 or 1); Python's min/max beat numpy's on short lists
            vals = b.vals
            lo, hi = (min(vals), max(vals)) if len(vals) <= 128 else (a.min(), a.max())
            target = self._np_dtype
            if (target.kind == "f" or self._int_lo <= lo and hi <= self._int_hi) and (
                lo > 1 or hi < 0 or not self._maybe_bool_edit(vals, a, lens)
            ):
                return a.astype(target, copy=False)
        elif (
            a is not None
            and a.ndim == 1
            and a.dtype.kind == "f"
            and not self._inexact(a)
            and not self._maybe_bool_edit(b.vals, a, lens)
        ):
            got = self._cast_list(a)
            if got is not None:
                return got
        out = []
        a0 = 0
        for k, n in enumerate(lens.tolist()):
            got, why = self._edit_values(b.vals[a0 : a0 + n])
            if got is None:
                row, start = self._where(b.dst[k])
                raise StagedWriteError(
                    f"staged edit {pos + k} (stage_write(index={row}, start={start}, {n} values)) "
                    f"cannot be applied to {self.dtype}: {why}. Nothing was written and every staged edit "
                    "is still staged: clear_staged_writes() drops them",
                    pos + k,
                    row,
                    start,
                )
            out.append(got)
            a0 += n
        return np.concatenate(out)

    def _inexact(self, a: np.ndarray) -> bool:
        """Whether ints may have been rounded reading a list into ``a`` (ints mixed with floats)."""
        return self._np_dtype.kind in "iu" and a.dtype.kind == "f" and bool((np.abs(a) >= 2.0**53).any())

    @staticmethod
    def _maybe_bool_edit(vals: list[Any], a: np.ndarray, lens: np.ndarray) -> bool:
        """Whether an edit may hold only bools (numpy reads bools mixed with numbers as numbers)."""
        if not a.size:
            return False
        first = np.cumsum(lens) - lens
        if not ((np.minimum.reduceat(a, first) >= 0) & (np.maximum.reduceat(a, first) <= 1)).any():
            return False
        types = set(map(type, vals))
        return bool in types or np.bool_ in types

    def _cast_list(self, a: np.ndarray) -> np.ndarray | None:
        """``a`` (read from a list, 1-D, numeric) as the target dtype; None if a value does not fit."""
        if self._unfit(a) is not None:
            return None
        return a.astype(self._np_dtype, copy=False)

    def _unfit(self, a: np.ndarray) -> np.ndarray | None:
        """Per value of the 1-D numeric ``a``: whether the target dtype cannot hold it (None: all fit)."""
        target = self._np_dtype
        if not a.size:
            return None
        if target.kind == "f":
            a64 = a.astype(np.float64, copy=False)  # an integer minimum's abs overflows in its own dtype
            bad = np.isfinite(a64) & (np.abs(a64) > np.finfo(target).max)
        elif a.dtype.kind == "f":
            lim = self._float_limit
            assert lim is not None
            a64 = a.astype(np.float64, copy=False)  # float16 cannot hold lim: compare in float64
            bad = ~np.isfinite(a64) | (a64 != np.trunc(a64)) | (a64 < -lim) | (a64 >= lim)
        else:
            info = np.iinfo(target)
            if int(a.min()) >= info.min and int(a.max()) <= info.max:
                return None
            bad = (a > info.max) if a.dtype.kind == "u" else (a < info.min) | (a > info.max)
        return bad if bad.any() else None

    def _edit_values(self, vals: list[Any]) -> tuple[np.ndarray | None, str]:
        """One list edit's values as the target dtype, or None and why not."""
        try:
            a = np.array(vals)
        except (ValueError, TypeError, OverflowError):
            a = None
        if a is not None and a.ndim == 1 and a.dtype.kind in "iuf":
            got = self._exact_ints(vals) if self._inexact(a) else self._cast_list(a)
            if got is not None:
                return got, ""
        elif a is not None and a.ndim == 1 and a.dtype.kind == "b":
            return None, "values are bools; allowed: int or float values"
        try:  # the strict check says what is wrong with this edit
            self._checked(list(vals), "values")
            why = "values do not fit the target dtype"
        except (ValueError, TypeError) as e:
            why = str(e)
        return None, why

    def _exact_ints(self, vals: list[Any]) -> np.ndarray | None:
        """Ints and whole floats as the integer target dtype, exactly; None if one does not fit."""
        info = np.iinfo(self._np_dtype)
        out = []
        for v in vals:
            if isinstance(v, (float, np.floating)):
                if v != v or v in (float("inf"), float("-inf")) or v != int(v):
                    return None
            elif not isinstance(v, (int, np.integer)):
                return None
            v = int(v)
            if not info.min <= v <= info.max:
                return None
            out.append(v)
        return np.array(out, self._np_dtype)

    def apply_write(self) -> None:
        """Apply every staged edit (one transfer, one launch), then clear them.

        A bad staged value raises StagedWriteError before anything is written, and
        every staged edit stays staged.
        """
        g = self._gather()
        if g is None:
            return
        self._kernel = self._launcher.apply([g])
        self.clear_staged_writes()

    def clear_staged_writes(self) -> None:
        """Drop the staged edits without applying them."""
        self._clear_lists()
        self._batches.clear()

    def stats(self) -> dict[str, int]:
        """This tensor's stager counters: transfers, bytes, growths, guard_waits, steps."""
        return self._launcher.stats()

    def __repr__(self) -> str:
        return (
            f"StagedWriteTensor(shape={self.shape}, dtype={self.dtype}, device={self.device}, "
            f"tier={self.tier.name}, staged={self.num_staged})"
        )


class FusedStagedWriter(Sealed):
    """Applies the staged edits of several StagedWriteTensors of one dtype: one transfer, one launch.

    ``max_writes`` is the expected number of edits per apply (it sizes the staging
    slots; a larger apply grows them).
    """

    def __init__(self, device: DeviceLike = None, max_writes: int = 1024, max_concurrency: int | None = None):
        self._max_writes = _int_in(max_writes, "max_writes", 1, None, "")
        self.max_concurrency = slot_count(max_concurrency)
        self.device = capabilities(device).device
        self._launcher = _Launcher(self.device, self.max_concurrency, self._capacity(self._max_writes))
        self._edit_growths = 0
        self._kernel = "scatter"
        self._freeze()

    @property
    def kernel(self) -> str:
        """The kernel the last apply ran: ``scatter`` or ``triton`` (``host`` on the CPU)."""
        return self._kernel

    @property
    def max_writes(self) -> int:
        """Edits per apply the slots are sized for (grows to the next power of two when exceeded)."""
        return self._max_writes

    @staticmethod
    def _capacity(max_writes: int) -> int:
        # per edit: an 8-byte destination and about 8 values of 8 bytes, or 32 bytes of Triton metadata
        return 1024 + 96 * max_writes

    def apply(
        self, tensors: Iterable[StagedWriteTensor], output_ptrs: Any = None, output_strides: Any = None
    ) -> None:
        """Apply and clear the staged edits of ``tensors`` (one dtype, this device) at once.

        ``output_ptrs`` and ``output_strides`` (vLLM's call shape: each tensor's
        ``data_ptr()`` and row stride, as a sequence or a tensor) are optional; when
        given they are checked against the tensors.
        """
        if isinstance(tensors, StagedWriteTensor) or not isinstance(tensors, Iterable):
            raise TypeError(
                f"tensors must be a list (or other iterable) of StagedWriteTensor; "
                f"got {type(tensors).__name__}"
            )
        tensors = list(tensors)
        targets: list[StagedWriteTensor] = []
        for i, t in enumerate(tensors):
            if not isinstance(t, StagedWriteTensor):
                raise TypeError(f"tensors[{i}] is a {type(t).__name__}; expected StagedWriteTensor")
            if t.device != self.device:
                raise ValueError(f"tensors[{i}] is on {t.device}; this writer targets {self.device}")
            if targets and t.dtype != targets[0].dtype:
                raise ValueError(
                    f"tensors[{i}] has dtype {t.dtype} but tensors[0] has {targets[0].dtype}; "
                    "one fused apply needs one dtype"
                )
            if not any(t is u for u in targets):
                targets.append(t)
        self._check_outputs(tensors, output_ptrs, "output_ptrs", lambda t: t.gpu.data_ptr())
        self._check_outputs(tensors, output_strides, "output_strides", lambda t: t.row_stride)
        parts = [g for g in (t._gather() for t in targets) if g is not None]
        if not parts:
            return
        n = sum(p.dst.shape[0] for p in parts)
        if n > self._max_writes:
            self._max_writes = 1 << (n - 1).bit_length()
            self._edit_growths += 1
        self._kernel = self._launcher.apply(parts)
        for p in parts:
            p.target.clear_staged_writes()

    @staticmethod
    def _check_outputs(tensors: list[StagedWriteTensor], given: Any, name: str, want: Any) -> None:
        if given is None:
            return
        if isinstance(given, torch.Tensor):
            given = given.detach().cpu().reshape(-1).tolist()
        try:
            got = [int(v) for v in given]
        except (TypeError, ValueError):
            raise TypeError(
                f"{name} must be None or a sequence (or tensor) of ints, one per tensor; "
                f"got {type(given).__name__}"
            ) from None
        expect = [int(want(t)) for t in tensors]
        if got != expect:
            raise ValueError(
                f"{name}={got} does not match the tensors passed ({expect}); "
                f"allowed: None, or exactly those values in the same order"
            )

    def stats(self) -> dict[str, int]:
        """The stager's counters (transfers, bytes, growths, guard_waits, steps) and max_writes growths."""
        return {**self._launcher.stats(), "edit_growths": self._edit_growths}

    def __repr__(self) -> str:
        return f"FusedStagedWriter(device={self.device}, max_writes={self.max_writes})"
