"""The input rules of every public entry point: which host inputs, which dtypes, which values fit a dtype.
Everything here raises before any buffer is written, so a rejected call leaves staged data as it was."""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from .errors import ArgumentTypeError, InvalidArgumentError
from .types import DTypeLike

_NAMES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64")
TORCH_TO_NUMPY: dict[torch.dtype, np.dtype] = {getattr(torch, n): np.dtype(n) for n in _NAMES}
NUMPY_TO_TORCH = {v: k for k, v in TORCH_TO_NUMPY.items()}
SUPPORTED_DTYPES = tuple(TORCH_TO_NUMPY)


def _names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def torch_dtype(dtype: DTypeLike, name: str = "dtype") -> torch.dtype:
    """A supported torch dtype from a torch dtype, numpy dtype or its name."""
    if isinstance(dtype, torch.dtype):
        if dtype in TORCH_TO_NUMPY:
            return dtype
    elif dtype is not None:
        try:
            np_dt = np.dtype(dtype)
        except (TypeError, ValueError):  # (a tensor, say, raises ValueError)
            np_dt = None
        if np_dt is not None and np_dt in NUMPY_TO_TORCH:
            return NUMPY_TO_TORCH[np_dt]
    raise ArgumentTypeError(f"{name}={dtype!r} is not supported; allowed: {_names(SUPPORTED_DTYPES)}")


def numpy_dtype(dtype: DTypeLike) -> np.dtype:
    return TORCH_TO_NUMPY[torch_dtype(dtype)]


def shape_of(size: int | Sequence[int], name: str = "size") -> tuple[int, ...]:
    """A buffer shape from an int or a tuple of ints, each >= 0."""
    try:
        dims = (size,) if isinstance(size, (int, np.integer)) else tuple(size)
    except TypeError:
        dims = ()
    if not dims or any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0 for d in dims):
        raise InvalidArgumentError(f"{name}={size!r}: expected an int >= 0 or a tuple of such ints")
    return tuple(int(d) for d in dims)


def check_rows(n: int | None, rows: int, name: str = "n") -> int:
    """The row count to publish: all rows when None, else 0 <= n <= rows."""
    if n is None:
        return rows
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= rows:
        raise InvalidArgumentError(f"{name}={n!r} must be an int in [0, {rows}]")
    return int(n)


def host_array(
    x: Any,
    dtype: DTypeLike | None = None,
    name: str = "x",
    *,
    ndims: tuple[int, ...] = (1, 2),
    trailing: tuple[int, ...] | None = None,
    iterables: bool = False,
) -> np.ndarray:
    """``x`` (list, tuple, numpy array, ``array.array`` or a subclass such as vLLM's ``TokenBuffer``, CPU
    tensor; any iterable if ``iterables``) as an array of ``dtype`` (or its own), checked: TypeError for its
    type or dtype, ValueError for its shape, device or values. An ``array.array`` is read as one block (a
    view of its buffer: the caller copies what it keeps)."""
    if isinstance(x, np.ndarray):
        arr = x
    elif isinstance(x, array):
        arr = _from_array(x, name)
    elif isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise InvalidArgumentError(
                f"{name} is a tensor on {x.device}; stagebuf stages host data: "
                f"pass a CPU tensor, numpy array or list"
            )
        if x.dtype not in TORCH_TO_NUMPY:
            raise ArgumentTypeError(f"{name} has dtype {x.dtype}; allowed: {_names(SUPPORTED_DTYPES)}")
        arr = x.detach().numpy()
    elif isinstance(x, (list, tuple)):
        arr = _from_sequence(x, dtype, name)
    elif iterables and isinstance(x, Iterable) and not isinstance(x, (str, bytes, dict)):
        arr = _from_sequence(list(x), dtype, name)
    else:
        allowed = "list, tuple, numpy.ndarray, CPU torch.Tensor"
        if iterables:
            allowed += " or another iterable of numbers"
        raise ArgumentTypeError(f"{name} must be a {allowed}; got {type(x).__name__}")
    if trailing is not None and arr.ndim == 1 and arr.shape[0] == 0 and not isinstance(x, np.ndarray):
        arr = arr.reshape((0, *trailing))  # an empty list has no trailing shape of its own
    if arr.ndim not in ndims:
        allowed_r = ", ".join(map(str, ndims))
        raise InvalidArgumentError(
            f"{name} has rank {arr.ndim} (shape {arr.shape}); allowed ranks: {allowed_r}"
        )
    if trailing is not None and arr.shape[1:] != trailing and arr.shape[0] != 0:
        raise InvalidArgumentError(
            f"{name} has rows of shape {arr.shape[1:]}; the buffer's rows have shape {trailing}"
        )
    if dtype is None:
        if arr.dtype not in NUMPY_TO_TORCH:
            raise ArgumentTypeError(f"{name} has dtype {arr.dtype}; allowed: {_names(SUPPORTED_DTYPES)}")
        return arr
    return cast_checked(arr, numpy_dtype(dtype), name)


