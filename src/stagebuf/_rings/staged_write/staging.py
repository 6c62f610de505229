"""Staging calls checked: what a ``stage_write`` the writer's fast path does not take, and every
``stage_writes`` batch, is checked here, with numpy, before it enters the target's ``EditLog``."""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..._common.convert import ARRAY_TYPECODES, host_array, why_unfit
from ..._common.errors import ArgumentTypeError, InvalidArgumentError
from ..._device.memory import ensure_host_room
from .launcher import EditLog, uniform_lens
from .values import checked_values

_CHUNK = 1 << 16
"""Elements per piece where ``stage_writes`` converts values or finds a bad edit piece by piece: no
temporary of a batch is larger than this."""


def _first(e: int, bad: Callable[[slice], np.ndarray]) -> int:
    """The first ``i`` in [0, e) where ``bad(piece)`` (a mask of that piece) is True, or -1."""
    for a in range(0, e, _CHUNK):
        m = bad(slice(a, a + _CHUNK))
        if m.any():
            return a + int(m.argmax())
    return -1


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
    """A 1-D array of the integers in ``x`` (bools and fractions are refused): an integer array as it is (no
    copy: uint64 viewed as int64, its values checked to fit), integral floats as int64."""
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
        return a.astype(np.int64)
    if a.dtype == np.uint64:
        if a.size and int(a.max()) > np.iinfo(np.int64).max:
            raise InvalidArgumentError(f"{name} holds values beyond int64")
        return a.view(np.int64)  # (exact: every value fits)
    return a


def stage_checked(log: EditLog, index: Any, start: Any, values: Any) -> None:
    """``stage_write`` for what its fast path does not take: row and range checked now."""
    row = int_in(index, "index", 0, log.rows, f"the target has {log.rows} rows")
    col = int_in(start, "start", 0, None, "")
    arr = None if type(values) is list else _exact(values, log.np_dtype)
    if arr is None and type(values) is not list:
        arr = checked_values(values, log.np_dtype, f"values (edit index={row}, start={col})")
    n = len(values) if arr is None else arr.shape[0]
    if col + n > log.cols:
        raise InvalidArgumentError(
            f"edit (index={row}, start={col}, {n} values) ends at column {col + n}, "
            f"past the end of the row ({log.cols} columns)"
        )
    if not n:
        return
    if arr is None:
        log.dst.append(row * log.row_stride + col)
        log.lens.append(n)
        log.vals.extend(values)
        return
    log.stage_batch(np.array([row * log.row_stride + col], np.int64), np.array([n], np.int64), arr.copy())


def _exact(values: Any, dtype: np.dtype) -> np.ndarray | None:
    """``values`` viewed as they are where nothing needs checking (a 1-D ndarray, or an ``array.array`` such
    as vLLM's ``TokenBuffer``, already of ``dtype``: a prompt's tokens); else None (``checked_values``)."""
    if type(values) is np.ndarray:
        a = values
    elif isinstance(values, array) and values.typecode in ARRAY_TYPECODES:
        a = np.frombuffer(values, values.typecode)
    else:
        return None
    return a if a.dtype == dtype and a.ndim == 1 else None


def stage_elem_checked(log: EditLog, index: Any, value: Any) -> None:
    """``stage_write_elem`` for what its fast path does not take: checked now."""
    if isinstance(value, (list, tuple)):
        raise InvalidArgumentError(f"value is a {type(value).__name__}; stage_write_elem takes one scalar")
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
            raise ArgumentTypeError(f"value={value!r} is a {type(value).__name__}; allowed: an int or float")
        value = np.array([value])
    stage_checked(log, index, 0, value)


def stage_writes(log: EditLog, rows: Any, starts: Any, values: Any, lengths: Any) -> None:
    """``StagedWriteTensor.stage_writes``: every edit of the batch checked now, with numpy.

    What it keeps is a copy of the values, the destinations (int64) and, for edits of several lengths, the
    lengths (int64); it checks the host can give those bytes before allocating them, and makes no other
    temporary larger than ``_CHUNK`` elements (the peak stays within 1.5 times the input arrays)."""
    if (
        lengths is None
        and type(rows) is np.ndarray
        and type(starts) is np.ndarray
        and type(values) is np.ndarray
        and values.dtype == log.np_dtype
        and rows.ndim == 1
        and starts.ndim == 1
        and rows.dtype.kind in "iu"
        and starts.dtype.kind in "iu"
        and values.ndim in (1, 2)
        and rows.shape[0] == starts.shape[0] == values.shape[0] > 0
    ):
        # the common case, checked with four reductions: typed arrays, every edit of one length
        e = rows.shape[0]
        width = 1 if values.ndim == 1 else values.shape[1]
        r0, r1, s0 = rows.min(), rows.max(), starts.min()
        # (Python ints: a start near int64's maximum plus the width must not wrap)
        if width and r0 >= 0 and r1 < log.rows and s0 >= 0 and int(starts.max()) + width <= log.cols:
            _room(log, e, values.size, False)
            log.stage_batch(_dst(log, rows, starts), uniform_lens(e, width)[0], values.flatten())
            return
    _stage_writes_checked(log, rows, starts, values, lengths)


