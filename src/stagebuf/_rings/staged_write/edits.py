"""The edits staged on one ``StagedWriteTensor``, and their check into one batch (the log and the check).

``Edits`` owns the staged state: list edits (three Python lists a ``stage_write``
appends to, values unchecked) and batches (array edits, checked when staged).
``gather()`` turns them into one ``CheckedEdits`` batch of arrays (the type the launcher
consumes lives here, with ``WriteTarget``: checking does not depend on launching),
checking list values in bulk with numpy by ``_common.convert``'s one rule. A bad list
value makes ``gather()`` raise ``StagedWriteError`` naming every bad edit; then
nothing changes, and ``discard()`` drops exactly the edits named.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from ..._common.convert import host_array, numpy_dtype, why_unfit
from ..._common.errors import ArgumentTypeError, InvalidArgumentError, StagedWriteError
from ..._common.tier import Tier
from .values import Bad, checked_values, list_values

_NP_INTS = frozenset(np.dtype(c).type for c in "bBhHiIlLqQ")
"""numpy's integer scalar types (taken as a start column like a Python int)."""


def int_in(x: Any, name: str, lo: int, hi: int | None, what: str) -> int:
    """``x`` as an int in [lo, hi) (no upper bound when ``hi`` is None), else InvalidArgumentError."""
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


def _ints(x: Any, name: str) -> np.ndarray:
    """A 1-D int64 array of the integers in ``x`` (bools and fractions are refused)."""
    a = x if isinstance(x, np.ndarray) else host_array(x, None, name, ndims=(1,))
    if a.ndim != 1:
        raise InvalidArgumentError(
            f"{name} has rank {a.ndim} (shape {a.shape}); allowed: a 1-D array of ints"
        )
    if a.dtype.kind not in "iu":
        if a.dtype.kind == "f" and a.size and why_unfit(a, np.dtype(np.int64)) is None:
            pass  # integral floats are accepted, as elsewhere in stagebuf
        elif a.size:
            raise ArgumentTypeError(f"{name} has dtype {a.dtype}; allowed: an integer array")
    if a.dtype.kind == "u" and a.size and int(a.max()) > np.iinfo(np.int64).max:
        raise InvalidArgumentError(f"{name} holds values beyond int64")
    return a.astype(np.int64, copy=False)


_ARANGE = np.arange(1024, dtype=np.int64)


def _arange(n: int) -> np.ndarray:
    """``np.arange(n)`` (int64) from a cached array where it is long enough (read-only use)."""
    return _ARANGE[:n] if n <= _ARANGE.shape[0] else np.arange(n, dtype=np.int64)


def expand_runs(first: np.ndarray, lens: np.ndarray, n: int) -> np.ndarray:
    """The index of every element of runs starting at ``first``, ``lens`` long (``n`` in all)."""
    return np.repeat(first - (np.cumsum(lens) - lens), lens) + np.arange(n, dtype=np.int64)


class WriteTarget:
    """What an apply writes: a target's flat device view, its numpy view on HOST, address, tier."""

    __slots__ = ("flat", "flat_np", "ptr", "tier")

    def __init__(self, tensor: torch.Tensor, tier: Tier):
        self.flat = tensor.view(-1)
        self.flat_np = self.flat.numpy() if tier is Tier.HOST else None
        self.ptr = tensor.data_ptr()
        self.tier = tier


