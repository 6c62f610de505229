"""``.np`` element writes: plain numpy in plain mode, checked in check mode (``STAGEBUF_CHECK=1``).

numpy casts on assignment (``a[2] = 1.7`` into int32 stores 1). In check mode the ``.np`` of a
param-table field, a backed tensor and a buffer refuses such a write before anything is written, so the
value never reaches the device; in plain mode ``.np`` is the plain ndarray (no cost on the engine's
per-step writes), with numpy's rules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import stagebuf
from helpers import read_back
from stagebuf import ArgumentTypeError, InvalidArgumentError


@pytest.fixture
def check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAGEBUF_CHECK", "1")
    stagebuf.reset_capabilities()


def _table() -> stagebuf.DeviceParamTable:
    return stagebuf.DeviceParamTable(
        4, {"temperature": torch.float32, "top_k": torch.int32, "small": torch.uint8, "half": torch.float16}
    )


BAD: list[tuple[str, str, Callable[[np.ndarray], Any], str]] = [
    ("top_k", "a fraction", lambda a: a.__setitem__(2, 1.7), "fractional"),
    ("top_k", "NaN", lambda a: a.__setitem__(2, float("nan")), "NaN or inf"),
    ("top_k", "a numpy NaN", lambda a: a.__setitem__(1, np.float32("nan")), "NaN or inf"),
    ("top_k", "inf", lambda a: a.__setitem__(0, np.inf), "NaN or inf"),
    ("small", "np.int64(300) into uint8", lambda a: a.__setitem__(1, np.int64(300)), "outside uint8's range"),
    ("small", "-1 into uint8", lambda a: a.__setitem__(1, -1), "outside uint8's range"),
    ("top_k", "2**40 into int32", lambda a: a.__setitem__(0, 2**40), "outside int32's range"),
    ("top_k", "2**70 into int32", lambda a: a.__setitem__(0, 2**70), "outside int32's range"),
    ("temperature", "1e300 into float32", lambda a: a.__setitem__(0, 1e300), "beyond float32's range"),
    ("half", "70000 into float16", lambda a: a.__setitem__(3, 70000), "beyond float16's range"),
    ("top_k", "a list with a fraction", lambda a: a.__setitem__(slice(0, 2), [1, 2.5]), "fractional"),
    (
        "top_k",
        "an array with a fraction",
        lambda a: a.__setitem__(slice(None), np.array([1, 2, 3, 4.5])),
        "fractional",
    ),
    ("top_k", "into a slice of .np", lambda a: a[1:3].__setitem__(0, 2.5), "fractional"),
    ("top_k", "a bool into an int", lambda a: a.__setitem__(0, True), "bools and numbers"),
    ("top_k", "fill", lambda a: a.fill(0.5), "fractional"),
    ("top_k", "+= a fraction", lambda a: a.__iadd__(1.5), "fractional"),
    ("top_k", "ufunc out=", lambda a: np.multiply(np.ones(4), 0.5, out=a), "fractional"),
    ("small", "ufunc past the range", lambda a: np.add(a, np.int64(256), out=a), "outside uint8's range"),
    ("small", "np.add.at", lambda a: np.add.at(a, [0, 0], np.uint8(200)), "outside uint8's range"),
    ("small", "np.copyto", lambda a: np.copyto(a, np.array([1, 2, 3, 300])), "outside uint8's range"),
    ("top_k", "np.put", lambda a: np.put(a, [0], [0.5]), "fractional"),
    ("top_k", "np.putmask", lambda a: np.putmask(a, np.ones(4, bool), 2.5), "fractional"),
    ("top_k", "np.cumsum(out=)", lambda a: np.cumsum(np.array([0.5, 1, 1, 1]), out=a), "fractional"),
]


@pytest.mark.parametrize("field, what, write, text", BAD, ids=[b[1] for b in BAD])
def test_a_write_the_dtype_cannot_hold_is_refused_in_check_mode(cpu_tier, check, field, what, write, text):
    table = _table()
    table[field].np[...] = 7
    assert table.sync()
    before = table[field].np.copy()
    with pytest.raises((InvalidArgumentError, ArgumentTypeError), match=text) as e:
        write(table[field].np)
    assert f"table[{field!r}].np" in str(e.value)
    np.testing.assert_array_equal(table[field].np, before)  # nothing was written
    assert not table.sync()  # so nothing reaches the device
    np.testing.assert_array_equal(read_back(table[field].gpu), before)


GOOD: list[tuple[str, Callable[[np.ndarray], Any], list[Any]]] = [
    ("top_k", lambda a: a.__setitem__(2, 50), [0, 0, 50, 0]),
    ("top_k", lambda a: a.__setitem__(2, 50.0), [0, 0, 50, 0]),
    ("top_k", lambda a: a.__setitem__(slice(None), np.arange(4, dtype=np.int64)), [0, 1, 2, 3]),
    ("top_k", lambda a: np.cumsum(np.array([1, 2, 3, 4]), out=a), [1, 3, 6, 10]),
    ("top_k", lambda a: a.__iadd__(3), [3, 3, 3, 3]),
    ("small", lambda a: np.copyto(a, np.array([1, 2, 3, 255])), [1, 2, 3, 255]),
    ("temperature", lambda a: a.__setitem__(1, 0.1), [0.0, np.float32(0.1), 0.0, 0.0]),
    ("temperature", lambda a: a.__setitem__(1, np.inf), [0.0, np.inf, 0.0, 0.0]),
]


@pytest.mark.parametrize("field, write, want", GOOD)
def test_a_write_that_fits_goes_through_in_check_mode(cpu_tier, check, field, write, want):
    table = _table()
    write(table[field].np)
    assert table.sync()
    np.testing.assert_array_equal(read_back(table[field].gpu), np.array(want, table[field].np.dtype))


def test_backed_tensors_and_buffers_check_too(cpu_tier, check):
    backed = stagebuf.UvaBackedTensor(4, torch.int32)
    backed.np[:3] = [5, 9, 2]
    with pytest.raises(InvalidArgumentError, match=r"UvaBackedTensor\.np\[0\] = 2\.9: holds fractional"):
        backed.np[0] = 2.9
    assert read_back(backed.copy_to_uva(3)).tolist() == [5, 9, 2]
    buf = stagebuf.make_buffer(4, torch.int64)
    with pytest.raises(InvalidArgumentError, match=r"\.np\[1\] = 0\.5: holds fractional"):
        buf.np[1] = 0.5
    buf.np[:2] = [1, 2]
    assert read_back(buf.uva(2)).tolist() == [1, 2]


def test_plain_mode_keeps_the_plain_ndarray(cpu_tier, monkeypatch):
    """No check, no cost: numpy's own rules (the documented rule: check mode is what refuses casts)."""
    monkeypatch.delenv("STAGEBUF_CHECK", raising=False)
    table = _table()
    backed = stagebuf.UvaBackedTensor(4, torch.int32)
    buf = stagebuf.make_buffer(4, torch.int32)
    for a in (table["top_k"].np, backed.np, buf.np):
        assert type(a) is np.ndarray
        a[0] = 1.7  # numpy truncates
        assert a[0] == 1


def test_whole_array_assignment_is_checked_in_both_modes(cpu_tier, monkeypatch):
    for mode in ("0", "1"):
        monkeypatch.setenv("STAGEBUF_CHECK", mode)
        table = _table()
        with pytest.raises(InvalidArgumentError, match="fractional"):
            table["top_k"].np = [1, 2, 3, 4.5]
        assert table["top_k"].np.tolist() == [0, 0, 0, 0]