def _room(log: EditLog, e: int, nvals: int, lens: bool) -> None:
    """Raise HostAllocationError, before anything is allocated or staged, unless the host can give what a
    batch of ``e`` edits and ``nvals`` values keeps (with a length per edit if ``lens``)."""
    nbytes = e * (16 if lens else 8) + nvals * log.np_dtype.itemsize
    ensure_host_room(
        nbytes,
        f"stage_writes of {e} edits ({nvals} values of {log.np_dtype}: a copy of them and an int64 "
        f"destination{' and length' if lens else ''} per edit)",
        fix="Nothing was staged by this call, and the edits staged before stay staged. Stage fewer edits "
        "per call (apply_write() between calls frees what is staged), or free host memory",
    )


def _dst(log: EditLog, r: np.ndarray, s: np.ndarray) -> np.ndarray:
    """``r * row_stride + s`` as a new int64 array, computed in place (no temporary); the caller has
    checked both (the result fits)."""
    dst = r.astype(np.int64)  # (a copy, even of int64: the log keeps its own)
    dst *= log.row_stride
    dst += s.view(np.int64) if s.dtype == np.uint64 else s  # (checked: at most cols)
    return dst


def _stage_writes_checked(log: EditLog, rows: Any, starts: Any, values: Any, lengths: Any) -> None:
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
        v = host_array(values, log.dtype, "values", ndims=ndims)
    # the lengths given, where they differ; else None, and every edit is ``width`` values long
    ln: np.ndarray | None = None
    if lengths is None:
        if v.shape[0] != e:
            raise InvalidArgumentError(
                f"values has {v.shape[0]} rows but rows has {e}; allowed: one per edit"
            )
        width = 1 if v.ndim == 1 else v.shape[1]
    else:
        ln = _ints(lengths, "lengths")
        if ln.shape[0] != e:
            raise InvalidArgumentError(
                f"lengths has {ln.shape[0]} entries but rows has {e}; allowed: one per edit"
            )
        if e and ln.min() < 0:
            lk = ln
            i = _first(e, lambda k: lk[k] < 0)
            raise InvalidArgumentError(f"lengths[{i}]={ln[i]} is negative; allowed: an int >= 0")
        total = int(ln.sum(dtype=np.int64)) if e else 0
        if v.shape[0] != total:
            raise InvalidArgumentError(f"values has {v.shape[0]} elements but lengths add up to {total}")
        width = int(ln[0]) if e and ln.min() == ln.max() else 0
        if width or not total:
            ln = None  # one length: stored as a broadcast (an empty batch keeps nothing)
    _room(log, e, v.size, ln is not None)
    vals = _values(log, v, r, s, ln, width)
    if e:
        if r.min() < 0 or r.max() >= log.rows:
            i = _first(e, lambda k: (r[k] < 0) | (r[k] >= log.rows))
            raise InvalidArgumentError(f"rows[{i}]={r[i]} is out of range; allowed: [0, {log.rows - 1}]")
        if s.min() < 0:
            i = _first(e, lambda k: s[k] < 0)
            raise InvalidArgumentError(f"starts[{i}]={s[i]} is negative; allowed: an int >= 0")
        # the ends, as s > cols - length (s + length may wrap past int64)
        if ln is None:
            i = -1 if int(s.max()) <= log.cols - width else _first(e, lambda k: s[k] > log.cols - width)
        else:
            lk = ln
            i = _first(e, lambda k: s[k] > log.cols - lk[k])
        if i >= 0:
            n = width if ln is None else int(ln[i])
            raise InvalidArgumentError(
                f"edit {i} (rows[{i}]={r[i]}, starts[{i}]={s[i]}, {n} values) ends at "
                f"column {int(s[i]) + n}, past the end of the row ({log.cols} columns)"
            )
    if not vals.size:
        return  # every edit is empty: nothing to stage
    dst = _dst(log, r, s)
    if ln is None:
        log.stage_batch(dst, uniform_lens(e, width)[0], vals)
        return
    lens = np.array(ln, np.int64)  # (a copy: the log keeps its own)
    if not lens.min():  # empty edits are not kept
        keep = lens > 0
        dst, lens = dst[keep], lens[keep]
    log.stage_batch(dst, lens, vals)


def _values(
    log: EditLog, v: np.ndarray, r: np.ndarray, s: np.ndarray, ln: np.ndarray | None, width: int
) -> np.ndarray:
    """The values of ``v`` as a new flat array of the target dtype, checked (``checked_values``) and
    converted piece by piece into it; a value that does not fit raises naming its edit."""
    out = np.empty(v.size, log.np_dtype)
    if not v.size:  # (still checked: its dtype may be refused)
        checked_values(v.reshape(-1), log.np_dtype, "values")
        return out
    per = 1 if v.ndim == 1 else v.shape[1]  # values per row of v
    step = max(1, _CHUNK // per)
    for a in range(0, v.shape[0], step):
        part = v[a : a + step].reshape(-1)  # (a piece: a copy, if any, is a piece's)
        try:
            out[a * per : a * per + part.shape[0]] = checked_values(part, log.np_dtype, "values")
        except ValueError as err:  # name the first edit whose values do not fit
            problem = why_unfit(part, log.np_dtype) if part.dtype.kind in "iuf" else None
            if problem is None:
                raise
            j = a * per + int(np.flatnonzero(problem[0])[0])  # its flat position
            if ln is None:
                i = j // width
            else:
                i = int(np.searchsorted(np.cumsum(ln, dtype=np.int64), j, side="right"))
            raise InvalidArgumentError(f"edit {i} (rows[{i}]={r[i]}, starts[{i}]={s[i]}): {err}") from None
    return out