def fill_host(dst: np.ndarray, value: Any, dtype: torch.dtype, name: str) -> None:
    """``dst[...] = value`` (``dst``'s shape, or one scalar), checked first by ``host_array``'s rules."""
    if isinstance(value, (bool, int, float, np.generic)):
        value = np.asarray(value)
    arr = host_array(value, dtype, name, ndims=(0, dst.ndim))
    if arr.ndim and arr.shape != dst.shape:
        raise InvalidArgumentError(
            f"{name}: a value of shape {arr.shape} was given; expected shape {dst.shape} "
            "(or one scalar for every element)"
        )
    np.copyto(dst, arr)


ARRAY_TYPECODES = "bBhHiIlLqQfd"
"""``array.array`` typecodes read as numbers (``u``/``w``, characters, are refused)."""


def _from_array(x: array[Any], name: str) -> np.ndarray:
    """An ``array.array`` as a 1-D numpy view of its buffer, in the array's own C type."""
    if x.typecode not in ARRAY_TYPECODES:
        raise ArgumentTypeError(
            f"{name} is an array.array of typecode {x.typecode!r}; "
            f"allowed typecodes: {', '.join(ARRAY_TYPECODES)}"
        )
    return np.frombuffer(x, np.dtype(x.typecode))


def _from_sequence(x: Sequence[Any], dtype: DTypeLike | None, name: str) -> np.ndarray:
    if len(x) == 0:
        return np.empty(0, dtype=numpy_dtype(dtype) if dtype is not None else np.int64)
    try:
        arr = np.asarray(x)
    except (ValueError, TypeError) as e:  # ragged nesting
        raise InvalidArgumentError(f"{name} is not a rectangular list of numbers: {e}") from None
    if (arr.dtype == np.uint64 and dtype is None) or (arr.dtype.kind == "f" and _all_ints(x)):
        arr = arr.astype(object)  # numpy's reading of ints past int64 (uint64, or rounded to float64)
    if arr.dtype.kind == "O" and _all_ints(x):  # an int past 64 bits: numpy gives up on the list
        items = [int(v) for v in _flat_items(x)]
        if dtype is not None and numpy_dtype(dtype).kind == "f":
            _big_ints_fit(items, numpy_dtype(dtype), name)
            return np.asarray(x, dtype=np.float64)  # exact: checked above
        info = np.iinfo(numpy_dtype(dtype) if dtype is not None else np.int64)
        raise InvalidArgumentError(
            f"{name} holds values in [{min(items)}, {max(items)}], outside {info.dtype}'s range "
            f"[{info.min}, {info.max}]"
        )
    if arr.dtype.kind not in "biuf":
        raise ArgumentTypeError(
            f"{name} holds elements numpy reads as {arr.dtype} (mixed or non-numeric types); "
            "allowed: bool, int or float elements"
        )
    if arr.dtype.kind != "b" and _has_bool(x):
        raise ArgumentTypeError(
            f"{name} mixes bools with numbers; allowed: all bool, or all int/float elements"
        )
    return arr