class CheckedEdits:
    """One target's staged edits as checked arrays: first-element offsets, lengths, values."""

    __slots__ = ("target", "dst", "lens", "vals", "dup", "width")

    def __init__(
        self,
        target: WriteTarget,
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
            dest = expand_runs(first, self.lens, n)
        vals = self.vals
        if self.dup:
            _, last = np.unique(dest[::-1], return_index=True)  # each destination's last staged element
            keep = (n - 1) - last
            dest, vals = dest[keep], vals[keep]
        return dest, vals


class _StagedBatch:
    """Edits staged by one ``stage_writes`` call (checked), or sealed list edits (values unchecked).

    ``dst`` is each edit's flat offset in the target (``row * row_stride + start``).
    """

    __slots__ = ("dst", "lens", "vals", "checked")

    def __init__(self, dst: Any, lens: Any, vals: Any, checked: bool):
        self.dst, self.lens, self.vals, self.checked = dst, lens, vals, checked


def _stage_write_fn(e: Edits) -> Callable[[Any, Any, Any], None]:
    """``stage_write`` as a closure over the bounds and lists: three appends on the fast path."""
    rows, cols, stride = e.rows, e.cols, e.row_stride
    dst_append, lens_append, vals_extend = e._dst.append, e._lens.append, e._vals.extend
    slow = e.stage_checked  # every check, then the same appends

    def stage_write(index: int, start: int, values: Any) -> None:
        if type(values) is list and type(index) is int:
            if type(start) is not int:  # vLLM passes numpy ints here (a row's block count)
                if type(start) not in _NP_INTS:
                    slow(index, start, values)
                    return
                start = int(start)
            n = len(values)
            if 0 <= index < rows and start >= 0 and start + n <= cols and n:
                dst_append(index * stride + start)
                lens_append(n)
                vals_extend(values)
                return
        slow(index, start, values)

    return stage_write


def _stage_write_elem_fn(e: Edits) -> Callable[[Any, Any], None]:
    rows, stride = e.rows, e.row_stride
    dst_append, lens_append, vals_append = e._dst.append, e._lens.append, e._vals.append
    slow = e.stage_elem_checked

    def stage_write_elem(index: int, value: Any) -> None:
        if type(index) is int and 0 <= index < rows and (type(value) is int or type(value) is float):
            dst_append(index * stride)
            lens_append(1)
            vals_append(value)
            return
        slow(index, value)

    return stage_write_elem


class Edits:
    """The staged edits of one target of ``rows`` x ``cols`` values of ``dtype``."""

    def __init__(self, owner: Any, target: WriteTarget, rows: int, cols: int, dtype: torch.dtype):
        self.owner = owner
        """The StagedWriteTensor these edits belong to (named by StagedWriteError)."""
        self.target = target
        self.rows, self.cols, self.row_stride = rows, cols, cols
        self.dtype = dtype
        self.np_dtype = numpy_dtype(dtype)
        self._dst: list[int] = []
        self._lens: list[int] = []
        self._vals: list[Any] = []
        self._batches: list[_StagedBatch] = []
        self._lens_cache: dict[tuple[int, int], np.ndarray] = {}
        self._mark: np.ndarray | None = None
        self.stage_write = _stage_write_fn(self)
        self.stage_write_elem = _stage_write_elem_fn(self)

    @property
    def count(self) -> int:
        """Edits staged and not yet applied (empty ones are not kept)."""
        return len(self._dst) + sum(len(b.dst) for b in self._batches)

    # --- staging ---

    def stage_checked(self, index: Any, start: Any, values: Any) -> None:
        """``stage_write`` for what its fast path does not take: row and range checked now."""
        row = int_in(index, "index", 0, self.rows, f"the target has {self.rows} rows")
        col = int_in(start, "start", 0, None, "")
        arr = (
            None
            if type(values) is list
            else checked_values(values, self.np_dtype, f"values (edit index={row}, start={col})")
        )
        n = len(values) if arr is None else arr.shape[0]
        if col + n > self.cols:
            raise InvalidArgumentError(
                f"edit (index={row}, start={col}, {n} values) ends at column {col + n}, "
                f"past the end of the row ({self.cols} columns)"
            )
        if not n:
            return
        if arr is None:
            self._dst.append(row * self.row_stride + col)
            self._lens.append(n)
            self._vals.extend(values)
            return
        self._seal()
        dst = np.array([row * self.row_stride + col], np.int64)
        self._batches.append(_StagedBatch(dst, np.array([n], np.int64), arr.copy(), True))

    def stage_elem_checked(self, index: Any, value: Any) -> None:
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
        self.stage_checked(index, 0, value)

    def stage_writes(self, rows: Any, starts: Any, values: Any, lengths: Any) -> None:
        """``StagedWriteTensor.stage_writes``: every edit of the batch checked now, with numpy."""
        if (
            lengths is None
            and type(rows) is np.ndarray
            and type(starts) is np.ndarray
            and type(values) is np.ndarray
            and values.dtype == self.np_dtype
            and rows.ndim == 1
            and rows.dtype.kind in "iu"
            and starts.dtype.kind in "iu"
            and values.ndim in (1, 2)
            and rows.shape[0] == starts.shape[0] == values.shape[0] > 0
        ):
            # the common case, checked with four reductions: typed arrays, every edit of one length
            e = rows.shape[0]
            width = 1 if values.ndim == 1 else values.shape[1]
            r0, r1, s0 = rows.min(), rows.max(), starts.min()
            if width and r0 >= 0 and r1 < self.rows and s0 >= 0 and starts.max() + width <= self.cols:
                dst = rows.astype(np.int64)
                dst *= self.row_stride
                dst += starts
                self.stage_batch(dst, self.full_lens(e, width), values.reshape(-1).copy())
                return
        self._stage_writes_checked(rows, starts, values, lengths)

    def _stage_writes_checked(self, rows: Any, starts: Any, values: Any, lengths: Any) -> None:
        r = _ints(rows, "rows")
        s = _ints(starts, "starts")
        e = r.shape[0]
        if s.shape[0] != e:
            raise InvalidArgumentError(
                f"starts has {s.shape[0]} entries but rows has {e}; allowed: one start per row"
            )
        ndims = (1, 2) if lengths is None else (1,)
        try:
            v = host_array(values, None, "values", ndims=ndims)
        except TypeError:  # e.g. uint64: converted to the target dtype with checks, or refused
            v = host_array(values, self.dtype, "values", ndims=ndims)
        if lengths is None:
            if v.shape[0] != e:
                raise InvalidArgumentError(
                    f"values has {v.shape[0]} rows but rows has {e}; allowed: one per edit"
                )
            lens = np.full(e, 1 if v.ndim == 1 else v.shape[1], np.int64)
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
        flat = v.reshape(-1)
        try:
            flat = checked_values(flat, self.np_dtype, "values")
        except ValueError as err:  # name the first edit whose values do not fit
            problem = why_unfit(flat, self.np_dtype) if flat.dtype.kind in "iuf" else None
            if problem is None:
                raise
            i = int(np.searchsorted(np.cumsum(lens), int(np.flatnonzero(problem[0])[0]), side="right"))
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
        self.stage_batch(r * self.row_stride + s, lens.copy(), np.array(flat, copy=True))

    def stage_batch(self, dst: np.ndarray, lens: np.ndarray, vals: np.ndarray) -> None:
        """Stage checked array edits (flat offsets, lengths, flat values: the caller's copies)."""
        if dst.shape[0]:
            self._seal()
            self._batches.append(_StagedBatch(dst, lens, vals, True))

    def full_lens(self, e: int, width: int) -> np.ndarray:
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
            self._batches.append(_StagedBatch(self._dst[:], self._lens[:], self._vals[:], False))
            self._dst.clear()
            self._lens.clear()
            self._vals.clear()

    def clear(self) -> None:
        self._dst.clear()
        self._lens.clear()
        self._vals.clear()
        self._batches.clear()

    # --- inspecting, dropping ---

    def _all_batches(self) -> list[_StagedBatch]:
        return [*self._batches, _StagedBatch(self._dst, self._lens, self._vals, False)]

    def pending(self) -> list[tuple[int, int, list[Any]]]:
        """The staged edits, in staging order: ``(index, start, values)``."""
        out: list[tuple[int, int, list[Any]]] = []
        for b in self._all_batches():
            vals = b.vals.tolist() if isinstance(b.vals, np.ndarray) else b.vals
            a = 0
            for d, n in zip(b.dst, b.lens):
                out.append((*divmod(int(d), self.row_stride), list(vals[a : a + int(n)])))
                a += int(n)
        return out

    def discard(self, positions: Iterable[Any]) -> None:
        """Drop the staged edits at ``positions`` (staging order, as ``pending()`` lists them)."""
        n = self.count
        try:
            drop = {operator.index(p) for p in positions}
        except TypeError:
            raise ArgumentTypeError(
                f"positions must be an iterable of ints (staged edits' positions); got {positions!r}"
            ) from None
        wrong = sorted(p for p in drop if not 0 <= p < n)
        if wrong:
            allowed = f"ints in [0, {n - 1}]" if n else "none: nothing is staged"
            raise InvalidArgumentError(f"positions holds {wrong[0]}; allowed: {allowed} (the staged edits)")
        if not drop:
            return
        self._seal()
        kept: list[_StagedBatch] = []
        pos = 0
        for b in self._batches:
            e = len(b.dst)
            keep = [i for i in range(e) if pos + i not in drop]
            pos += e
            if len(keep) == e:
                kept.append(b)
            elif keep and b.checked:
                mask = np.zeros(e, bool)
                mask[keep] = True
                kept.append(_StagedBatch(b.dst[mask], b.lens[mask], b.vals[np.repeat(mask, b.lens)], True))
            elif keep:
                first = np.cumsum([0, *b.lens]).tolist()
                vals = [v for i in keep for v in b.vals[first[i] : first[i + 1]]]
                kept.append(_StagedBatch([b.dst[i] for i in keep], [b.lens[i] for i in keep], vals, False))
        self._batches[:] = kept

    # --- gathering and checking ---

    def gather(self) -> CheckedEdits | None:
        """Every staged edit as checked arrays; raises StagedWriteError naming every bad edit.

        Nothing changes when it raises: every staged edit stays staged.
        """
        bad: Bad = []
        if not self._batches:  # the common case: list edits only
            if not self._dst:
                return None
            dl, ll = self._dst, self._lens
            e = len(dl)
            if e <= 32:  # a few edits: the overlap and length checks are cheaper in Python
                w = ll[0] if ll.count(ll[0]) == e else 0
                n = self.full_lens(e, w) if w else np.array(ll, np.int64)
                v = list_values(self._vals, dl, n, self.np_dtype, bad)
                if bad:
                    self._raise(bad)
                stride = self.row_stride
                dup = e > 1 and len({d // stride for d in dl} if stride != 1 else set(dl)) != e
                return CheckedEdits(self.target, np.array(dl, np.int64), n, v, dup, w)
            n = np.array(ll, np.int64)
            v = list_values(self._vals, dl, n, self.np_dtype, bad)
            if bad:
                self._raise(bad)
            return self._with_overlaps(np.array(dl, np.int64), n, v)
        batches = self._all_batches() if self._dst else [*self._batches]
        dsts, lens, vals = [], [], []
        pos = 0
        for b in batches:
            if b.checked:
                dsts.append(b.dst)
                lens.append(b.lens)
                vals.append(b.vals)
            else:
                lens_b = np.array(b.lens, np.int64)
                vals.append(list_values(b.vals, b.dst, lens_b, self.np_dtype, bad, pos))
                dsts.append(np.array(b.dst, np.int64))
                lens.append(lens_b)
            pos += len(b.dst)
        if bad:
            self._raise(bad)
        if len(batches) == 1:
            d, n, v = dsts[0], lens[0], vals[0]
        else:
            d, n, v = (np.concatenate(x) for x in (dsts, lens, vals))
        return self._with_overlaps(d, n, v)

    def _raise(self, bad: Bad) -> None:
        pos, flat, why = bad[0]
        row, start = divmod(flat, self.row_stride)
        more = (
            f"; {len(bad) - 1} more bad edit(s), at positions {[b[0] for b in bad[1:]][:8]}"
            if len(bad) > 1
            else ""
        )
        n = self._lens_at(pos)
        raise StagedWriteError(
            f"staged edit {pos} (stage_write(index={row}, start={start}, {n} values)) cannot be applied "
            f"to {self.dtype}: {why}{more}. Nothing was written and every staged edit is still staged: "
            "discard_staged(err.edits) drops the bad ones, clear_staged_writes() all",
            pos,
            row,
            start,
            edits=tuple(b[0] for b in bad),
            tensor=self.owner,
        )

    def _lens_at(self, pos: int) -> int:
        for b in self._all_batches():
            if pos < len(b.lens):
                return int(b.lens[pos])
            pos -= len(b.lens)
        return 0

    def _with_overlaps(self, d: np.ndarray, n: np.ndarray, v: np.ndarray) -> CheckedEdits:
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
        return CheckedEdits(self.target, d, n, v, dup)
