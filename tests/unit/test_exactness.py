"""Integers a float dtype cannot hold exactly (16777217 into float32) are refused on every path that takes
host values, as every other value that would change is; the model is numpy's own rounding of one value."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stagebuf
from stagebuf import DeviceParamTable, StagedWriteTensor, StepStager, UvaBackedTensor, UvaBufferPool

FLOATS = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}


def exact(v: int, np_dtype: Any) -> bool:
    """The model: ``v`` survives numpy's conversion into the float dtype and back, unchanged."""
    with np.errstate(over="ignore"):
        f = float(np.array(float(v) if abs(v) < 2**1023 else np.inf).astype(np_dtype))
        if abs(v) < 2**53:
            f = float(np.array(v, np.int64).astype(np_dtype))
    return f not in (np.inf, -np.inf) and int(f) == v


def _pool(dt: torch.dtype, v: int) -> Any:
    return UvaBufferPool(4, dt).copy_to_uva([v, 1])


def _async(dt: torch.dtype, v: int) -> Any:
    return stagebuf.async_copy_to_gpu(np.array([v, 1], np.int64), dtype=dt)


def _stage(dt: torch.dtype, v: int) -> Any:
    with StepStager().step() as step:
        return step.stage([v, 1], dtype=dt)


def _backed(dt: torch.dtype, v: int) -> Any:
    t = UvaBackedTensor(2, dt)
    t.np = [v, 1]
    return t.copy_to_uva()


def _table(dt: torch.dtype, v: int) -> Any:
    t = DeviceParamTable(2, {"x": dt})
    t["x"].np = torch.tensor([v, 1])
    return t.sync()


def _write_list(dt: torch.dtype, v: int) -> Any:
    w = StagedWriteTensor((2, 2), dtype=dt)
    w.stage_write(1, 0, [v, 1])
    w.apply_write()
    return w


def _write_elem(dt: torch.dtype, v: int) -> Any:
    w = StagedWriteTensor((2, 2), dtype=dt)
    w.stage_write_elem(1, v)
    w.apply_write()
    return w


def _write_arrays(dt: torch.dtype, v: int) -> Any:
    w = StagedWriteTensor((2, 2), dtype=dt)
    w.stage_writes(np.array([0, 1]), np.array([0, 0]), np.array([1, v], np.int64))
    w.apply_write()
    return w


PATHS: dict[str, tuple[Callable[[torch.dtype, int], Any], tuple[torch.dtype, ...]]] = {
    "UvaBufferPool.copy_to_uva": (_pool, tuple(FLOATS)),
    "async_copy_to_gpu": (_async, tuple(FLOATS)),
    "Step.stage": (_stage, tuple(FLOATS)),
    "UvaBackedTensor.np =": (_backed, tuple(FLOATS)),
    "table[name].np =": (_table, tuple(FLOATS)),
    "stage_write": (_write_list, (torch.float32,)),  # staged writes take int32, int64, float32
    "stage_write_elem": (_write_elem, (torch.float32,)),
    "stage_writes": (_write_arrays, (torch.float32,)),
}
CASES = [(p, dt) for p, (_, dts) in PATHS.items() for dt in dts]


@pytest.mark.parametrize(("path", "dt"), CASES, ids=[f"{p}-{str(d)[6:]}" for p, d in CASES])
def test_an_integer_the_float_would_round_is_refused(path: str, dt: torch.dtype, cpu_tier: Any) -> None:
    call = PATHS[path][0]
    bound = 2 ** (np.finfo(FLOATS[dt]).nmant + 1)
    call(dt, bound)  # the largest integer below which every integer is exact: taken
    call(dt, 2 * bound)  # a power of two past it: exact, taken
    bad = bound + 1 if dt is not torch.float16 else 2049
    assert not exact(bad, FLOATS[dt])
    with pytest.raises(stagebuf.StagebufError, match=r"cannot hold exactly|beyond"):
        call(dt, bad)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    v=st.one_of(
        st.integers(-(2**63), 2**63 - 1),
        st.integers(-(2**26), 2**26),
        st.integers(0, 40).map(lambda k: 2**k + 1),
    ),
    dt=st.sampled_from(list(FLOATS)),
)
def test_taken_exactly_when_the_model_says_so(v: int, dt: torch.dtype) -> None:
    """Pool and stager agree with the model on every int64; what they take reads back unchanged."""
    for call in (_pool, _stage):
        if exact(v, FLOATS[dt]):
            out = call(dt, v)
            assert int(out[0].item()) == v
        else:
            with pytest.raises(stagebuf.InvalidArgumentError):
                call(dt, v)


def test_ints_past_64_bits_into_float64(cpu_tier: Any) -> None:
    with pytest.raises(stagebuf.InvalidArgumentError, match="cannot hold exactly"):
        _stage(torch.float64, 2**64 + 1)
    assert _stage(torch.float64, 2**64)[0].item() == 2.0**64  # a power of two: exact


def test_a_refused_list_edit_keeps_the_others(cpu_tier: Any) -> None:
    w = StagedWriteTensor((2, 2), dtype=torch.float32)
    w.stage_write(0, 0, [3, 4])
    w.stage_write(1, 0, [2**24 + 1])
    with pytest.raises(stagebuf.StagedWriteError, match="cannot hold exactly") as err:
        w.apply_write()
    assert list(err.value.edits) == [1] and w.num_staged == 2
    w.discard_staged(err.value.edits)
    w.apply_write()
    np.testing.assert_array_equal(w.gpu.cpu().numpy(), [[3, 4], [0, 0]])


def test_check_mode_np_refuses_the_rounding_integer(monkeypatch: pytest.MonkeyPatch, cpu_tier: Any) -> None:
    monkeypatch.setenv("STAGEBUF_CHECK", "1")
    b = stagebuf.make_buffer(3, torch.float32)
    b.np[0] = 2**24
    with pytest.raises(stagebuf.InvalidArgumentError, match="cannot hold exactly"):
        b.np[1] = 2**24 + 1
    with pytest.raises(stagebuf.InvalidArgumentError, match="cannot hold exactly"):
        b.np[:] = np.array([1, 2, 2**25 + 1])
    np.testing.assert_array_equal(b.np, [2**24, 0, 0])


@pytest.mark.parametrize("v", [2**63, 2**64, -(2**63) - 1])
def test_an_int_outside_int64_says_so(v: int, cpu_tier: Any) -> None:
    with pytest.raises(stagebuf.InvalidArgumentError, match="outside int64's range"):
        _stage(torch.int64, v)
    step = StepStager().step()
    with pytest.raises(stagebuf.InvalidArgumentError, match="outside int64's range"):
        step.stage([v, -1])  # the list's own dtype: numpy reads it as uint64 or float64


@pytest.mark.filterwarnings("error")  # numpy warns where a rounded value is cast back past the range
@pytest.mark.parametrize("src", [np.int16, np.int32, np.int64, np.uint32, np.uint64])
@pytest.mark.parametrize("dt", list(FLOATS))
def test_a_sources_extremes_are_judged_exactly(src: Any, dt: torch.dtype, cpu_tier: Any) -> None:
    info = np.iinfo(src)
    for v in (int(info.max), int(info.min), int(info.max) - 1):
        x = np.array([v], src)
        if exact(v, FLOATS[dt]):
            assert stagebuf.async_copy_to_gpu(x, dtype=dt)[0].item() == v
        else:
            with pytest.raises(stagebuf.InvalidArgumentError, match="cannot hold exactly|beyond"):
                stagebuf.async_copy_to_gpu(x, dtype=dt)