def _big_ints_fit(items: list[int], target: np.dtype, name: str) -> None:
    """Raise unless every Python int of ``items`` (some past 64 bits) is exactly a ``target`` float."""
    for v in items:
        try:
            f = float(v)
        except OverflowError:
            f = float("inf")
        y = float(np.float64(f).astype(target))
        if y in (float("inf"), float("-inf")):
            raise InvalidArgumentError(
                f"{name} holds finite values beyond {target}'s range (±{np.finfo(target).max})"
            )
        if int(y) != v:
            raise InvalidArgumentError(
                f"{name} holds integers {target} cannot hold exactly ({v} would become {int(y)})"
            )


def _flat_items(x: Sequence[Any]) -> list[Any]:
    out: list[Any] = []
    for v in x:
        if isinstance(v, (list, tuple)):
            out.extend(_flat_items(v))
        else:
            out.append(v)
    return out


def _all_ints(x: Sequence[Any]) -> bool:
    """Whether a (nested) list holds only Python/numpy ints (not bools)."""
    return all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in _flat_items(x))


def _has_bool(x: Sequence[Any]) -> bool:
    """Whether a (nested) list holds a Python or numpy bool (numpy turns them into numbers)."""
    for v in x:
        if isinstance(v, (bool, np.bool_)):
            return True
        if isinstance(v, (list, tuple)) and _has_bool(v):
            return True
    return False


def why_unfit(a: np.ndarray, target: np.dtype) -> tuple[np.ndarray, str] | None:
    """The one rule for numbers (kinds ``iuf``) into ``target``: None when every value of ``a`` fits exactly,
    else a mask of those that do not and the first reason: ``"NaN or inf"``, ``"fractional"`` or ``"range"``
    (into an integer dtype), ``"beyond"`` (past a float dtype's largest finite value), ``"inexact"`` (an
    integer the float dtype would round: 16777217 into float32). A float rounded to a narrower float is a
    float's rounding, not refused."""
    if not a.size or a.dtype == target:
        return None
    if np.can_cast(a.dtype, target, "safe") and not (a.dtype.kind in "iu" and target.kind == "f"):
        return None  # (numpy calls int64 into float64 safe: it rounds past 2**53)
    if target.kind == "f":
        if a.dtype.kind in "iu":
            return _ints_unfit(a, target)
        a64 = a.astype(np.float64, copy=False)  # an integer minimum's abs overflows in its own dtype
        bad = np.isfinite(a64) & (np.abs(a64) > np.finfo(target).max)
        return (bad, "beyond") if bad.any() else None
    info = np.iinfo(target)
    if a.dtype.kind == "f":
        a64 = a.astype(np.float64, copy=False)  # float16 cannot hold 2**31: compare in float64
        nonfinite = ~np.isfinite(a64)
        frac = ~nonfinite & (a64 != np.trunc(a64))
        # float(info.max) rounds up to 2**(bits-1): compare against exact powers of two
        out = (a64 < float(info.min)) | (a64 >= float(info.max) + 1.0)
        bad = nonfinite | frac | out
        if not bad.any():
            return None
        return bad, "NaN or inf" if nonfinite.any() else "fractional" if frac.any() else "range"
    if int(a.min()) >= info.min and int(a.max()) <= info.max:
        return None
    bad = (a > info.max) if a.dtype.kind == "u" else (a < info.min) | (a > info.max)
    return bad, "range"


def exact_int_bound(target: np.dtype) -> int:
    """The largest ``n`` such that every integer in [-n, n] is exactly a ``target`` float (2**24 for
    float32, 2**11 for float16, 2**53 for float64); past it, only some are."""
    return int(2 ** (int(np.finfo(target).nmant) + 1))


