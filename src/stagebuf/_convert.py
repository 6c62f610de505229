"""Input checking and conversion shared by every public entry point.

One rule set for all of them: what host input is accepted (list, tuple, numpy
array, CPU tensor), how its dtype is chosen, and when a value cannot be
represented in the target dtype. Everything here raises *before* any buffer is
written, so a rejected call leaves staged data as it was.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from ._errors import ArgumentTypeError, InvalidArgumentError
from ._types import DTypeLike

_TORCH_TO_NUMPY: dict[torch.dtype, np.dtype] = {
    torch.bool: np.dtype(np.bool_),
    torch.uint8: np.dtype(np.uint8),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.float16: np.dtype(np.float16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
}
_NUMPY_TO_TORCH = {v: k for k, v in _TORCH_TO_NUMPY.items()}
SUPPORTED_DTYPES = tuple(_TORCH_TO_NUMPY)


def _names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def torch_dtype(dtype: DTypeLike, name: str = "dtype") -> torch.dtype:
    """A supported torch dtype from a torch dtype, numpy dtype or its name."""
    if isinstance(dtype, torch.dtype):
        if dtype in _TORCH_TO_NUMPY:
            return dtype
    elif dtype is not None:
        try:
            np_dt = np.dtype(dtype)
        except TypeError:
            np_dt = None
        if np_dt is not None and np_dt in _NUMPY_TO_TORCH:
            return _NUMPY_TO_TORCH[np_dt]
    raise ArgumentTypeError(f"{name}={dtype!r} is not supported; allowed: {_names(SUPPORTED_DTYPES)}")


def numpy_dtype(dtype: DTypeLike) -> np.dtype:
    return _TORCH_TO_NUMPY[torch_dtype(dtype)]


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
    """``x`` as a numpy array of ``dtype`` (or its own dtype), checked.

    Accepts a list or tuple, a numpy array or a CPU tensor (any iterable too when
    ``iterables``). Raises TypeError for an unsupported type or dtype and
    ValueError for a wrong rank, a wrong trailing shape, a tensor on another
    device, or values the target dtype cannot represent (fractions, NaN/inf or
    out-of-range values into an integer dtype; out-of-range finite values into a
    float dtype; bools into a numeric dtype).
    """
    if isinstance(x, np.ndarray):
        arr = x
    elif isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise InvalidArgumentError(
                f"{name} is a tensor on {x.device}; stagebuf stages host data: "
                f"pass a CPU tensor, numpy array or list"
            )
        if x.dtype not in _TORCH_TO_NUMPY:
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
        if arr.dtype not in _NUMPY_TO_TORCH:
            raise ArgumentTypeError(f"{name} has dtype {arr.dtype}; allowed: {_names(SUPPORTED_DTYPES)}")
        return arr
    return cast_checked(arr, numpy_dtype(dtype), name)


def _from_sequence(x: Sequence[Any], dtype: DTypeLike | None, name: str) -> np.ndarray:
    if len(x) == 0:
        return np.empty(0, dtype=numpy_dtype(dtype) if dtype is not None else np.int64)
    try:
        arr = np.asarray(x)
    except (ValueError, TypeError) as e:  # ragged nesting
        raise InvalidArgumentError(f"{name} is not a rectangular list of numbers: {e}") from None
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


def _has_bool(x: Sequence[Any]) -> bool:
    """Whether a (nested) list holds a Python or numpy bool (numpy turns them into numbers)."""
    for v in x:
        if isinstance(v, (bool, np.bool_)):
            return True
        if isinstance(v, (list, tuple)) and _has_bool(v):
            return True
    return False


def cast_checked(arr: np.ndarray, target: np.dtype, name: str) -> np.ndarray:
    """``arr`` as ``target``, raising ValueError where a value would change."""
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
    if arr.size and not np.can_cast(src, target, "safe"):
        if target.kind in "iu":
            if src.kind == "f":
                if not np.isfinite(arr).all():
                    raise InvalidArgumentError(
                        f"{name} holds NaN or inf; target dtype {target} is an integer"
                    )
                if (arr != np.trunc(arr)).any():
                    raise InvalidArgumentError(
                        f"{name} holds fractional values; target dtype {target} is an integer"
                    )
            info = np.iinfo(target)
            lo, hi = arr.min(), arr.max()
            if src.kind == "f":
                lo, hi = float(lo), float(hi)  # compare in float64: float16 cannot hold 2**31
                # float(info.max) rounds up to 2**(bits-1): compare against exact powers of two
                bad = lo < float(info.min) or hi >= float(info.max) + 1.0
            else:
                bad = int(lo) < info.min or int(hi) > info.max
            if bad:
                raise InvalidArgumentError(
                    f"{name} holds values in [{lo}, {hi}], outside {target}'s range [{info.min}, {info.max}]"
                )
        elif target.kind == "f":
            finfo = np.finfo(target)
            # integers through float64: np.abs of an integer minimum overflows to a negative value
            finite = arr[np.isfinite(arr)] if src.kind == "f" else arr.astype(np.float64)
            if finite.size and np.abs(finite).max() > finfo.max:
                raise InvalidArgumentError(
                    f"{name} holds finite values beyond {target}'s range (±{finfo.max})"
                )
    return arr.astype(target, copy=False)
