"""``StagedWriteTensor`` and ``FusedStagedWriter``: staging calls, checks, and apply."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from .._buffers import UvaBuffer
from .._constants import check_mode
from .._convert import cast_checked, host_array, numpy_dtype, shape_of, torch_dtype
from .._errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    PinnedAllocationError,
    StagedWriteError,
    TierUnavailableError,
    UvaError,
)
from .._guard import slot_count
from .._log import warn_once
from .._memory import alloc_device
from .._probe import capabilities
from .._sealed import Sealed
from .._tier import Tier
from .._types import DeviceLike, DTypeLike, HostData
from .plan import _CAPACITY, _arange, _Batch, _Gathered, _ints, _Launcher

ALLOWED_DTYPES = (torch.int32, torch.int64, torch.float32)
_NP_INTS = frozenset(np.dtype(c).type for c in "bBhHiIlLqQ")
"""numpy's integer scalar types (taken as a start column like a Python int)."""


def _dtype(dtype: DTypeLike) -> torch.dtype:
    allowed = ", ".join(str(d).replace("torch.", "") for d in ALLOWED_DTYPES)
    try:
        dt = torch_dtype(dtype)
    except TypeError:
        dt = None
    if dt not in ALLOWED_DTYPES:
        raise InvalidArgumentError(f"dtype={dtype!r} is not supported for staged writes; allowed: {allowed}")
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
    raise InvalidArgumentError(f"{name}={x!r} is not a valid {name}; allowed: {allowed}")


