"""The log: the edits staged on one ``StagedWriteTensor``, in staging order, until an apply: list edits
unchecked (checked in bulk at apply), array edits checked when staged, with numpy."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from ..._common.convert import host_array, numpy_dtype, why_unfit
from ..._common.errors import ArgumentTypeError, InvalidArgumentError
from .values import checked_values

FULL_LENS: dict[tuple[int, int], np.ndarray] = {}


def full_lens(e: int, width: int) -> np.ndarray:
    """``np.full(e, width)`` (int64, read-only), cached in ``FULL_LENS`` by ``(e, width)``."""
    a = FULL_LENS.get((e, width))
    if a is None:
        if len(FULL_LENS) >= 256:
            FULL_LENS.clear()
        a = FULL_LENS[e, width] = np.full(e, width, np.int64)
        a.flags.writeable = False
    return a


NP_INTS = frozenset(np.dtype(c).type for c in "bBhHiIlLqQ")
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


class StagedBatch:
    """Edits staged by one ``stage_writes`` call (checked), or sealed list edits (values unchecked);
    ``dst`` is each edit's flat offset in the target (``row * row_stride + start``)."""

    __slots__ = ("dst", "lens", "vals", "checked")

    def __init__(self, dst: Any, lens: Any, vals: Any, checked: bool):
        self.dst, self.lens, self.vals, self.checked = dst, lens, vals, checked


class EditLog:
    """The edits staged on one target of ``rows`` x ``cols`` values of ``dtype``, in staging order: list
    edits in ``dst``, ``lens`` and ``vals`` (a ``stage_write`` appends to them), arrays in ``batches``."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype):
        self.rows, self.cols, self.row_stride = rows, cols, cols
        self.dtype = dtype
        self.np_dtype = numpy_dtype(dtype)
        self.dst: list[int] = []
        self.lens: list[int] = []
        self.vals: list[Any] = []
        self.batches: list[StagedBatch] = []
        self.mark: np.ndarray | None = None
        """A per-row marker array the check's overlap test reuses (made at its first use)."""

    @property
    def count(self) -> int:
        """Edits staged and not yet applied (empty ones are not kept)."""
        return len(self.dst) + sum(len(b.dst) for b in self.batches)

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
            self.dst.append(row * self.row_stride + col)
            self.lens.append(n)
            self.vals.extend(values)
            return
        self._seal()
        dst = np.array([row * self.row_stride + col], np.int64)
        self.batches.append(StagedBatch(dst, np.array([n], np.int64), arr.copy(), True))

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
                self.stage_batch(dst, full_lens(e, width), values.reshape(-1).copy())
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
            self.batches.append(StagedBatch(dst, lens, vals, True))

    def _seal(self) -> None:
        """Move the list-staged edits into a batch, so later batches keep staging order."""
        if self.dst:
            self.batches.append(StagedBatch(self.dst[:], self.lens[:], self.vals[:], False))
            self.dst.clear()
            self.lens.clear()
            self.vals.clear()

    def clear(self) -> None:
        self.dst.clear()
        self.lens.clear()
        self.vals.clear()
        self.batches.clear()

    # --- inspecting, dropping ---

    def all_batches(self) -> list[StagedBatch]:
        return [*self.batches, StagedBatch(self.dst, self.lens, self.vals, False)]

    def pending(self) -> list[tuple[int, int, list[Any]]]:
        """The staged edits, in staging order: ``(index, start, values)``."""
        out: list[tuple[int, int, list[Any]]] = []
        for b in self.all_batches():
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
        kept: list[StagedBatch] = []
        pos = 0
        for b in self.batches:
            e = len(b.dst)
            keep = [i for i in range(e) if pos + i not in drop]
            pos += e
            if len(keep) == e:
                kept.append(b)
            elif keep and b.checked:
                mask = np.zeros(e, bool)
                mask[keep] = True
                kept.append(StagedBatch(b.dst[mask], b.lens[mask], b.vals[np.repeat(mask, b.lens)], True))
            elif keep:
                first = np.cumsum([0, *b.lens]).tolist()
                vals = [v for i in keep for v in b.vals[first[i] : first[i + 1]]]
                kept.append(StagedBatch([b.dst[i] for i in keep], [b.lens[i] for i in keep], vals, False))
        self.batches[:] = kept

    def lens_at(self, pos: int) -> int:
        """The length of the staged edit at ``pos``."""
        for b in self.all_batches():
            if pos < len(b.lens):
                return int(b.lens[pos])
            pos -= len(b.lens)
        return 0
