"""Staged values into the target dtype by ``convert``'s one rule: arrays when staged (``checked_values``),
lists at apply where the check's one-pass reading does not settle them (``list_values``)."""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from ..._common.convert import (
    NUMPY_TO_TORCH,
    cast_checked,
    exact_int_bound,
    exact_ints,
    host_array,
    why_unfit,
)

Bad = list[tuple[int, int, str]]
"""Bad list edits found by ``list_values``: (edit number, its flat offset, why)."""


def checked_values(values: Any, target: np.dtype, name: str) -> np.ndarray:
    """``values`` as a 1-D array of ``target``; raises (a StagebufError) if a value would change."""
    dtype: torch.dtype = NUMPY_TO_TORCH[target]
    if target.kind == "f":  # a float target: convert's checks are exact
        return host_array(values, dtype, name, ndims=(1,), iterables=True)
    eager = (list, tuple, np.ndarray, torch.Tensor, array, str, bytes, dict)
    if not isinstance(values, eager) and isinstance(values, Iterable):
        values = list(values)  # read a one-shot iterable once
    try:
        arr = host_array(values, None, name, ndims=(1,), iterables=True)
    except (TypeError, ValueError):  # e.g. uint64, or ints past 64 bits: the target's own check says why
        return host_array(values, dtype, name, ndims=(1,), iterables=True)
    return cast_checked(arr, target, name)


def list_values(
    vals: list[Any],
    dst: Any,
    lens: np.ndarray,
    target: np.dtype,
    bad: Bad,
    pos: int = 0,
    width: int = 0,
    read: np.ndarray | None = None,
    extremes: tuple[Any, Any] | None = None,
) -> np.ndarray:
    """The values of list-staged edits (``lens[k]`` values each, edit ``k`` at flat offset ``dst[k]``) as
    ``target``, checked in bulk.

    Where the one array of the batch cannot be trusted per edit (not numeric, a value does not fit, an
    edit may be all bools, or int64 values may have gone through float64), each edit is read on its own
    and each bad one added to ``bad`` as ``(pos + k, flat offset, why)`` (its values zeros in the unused
    result). ``width`` as for ``WriteBatch``; ``read``: ``vals`` already read as int64, if the caller did, and
    ``extremes`` their least and greatest values, if it found them.
    """
    a = read
    if a is None and target.kind in "iu":  # ints read exactly, or refused (floats, strings, past 64 bits)
        try:
            a = np.frombuffer(array("q", vals), np.int64)
        except (TypeError, OverflowError):
            a = None
    if a is None:
        try:
            a = np.array(vals)
        except (ValueError, TypeError, OverflowError):
            a = None
    fits = bools = False  # the whole batch fits; an edit may still be all bools
    if a is not None and a.ndim == 1 and a.dtype.kind in "iu" and a.size:
        # one range check; Python's min/max beat numpy's on short lists
        if extremes is not None:
            lo, hi = extremes
        else:
            lo, hi = (min(vals), max(vals)) if len(vals) <= 128 else (a.min(), a.max())
        r = INT_RANGES.get(target) or _EXACT_INTS[target]
        fits = r[0] <= lo and hi <= r[1]
        bools = fits and lo <= 1 and hi >= 0
    elif a is not None and a.ndim == 1 and a.dtype.kind == "f":
        fits = not _inexact(a, target) and why_unfit(a, target) is None
        bools = fits and a.size > 0
    if bools:
        assert a is not None
        # numpy reads bools mixed with numbers as numbers: an edit whose values are all 0 or 1 may
        # be all bools. On a short list the type scan is the cheaper test and settles most cases.
        short = len(vals) <= 256
        if short and bool not in (types := set(map(type, vals))) and np.bool_ not in types:
            bools = False
        elif lens.shape[0] == 1 and a.dtype.kind in "iu" and not 0 <= lo <= hi <= 1:
            bools = False  # one edit (a prompt): its extremes are the batch's, and one is not 0 or 1
        else:
            if width == 1:  # one value per edit: its extremes are its value
                lo_e = hi_e = a
            else:  # (reduceat: several times faster than min/max along rows of an (edits, width) view)
                first = np.arange(0, a.shape[0], width, dtype=np.int64) if width else np.cumsum(lens) - lens
                lo_e, hi_e = np.minimum.reduceat(a, first), np.maximum.reduceat(a, first)
            cand = np.flatnonzero((lo_e >= 0) & (hi_e <= 1))
            if not cand.size:
                bools = False
            elif not short:  # the types of the candidate edits' values (a few: those alone)
                scan = vals
                if 4 * cand.size < lens.shape[0]:
                    at = (cand if width == 1 else first[cand]).tolist()
                    scan = [v for f, n in zip(at, lens[cand].tolist()) for v in vals[f : f + n]]
                types = set(map(type, scan))
                bools = bool in types or np.bool_ in types
    if fits and not bools:
        assert a is not None
        return a.astype(target, copy=False)
    out = []
    a0 = 0
    for k, n in enumerate(lens.tolist()):
        got, why = _edit_values(vals[a0 : a0 + n], target)
        if got is None:
            bad.append((pos + k, int(dst[k]), why))
            got = np.zeros(n, target)
        out.append(got)
        a0 += n
    return np.concatenate(out) if out else np.zeros(0, target)


INT_RANGES: dict[np.dtype, tuple[int, int]] = {
    np.dtype(t): (int(np.iinfo(t).min), int(np.iinfo(t).max))
    for t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)
}
"""Every integer target's range."""
_EXACT_INTS: dict[np.dtype, tuple[int, int]] = {
    np.dtype(t): (-exact_int_bound(np.dtype(t)), exact_int_bound(np.dtype(t)))
    for t in (np.float16, np.float32, np.float64)
}
"""Per float target: the integers it holds exactly, all of them (past these, ``why_unfit`` decides)."""


def _inexact(a: np.ndarray, target: np.dtype) -> bool:
    """Whether ints may have been rounded reading a list into ``a`` (ints mixed with floats)."""
    return target.kind in "iu" and a.dtype.kind == "f" and bool((np.abs(a) >= 2.0**53).any())


def _edit_values(vals: list[Any], target: np.dtype) -> tuple[np.ndarray | None, str]:
    """One list edit's values as ``target``, or None and why not."""
    try:
        a = np.array(vals)
    except (ValueError, TypeError, OverflowError):
        a = None
    if a is not None and a.ndim == 1 and a.dtype.kind in "iuf":
        if _inexact(a, target):
            got = exact_ints(vals, target)
        else:
            got = None if why_unfit(a, target) is not None else a.astype(target, copy=False)
        if got is not None:
            return got, ""
    elif a is not None and a.ndim == 1 and a.dtype.kind == "b":
        return None, "values are bools; allowed: int or float values"
    try:  # the strict check says what is wrong with this edit
        checked_values(list(vals), target, "values")
        why = "values do not fit the target dtype"
    except (ValueError, TypeError) as e:
        why = str(e)
    return None, why
