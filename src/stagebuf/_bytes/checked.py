"""Check mode's ``.np``: a numpy view (the same memory) whose writes raise InvalidArgumentError (or
ArgumentTypeError) before anything is written when a value does not fit the dtype exactly, by
``_common.convert``'s one rule, where numpy would cast (``a[2] = 1.7`` into int32 stores 1): ``a[key] = v``,
``a.fill(v)``, ufuncs into it (``out=a``, ``a += v``, ``np.add.at``), ``np.copyto``, ``np.put``,
``np.place``, ``np.putmask``, any numpy function given ``out=a``, on slices too. Not seen: C methods of
another array writing into it (``x.cumsum(out=a)``) and writes through ``.cpu``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .._common.convert import cast_checked, exact_int_bound, host_array
from .._common.errors import InvalidArgumentError
from .._tiers.settings import check_mode

_VALUES_AT: dict[Any, int] = {np.copyto: 1, np.put: 2, np.place: 2, np.putmask: 2}
"""numpy functions writing into their first argument -> the position of their values argument."""


def _name(a: np.ndarray) -> str:
    x: Any = a
    while x is not None:
        n = getattr(x, "__dict__", {}).get("_sb_name")
        if n is not None:
            return str(n)
        x = getattr(x, "base", None)  # a slice: its name is its base's
    return ".np"


def _key(key: Any) -> str:
    if isinstance(key, tuple):
        return ", ".join(_key(k) for k in key)
    if isinstance(key, slice):
        parts = ["" if v is None else str(v) for v in (key.start, key.stop, key.step)]
        return ":".join(parts).rstrip(":") if key.step is None else ":".join(parts)
    if key is Ellipsis:
        return "..."
    if isinstance(key, np.ndarray):
        return f"<{key.dtype} index array>"
    return repr(key)


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else f"<{type(v).__name__}>"


def _fit(dst: np.ndarray, value: Any, where: str) -> Any:
    """``value``, checked to fit ``dst``'s dtype exactly (raises before anything is written)."""
    target = dst.dtype
    if type(value) is np.ndarray or isinstance(value, np.generic):
        if value.dtype == target:
            return value
    elif isinstance(value, int) and not isinstance(value, bool):
        if target.kind in "iu":
            info = np.iinfo(target)
            if info.min <= value <= info.max:
                return value
            raise InvalidArgumentError(
                f"{where} holds values in [{value}, {value}], outside {target}'s range "
                f"[{info.min}, {info.max}]"
            )
        if target.kind == "f" and abs(value) <= exact_int_bound(target):
            return value  # every integer this small is exact in the float dtype
    arr = np.asarray(value.view(np.ndarray) if isinstance(value, CheckedArray) else value)
    if arr.dtype == object:  # an int past 64 bits, or not a number at all
        arr = host_array(
            value if isinstance(value, (list, tuple)) else [value], target, where, ndims=(1, 2, 3)
        )
    return cast_checked(arr, target, where)


def _wide(*dtypes: Any) -> np.dtype:
    """A dtype holding numpy's result from ``dtypes`` unwrapped (Python numbers as 64-bit, for NEP 50)."""
    dt = np.result_type(*(np.asarray(d) if isinstance(d, (int, float)) else d for d in dtypes))
    if dt.kind == "b":
        return dt
    if dt.kind == "u" and dt.itemsize == 8:
        return np.dtype(np.uint64)
    return np.dtype(np.int64) if dt.kind in "iu" else np.dtype(np.float64)


def _plain(x: Any) -> Any:
    return x.view(np.ndarray) if isinstance(x, CheckedArray) else x


def _put(dst: CheckedArray, values: Any, what: str) -> None:
    """``dst[...] = values`` (already computed in a wide dtype), checked."""
    np.copyto(dst.view(np.ndarray), _fit(dst, values, f"{_name(dst)}: {what}"), casting="unsafe")


class CheckedArray(np.ndarray):
    """A numpy view whose writes are checked (see the module docstring)."""

    def __setitem__(self, key: Any, value: Any) -> None:
        if not (type(value) is np.ndarray and value.dtype == self.dtype):  # the engine's usual write
            value = _fit(self, value, f"{_name(self)}[{_key(key)}] = {_short(value)}:")
        super().__setitem__(key, value)

    def fill(self, value: Any) -> None:
        super().fill(_fit(self, value, f"{_name(self)}.fill({_short(value)}):"))

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        plain = tuple(_plain(x) for x in inputs)
        if method == "at":  # in place on inputs[0]
            dst = inputs[0]
            if not isinstance(dst, CheckedArray):
                return ufunc.at(*plain, **kwargs)
            wide = np.array(plain[0], dtype=_wide(*plain[:1], *plain[2:]))
            ufunc.at(wide, *plain[1:], **kwargs)
            _put(dst, wide, f"np.{ufunc.__name__}.at")
            return None
        outs = kwargs.get("out")
        if outs is None or not any(isinstance(o, CheckedArray) for o in outs):
            if outs is not None:
                kwargs["out"] = tuple(_plain(o) for o in outs)
            return getattr(ufunc, method)(*plain, **kwargs)
        # into copies in dtypes that hold the exact results, checked, then into the real outputs
        temps = [
            None
            if o is None
            else np.array(_plain(o), dtype=o.dtype if o.dtype.kind == "b" else _wide(*plain, o))
            for o in outs
        ]
        kwargs["out"] = tuple(temps)
        getattr(ufunc, method)(*plain, **kwargs)
        for o, t in zip(outs, temps):
            if isinstance(o, CheckedArray):
                _put(o, t, f"np.{ufunc.__name__}(..., out=)")
            elif o is not None and t is not None:
                np.copyto(o, t, casting="unsafe")
        return outs[0] if len(outs) == 1 else outs

    def __array_function__(self, func: Callable[..., Any], types: Any, args: Any, kwargs: Any) -> Any:
        if func in _VALUES_AT and args and isinstance(args[0], CheckedArray):
            dst, at, args = args[0], _VALUES_AT[func], list(args)
            what = f"{_name(dst)}: np.{func.__name__}"
            if len(args) > at:
                args[at] = _fit(dst, _plain(args[at]), what)
            for k in ("src", "values", "vals", "v"):
                if k in kwargs:
                    kwargs = {**kwargs, k: _fit(dst, _plain(kwargs[k]), what)}
            args[0] = dst.view(np.ndarray)
            return func(*args, **kwargs)
        out = kwargs.get("out")
        if isinstance(out, CheckedArray):
            result = func(*[_plain(a) for a in args], **{**kwargs, "out": None})
            _put(out, np.asarray(result), f"np.{func.__name__}(..., out=)")
            return out
        return super().__array_function__(func, types, args, kwargs)


def checked_view(a: np.ndarray, name: str) -> CheckedArray:
    """A checked view of ``a`` (the same memory); ``name`` is how errors call it: ``table['top_k'].np``."""
    v = a.view(CheckedArray)
    v._sb_name = name  # type: ignore[attr-defined]
    return v


def host_view(cpu: torch.Tensor, name: str) -> np.ndarray:
    """``cpu.numpy()``, or in check mode (read now) a :class:`CheckedArray` named ``name``."""
    a = cpu.numpy()
    return checked_view(a, name) if check_mode() else a