def _stage_write_fn(t: StagedWriteTensor) -> Any:
    rows, cols, stride = t.rows, t.cols, t.row_stride
    dst_append, lens_append, vals_extend = t._dst.append, t._lens.append, t._vals.extend
    checked = t._stage_checked

    def stage_write(index: int, start: int, values: Any) -> None:
        if type(values) is list and type(index) is int:
            if type(start) is not int:  # vLLM passes numpy ints here (a row's block count)
                if type(start) not in _NP_INTS:
                    checked(index, start, values)
                    return
                start = int(start)
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
            raise InvalidArgumentError(
                f"size={size!r} has rank {len(shape)}; allowed: 1 (n) or 2 (rows, cols)"
            )
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
            raise InvalidArgumentError(
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
            raise InvalidArgumentError(
                f"value is a {type(value).__name__}; stage_write_elem takes one scalar"
            )
        if isinstance(value, (np.ndarray, torch.Tensor)):
            if value.ndim != 0:
                raise InvalidArgumentError(
                    f"value has shape {tuple(value.shape)}; stage_write_elem takes one scalar"
                )
            value = value.reshape(1)
        else:
            if isinstance(value, (bool, np.bool_)):
                raise ArgumentTypeError(f"value={value!r} is a bool; allowed: an int or float")
            if not isinstance(value, (int, float, np.number)):
                raise ArgumentTypeError(
                    f"value={value!r} is a {type(value).__name__}; allowed: an int or float"
                )
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
            raise InvalidArgumentError(
                f"starts has {s.shape[0]} entries but rows has {e}; allowed: one start per row"
            )
        try:
            v = host_array(values, None, "values", ndims=(1, 2) if lengths is None else (1,))
        except TypeError:  # e.g. uint64: converted to the target dtype with checks, or refused
            v = host_array(values, self.dtype, "values", ndims=(1, 2) if lengths is None else (1,))
        if lengths is None:
            if v.shape[0] != e:
                raise InvalidArgumentError(
                    f"values has {v.shape[0]} rows but rows has {e}; allowed: one per edit"
                )
            width = 1 if v.ndim == 1 else v.shape[1]
            lens = np.full(e, width, np.int64)
        else:
            lens = _ints(lengths, "lengths")
            if lens.shape[0] != e:
                raise InvalidArgumentError(
                    f"lengths has {lens.shape[0]} entries but rows has {e}; allowed: one per edit"
                )
            if e and (lens < 0).any():
                i = int(np.flatnonzero(lens < 0)[0])
                raise InvalidArgumentError(f"lengths[{i}]={lens[i]} is negative; allowed: an int >= 0")
            total = int(lens.sum()) if e else 0
            if v.shape[0] != total:
                raise InvalidArgumentError(f"values has {v.shape[0]} elements but lengths add up to {total}")
        try:
            flat = self._checked(v.reshape(-1), "values")
        except ValueError as err:  # name the first edit whose values do not fit
            bad = self._unfit(v.reshape(-1)) if v.dtype.kind in "iuf" else None
            if bad is None:
                raise
            i = int(np.searchsorted(np.cumsum(lens), int(np.flatnonzero(bad)[0]), side="right"))
            raise InvalidArgumentError(f"edit {i} (rows[{i}]={r[i]}, starts[{i}]={s[i]}): {err}") from None
        if e:
            bad = (r < 0) | (r >= self.rows)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise InvalidArgumentError(f"rows[{i}]={r[i]} is out of range; allowed: [0, {self.rows - 1}]")
            bad = s < 0
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise InvalidArgumentError(f"starts[{i}]={s[i]} is negative; allowed: an int >= 0")
            bad = s + lens > self.cols
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise InvalidArgumentError(
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
                raise InvalidArgumentError(
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
        short = len(vals) <= 256
        if short:  # on a short list the type scan is the cheaper test, and it settles most cases
            types = set(map(type, vals))
            if bool not in types and np.bool_ not in types:
                return False
        first = np.cumsum(lens) - lens
        if not ((np.minimum.reduceat(a, first) >= 0) & (np.maximum.reduceat(a, first) <= 1)).any():
            return False
        if short:
            return True
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
        self._verified: set[tuple[Any, ...]] = set()
        """(name, data_ptr, version, expected) of device output_ptrs/strides already read and matched."""
        self._check = check_mode()
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
            raise ArgumentTypeError(
                f"tensors must be a list (or other iterable) of StagedWriteTensor; "
                f"got {type(tensors).__name__}"
            )
        tensors = list(tensors)
        targets: list[StagedWriteTensor] = []
        for i, t in enumerate(tensors):
            if not isinstance(t, StagedWriteTensor):
                raise ArgumentTypeError(f"tensors[{i}] is a {type(t).__name__}; expected StagedWriteTensor")
            if t.device != self.device:
                raise InvalidArgumentError(
                    f"tensors[{i}] is on {t.device}; this writer targets {self.device}"
                )
            if targets and t.dtype != targets[0].dtype:
                raise InvalidArgumentError(
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

    def _check_outputs(self, tensors: list[StagedWriteTensor], given: Any, name: str, want: Any) -> None:
        """Check ``output_ptrs``/``output_strides`` against ``tensors``; never a device sync per call.

        A sequence, or a CPU tensor, is compared every call. A device tensor's shape,
        dtype and device are checked every call; its contents are read once per
        distinct (tensor, version, expected values) and remembered, since reading
        device memory on the host waits for the device. ``STAGEBUF_CHECK=1`` reads
        them every call.
        """
        if given is None:
            return
        expect = [int(want(t)) for t in tensors]
        key = None
        if isinstance(given, torch.Tensor):
            if given.dtype not in (torch.int64, torch.uint64, torch.int32) or given.numel() != len(tensors):
                raise InvalidArgumentError(
                    f"{name} is a tensor of shape {tuple(given.shape)}, dtype {given.dtype}; allowed: "
                    f"{len(tensors)} integers (int64, uint64 or int32), one per tensor"
                )
            if given.device.type != "cpu":
                if given.device != self.device:
                    raise InvalidArgumentError(
                        f"{name} is on {given.device}; allowed: the CPU or this writer's {self.device}"
                    )
                key = (name, given.data_ptr(), given._version, tuple(expect))
                if key in self._verified and not self._check:
                    return
            given = given.detach().cpu().reshape(-1).tolist()  # a sync only for a new device tensor
        try:
            got = [int(v) for v in given]
        except (TypeError, ValueError):
            raise ArgumentTypeError(
                f"{name} must be None or a sequence (or tensor) of ints, one per tensor; "
                f"got {type(given).__name__}"
            ) from None
        if got != expect:
            raise InvalidArgumentError(
                f"{name}={got} does not match the tensors passed ({expect}); "
                f"allowed: None, or exactly those values in the same order"
            )
        if key is not None:
            if len(self._verified) >= 64:
                self._verified.clear()
            self._verified.add(key)

    def stats(self) -> dict[str, int]:
        """The stager's counters (transfers, bytes, growths, guard_waits, steps) and max_writes growths."""
        return {**self._launcher.stats(), "edit_growths": self._edit_growths}

    def __repr__(self) -> str:
        return f"FusedStagedWriter(device={self.device}, max_writes={self.max_writes})"