def _ints_unfit(a: np.ndarray, target: np.dtype) -> tuple[np.ndarray, str] | None:
    """``why_unfit`` for integers into a float ``target``: those it would round (``"inexact"``: 16777217
    into float32) or overflow to inf (``"beyond"``)."""
    bound = exact_int_bound(target)
    if -bound <= int(a.min()) and int(a.max()) <= bound:
        return None  # every integer of the range is exact (the common case: two reductions)
    big = a > bound if a.dtype.kind == "u" else (a > bound) | (a < -bound)
    sub = a[big]
    with np.errstate(over="ignore"):
        y = sub.astype(target).astype(np.float64)  # exact: a float32/16 is a float64
    if not np.isfinite(y).all():
        bad = np.zeros(a.shape, bool)
        bad[big] = ~np.isfinite(y)
        return bad, "beyond"
    info = np.iinfo(a.dtype)  # a value rounded past the source's range is not exact (nor castable back)
    fits = (y < float(info.max) + 1.0) & (y >= float(info.min))
    fits[fits] = y[fits].astype(a.dtype) == sub[fits]  # (y is whole past the bound: the cast is exact)
    if fits.all():
        return None
    bad = np.zeros(a.shape, bool)
    bad[big] = ~fits
    return bad, "inexact"


def exact_ints(vals: Sequence[Any], target: np.dtype) -> np.ndarray | None:
    """Ints and whole floats as integer ``target``, exactly (float64 would round ints past 2**53), by
    ``why_unfit``'s rule; None if one is not a number, not whole, not finite or out of range."""
    info = np.iinfo(target)
    out = []
    for v in vals:
        if isinstance(v, (float, np.floating)):
            if v != v or v in (float("inf"), float("-inf")) or v != int(v):
                return None
        elif not isinstance(v, (int, np.integer)):  # (a bool is 0 or 1, as numpy reads it among numbers)
            return None
        v = int(v)
        if not info.min <= v <= info.max:
            return None
        out.append(v)
    return np.array(out, target)


def cast_checked(arr: np.ndarray, target: np.dtype, name: str) -> np.ndarray:
    """``arr`` as ``target``, raising ValueError where a value would change (``why_unfit``'s rule)."""
    src = arr.dtype
    if src == target:
        return arr
    if src.kind not in "biuf":
        raise ArgumentTypeError(f"{name} has dtype {src}; allowed: {_names(SUPPORTED_DTYPES)}")
    if (src.kind == "b") != (target.kind == "b"):
        raise ArgumentTypeError(
            f"{name} has dtype {src} but the target dtype is {target}; "
            "bools and numbers are not converted into each other"
        )
    problem = why_unfit(arr, target) if src.kind != "b" else None
    if problem is not None:
        _, why = problem
        if why == "NaN or inf":
            raise InvalidArgumentError(f"{name} holds NaN or inf; target dtype {target} is an integer")
        if why == "fractional":
            raise InvalidArgumentError(f"{name} holds fractional values; target dtype {target} is an integer")
        if why == "inexact":
            v = int(arr[problem[0]][0])
            raise InvalidArgumentError(
                f"{name} holds integers {target} cannot hold exactly ({v} would become "
                f"{int(np.asarray(v).astype(target).astype(np.float64))}); allowed: integers within "
                f"±{exact_int_bound(target)} (2**{int(np.finfo(target).nmant) + 1}), or an integer dtype"
            )
        if why == "beyond":
            raise InvalidArgumentError(
                f"{name} holds finite values beyond {target}'s range (±{np.finfo(target).max})"
            )
        info = np.iinfo(target)
        lo, hi = arr.min(), arr.max()
        raise InvalidArgumentError(
            f"{name} holds values in [{lo}, {hi}], outside {target}'s range [{info.min}, {info.max}]"
        )
    return arr.astype(target, copy=False)
