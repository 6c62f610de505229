"""The bad-input matrix: every public entry point x bad input -> what is raised.

``CASES`` is the matrix. Each row is a test (on every tier this machine runs):
the call must raise the given exception with a message that contains the given
text (which names the argument), or, where the input is accepted by design, the
row's check verifies the data (on HOST and PAGEABLE everywhere; on UVA, PINNED and
PAGEABLE of the CUDA device with the ``gpu`` marker). Every row also checks that nothing staged before
the bad call was lost or written: a pool result still holds after the pool's next
call, an open step still publishes what it staged, staged edits still apply,
and a param table still uploads its pending values.

Staged writes check list values when they are applied: for those rows the bad
call stages, and the row's ``apply`` call raises ``StagedWriteError`` naming the
edit; the test then checks that nothing was written and every edit (the earlier
one and the bad one) is still staged, and drops the bad one.

The API reference's page docs/api/bad_inputs.rst holds this matrix as a table; regenerate it, from
the checkout's root, with

    PYTHONPATH=src:tests .venv/bin/python tests/unit/test_bad_inputs.py --write

(without ``--write`` it prints the table; ``test_doc_matrix_is_in_sync`` fails when the two differ,
``test_the_documented_command_runs`` runs the command the doc gives).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import stagebuf
from helpers import force_tier, read_back
from stagebuf import (
    FusedStagedWriter,
    HostBuffer,
    PinnedBuffer,
    StagedWriteError,
    StagedWriteTensor,
    StepStager,
    TierUnavailableError,
    UvaBackedTensor,
    UvaBuffer,
    UvaBufferPool,
    async_copy_to_gpu,
    capabilities,
    make_buffer,
    set_default_max_concurrency,
)
from stagebuf._rings.param_table import DeviceParamTable

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "api" / "bad_inputs.rst"
BEGIN, END = ".. bad-input-matrix:begin", ".. bad-input-matrix:end"


class Ctx:
    """Objects with valid data staged on them, before the bad call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.mp = monkeypatch
        self.device = capabilities().device
        # pools: one result each, which must survive the bad call and one more good call
        self.pool = UvaBufferPool(4, torch.int32, max_concurrency=2)
        self.a = np.array([1, 2, 3], np.int32)
        self.ta = self.pool.copy_to_uva(self.a)
        self.pool2 = UvaBufferPool((4, 3), torch.float32, max_concurrency=2)
        self.a2 = np.arange(6, dtype=np.float32).reshape(2, 3) / 4
        self.ta2 = self.pool2.copy_to_uva(self.a2)
        self.advanced = False  # an accepted pool call took a slot: the window check is skipped
        # a backed tensor with published rows
        self.bt = UvaBackedTensor(5, torch.int64, max_concurrency=2)
        self.bt.np[:] = [10, 20, 30, 40, 50]
        self.bt.copy_to_uva(4)
        # a stager with an open step holding one array
        self.stager = StepStager(capacity=256, max_concurrency=2)
        self.step = self.stager.step()
        self.s = np.arange(5, dtype=np.int64) * 11
        self.ts = self.step.stage(self.s)
        # staged writes, not applied yet
        self.swt = StagedWriteTensor((4, 6), torch.int32, self.device)
        self.swt.stage_write(1, 2, [7, 8, 9])
        self.sw_model = np.zeros((4, 6), np.int32)
        self.sw_model[1, 2:5] = [7, 8, 9]
        self.swf = StagedWriteTensor((3, 4), torch.float32, self.device)
        self.swf.stage_write(0, 1, [1.5, -2.5])
        self.swf_model = np.zeros((3, 4), np.float32)
        self.swf_model[0, 1:3] = [1.5, -2.5]
        self.swf2 = StagedWriteTensor(2, torch.float32, self.device)
        self.swf2.stage_write_elem(1, 4.5)
        self.writer = FusedStagedWriter(self.device, 4)
        # a param table with host values not uploaded yet
        self.table = DeviceParamTable(4, {"temperature": torch.float32, "top_k": torch.int32}, self.device)
        self.table["top_k"].np[:] = [1, 2, 3, 4]
        self.table["temperature"].np[:] = [0.5, 1.0, 0.0, 2.0]

    def after_apply_error(self) -> None:
        """An apply refused a bad staged value: nothing written, every edit still staged; drop the bad one."""
        for t, first in ((self.swt, (1, 2, [7, 8, 9])), (self.swf, (0, 1, [1.5, -2.5]))):
            np.testing.assert_array_equal(read_back(t.gpu), 0)
            pending = t.pending_writes()
            assert pending[0] == first and t.num_staged == len(pending)
            if len(pending) > 1:  # the bad edit: still staged, after the earlier one
                t.clear_staged_writes()
                t.stage_write(*first)
        np.testing.assert_array_equal(read_back(self.swf2.gpu), 0)
        assert self.swf2.pending_writes() == [(1, 0, [4.5])]

    def intact(self) -> None:
        """Nothing staged before the bad call was lost, and nothing of it was written."""
        if not self.advanced:  # one more good call: the bad one took no slot, so ta still holds
            b = np.array([9], np.int32)
            tb = self.pool.copy_to_uva(b)
            np.testing.assert_array_equal(read_back(self.ta), self.a)
            np.testing.assert_array_equal(read_back(tb), b)
            b2 = np.ones((1, 3), np.float32)
            tb2 = self.pool2.copy_to_uva(b2)
            np.testing.assert_array_equal(read_back(self.ta2), self.a2)
            np.testing.assert_array_equal(read_back(tb2), b2)
        np.testing.assert_array_equal(read_back(self.bt.gpu), [10, 20, 30, 40])
        np.testing.assert_array_equal(self.bt.np, [10, 20, 30, 40, 50])
        if not self.step.done:
            extra = np.array([3.5, 4.5])
            te = self.step.stage(extra)
            self.step.flush()
            np.testing.assert_array_equal(read_back(te), extra)
        np.testing.assert_array_equal(read_back(self.ts), self.s)
        self.swt.apply_write()
        np.testing.assert_array_equal(read_back(self.swt.gpu), self.sw_model)
        self.writer.apply([self.swf])
        np.testing.assert_array_equal(read_back(self.swf.gpu), self.swf_model)
        self.writer.apply([self.swf2])
        np.testing.assert_array_equal(read_back(self.swf2.gpu), [0, 4.5])
        assert self.table.sync()
        np.testing.assert_array_equal(read_back(self.table["top_k"].gpu), [1, 2, 3, 4])
        np.testing.assert_array_equal(read_back(self.table["temperature"].gpu), [0.5, 1.0, 0.0, 2.0])


@dataclass(frozen=True)
class Case:
    entry: str
    bad: str
    call: Callable[[Ctx], Any]
    raises: type[BaseException] | None
    """The exception raised; None where the input is accepted by design."""
    text: str
    """A substring of the message (naming the argument); for an accepted input, what happens."""
    check: Callable[[Ctx, Any], None] | None = None
    apply: Callable[[Ctx], Any] | None = None
    """For a value only checked when applied: the call (after ``call`` staged it) that raises."""

    @property
    def id(self) -> str:
        return f"{self.entry} | {self.bad}"


def _strided_i32() -> torch.Tensor:
    return torch.arange(8, dtype=torch.int32)[::2]  # [0, 2, 4, 6], stride 2


def _meta(dtype: torch.dtype = torch.int32, shape: tuple[int, ...] = (3,)) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device="meta")


def _pool_grew(c: Ctx, t: torch.Tensor) -> None:
    c.advanced = True
    np.testing.assert_array_equal(read_back(t), np.arange(10, dtype=np.int32))


def _pool_strided(c: Ctx, t: torch.Tensor) -> None:
    c.advanced = True
    np.testing.assert_array_equal(read_back(t), [0, 2, 4, 6])


def _out_strided(c: Ctx, _: Any) -> None:
    c.advanced = True
    np.testing.assert_array_equal(read_back(c.out), [0, 2, 4, 6])
    assert c.out_base.cpu().tolist() == [0, -1, 2, -1, 4, -1, 6, -1]  # the gaps were not written


def _copy_to_gpu_strided_out(c: Ctx) -> Any:
    c.out_base = torch.full((8,), -1, dtype=torch.int32, device=c.pool.device)
    c.out = c.out_base[::2]
    return c.pool.copy_to_gpu(_strided_i32(), out=c.out)


def _f16_into_int(c: Ctx) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as under `pytest -W error`: a warning would be an error
        return c.pool.copy_to_uva(np.array([1.0, -3.0, 65504.0], np.float16))


def _sw_f16_into_int(c: Ctx) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c.swt.stage_write(2, 0, np.array([1.0, -3.0], np.float16))


def _f16_converted(c: Ctx, t: torch.Tensor) -> None:
    c.advanced = True
    np.testing.assert_array_equal(read_back(t), [1, -3, 65504])


def _bt_n(c: Ctx, t: torch.Tensor) -> None:
    np.testing.assert_array_equal(read_back(t), [10, 20, 30])
    c.bt.copy_to_uva(4)  # back to what intact() expects


def _stage_grew(c: Ctx, t: torch.Tensor) -> None:
    c.step.flush()
    np.testing.assert_array_equal(read_back(t), np.arange(1000))


def _stage_strided(c: Ctx, t: torch.Tensor) -> None:
    c.step.flush()
    np.testing.assert_array_equal(read_back(t), [0, 2, 4, 6])


def _async_strided(c: Ctx, t: torch.Tensor) -> None:
    np.testing.assert_array_equal(read_back(t), [0, 2, 4, 6])


def _sw_accepted(row: int, start: int, values: list[int]) -> Callable[[Ctx, Any], None]:
    def check(c: Ctx, _: Any) -> None:
        c.sw_model[row, start : start + len(values)] = values

    return check


def _sw_batch(c: Ctx, _: Any) -> None:
    c.sw_model[3, 0:2] = [1, 2]
    c.sw_model[0, 4:6] = [3, 4]


def _sw_error(position: int, index: int, start: int, n: int, dtype: str, why: str) -> str:
    return (
        f"staged edit {position} (stage_write(index={index}, start={start}, {n} values)) "
        f"cannot be applied to torch.{dtype}: {why}"
    )


SW_DTYPES = {"swt": "int32", "swf": "float32"}
"""Ctx's staged-write targets and their dtypes."""


def _at_apply(
    entry: str,
    bad: str,
    target: str,
    edit: tuple[Any, ...],
    why: str,
    apply: Callable[[Ctx], Any] | None = None,
) -> Case:
    """A value only checked when applied: ``c.<target>.stage_write(*edit)`` (``stage_write_elem`` for an edit
    of two items) stages it, then ``apply`` (the target's ``apply_write()``) raises StagedWriteError naming
    the edit, staged first after Ctx's: "values ``why``"."""
    elem = len(edit) == 2
    index, start, n = (edit[0], 0, 1) if elem else (edit[0], edit[1], len(edit[2]))

    def call(c: Ctx) -> Any:
        t = getattr(c, target)
        return t.stage_write_elem(*edit) if elem else t.stage_write(*edit)

    text = _sw_error(1, index, start, n, SW_DTYPES[target], f"values {why}")
    return Case(
        entry, bad, call, StagedWriteError, text, apply=apply or (lambda c: getattr(c, target).apply_write())
    )


def _fused_twice(c: Ctx, _: Any) -> None:
    np.testing.assert_array_equal(read_back(c.swf.gpu), c.swf_model)
    assert c.swf.num_staged == 0


def _after_flush(c: Ctx) -> Any:
    c.step.flush()
    return c.step.stage([1])


def _unknown_tier(c: Ctx) -> Any:
    prev = os.environ.get("STAGEBUF_TIER")
    c.mp.setenv("STAGEBUF_TIER", "fast")
    stagebuf.reset_capabilities()
    try:
        return capabilities()
    finally:
        if prev is None:
            c.mp.delenv("STAGEBUF_TIER")
        else:
            c.mp.setenv("STAGEBUF_TIER", prev)
        stagebuf.reset_capabilities()


def _set_field(c: Ctx, value: Any) -> None:
    c.table["top_k"].np[:] = value


I32, F32, F16 = torch.int32, torch.float32, torch.float16
NAN_INF = [np.nan, np.inf]

POOL = "UvaBufferPool(size, dtype, max_concurrency, device, guard)"
COPY = "UvaBufferPool.copy_to_uva(x)"
COPY_GPU = "UvaBufferPool.copy_to_gpu(x, out)"
BT = "UvaBackedTensor(size, dtype, ...)"
BT_COPY = "UvaBackedTensor.copy_to_uva(n)"
STAGER = "StepStager(device, capacity, max_concurrency, guard)"
STEP = "StepStager.step() / mark_consumed()"
STAGE = "Step.stage(x, dtype)"
ASYNC = "async_copy_to_gpu(x, out, device, dtype)"
MAKE = "make_buffer(size, dtype, device, tier)"
BUFS = "HostBuffer / UvaBuffer / PinnedBuffer(size, dtype, device)"
BUF_N = "StagingBuffer.uva(n) / copy_to(out, n)"
SETMC = "set_default_max_concurrency(n)"
CAPS = "capabilities(device) / STAGEBUF_TIER"
SWT = "StagedWriteTensor(size, dtype, device, ...)"
SW = "StagedWriteTensor.stage_write(index, start, values)"
SWE = "StagedWriteTensor.stage_write_elem(index, value)"
SWS = "StagedWriteTensor.stage_writes(rows, starts, values, lengths)"
FW = "FusedStagedWriter(device, max_writes, ...)"
FWA = "FusedStagedWriter.apply(tensors)"
PT = "DeviceParamTable(num_rows, fields, device, ...)"
PTF = "DeviceParamTable[name] / .np"

CASES: list[Case] = [
    # --- constructors of pools
    Case(POOL, "size negative", lambda c: UvaBufferPool(-1, I32), ValueError, "size=-1"),
    Case(POOL, "size None", lambda c: UvaBufferPool(None, I32), ValueError, "size=None"),
    Case(POOL, "size float", lambda c: UvaBufferPool(4.0, I32), ValueError, "size=4.0"),
    Case(POOL, "size bool", lambda c: UvaBufferPool(True, I32), ValueError, "size=True"),
    Case(
        POOL,
        "dtype unsupported (complex64)",
        lambda c: UvaBufferPool(4, torch.complex64),
        TypeError,
        "dtype=torch.complex64",
    ),
    Case(POOL, "dtype None", lambda c: UvaBufferPool(4, None), TypeError, "dtype=None"),
    Case(POOL, "dtype a non-numeric numpy name", lambda c: UvaBufferPool(4, "U3"), TypeError, "dtype='U3'"),
    Case(POOL, "max_concurrency 0", lambda c: UvaBufferPool(4, I32, 0), ValueError, "max_concurrency=0"),
    Case(
        POOL,
        "max_concurrency bool",
        lambda c: UvaBufferPool(4, I32, True),
        ValueError,
        "max_concurrency=True",
    ),
    Case(
        POOL,
        "guard unknown",
        lambda c: UvaBufferPool(4, I32, guard="sometimes"),
        ValueError,
        "guard='sometimes'",
    ),
    # --- UvaBufferPool.copy_to_uva (int32 pool of 4 rows; float32 pool of (4, 3))
    Case(
        COPY,
        "wrong dtype (str array)",
        lambda c: c.pool.copy_to_uva(np.array(["1"])),
        TypeError,
        "x has dtype <U1",
    ),
    Case(
        COPY,
        "wrong dtype (complex array)",
        lambda c: c.pool.copy_to_uva(np.array([1j])),
        TypeError,
        "x has dtype complex128",
    ),
    Case(
        COPY,
        "fractional floats into int",
        lambda c: c.pool.copy_to_uva([1.5]),
        ValueError,
        "x holds fractional values",
    ),
    Case(
        COPY,
        "wrong rank (2-D into 1-D)",
        lambda c: c.pool.copy_to_uva(np.zeros((2, 2), np.int32)),
        ValueError,
        "x has rank 2",
    ),
    Case(
        COPY,
        "wrong rank (0-D)",
        lambda c: c.pool.copy_to_uva(np.array(3, np.int32)),
        ValueError,
        "x has rank 0",
    ),
    Case(
        COPY,
        "wrong row shape",
        lambda c: c.pool2.copy_to_uva(np.zeros((2, 4), np.float32)),
        ValueError,
        "x has rows of shape (4,)",
    ),
    Case(
        COPY,
        "ragged nested list",
        lambda c: c.pool2.copy_to_uva([[1, 2, 3], [4]]),
        ValueError,
        "x is not a rectangular list",
    ),
    Case(
        COPY,
        "too long (10 rows into 4)",
        lambda c: c.pool.copy_to_uva(np.arange(10, dtype=np.int32)),
        None,
        "accepted: the slot grows to 16 rows, data copied",
        _pool_grew,
    ),
    Case(
        COPY,
        "float16 whole numbers into int",
        _f16_into_int,
        None,
        "accepted: converted exactly, with no warning",
        _f16_converted,
    ),
    Case(COPY, "NaN into int", lambda c: c.pool.copy_to_uva([1.0, np.nan]), ValueError, "x holds NaN or inf"),
    Case(
        COPY,
        "inf into int",
        lambda c: c.pool.copy_to_uva(np.array([np.inf])),
        ValueError,
        "x holds NaN or inf",
    ),
    Case(
        COPY,
        "out of range int (2**40 into int32)",
        lambda c: c.pool.copy_to_uva([2**40]),
        ValueError,
        "x holds values in",
    ),
    Case(
        COPY,
        "out of range float (1e300 into float32)",
        lambda c: c.pool2.copy_to_uva([[1e300, 0, 0]]),
        ValueError,
        "x holds finite values beyond",
    ),
    Case(
        COPY,
        "out of range int into float16 (70000)",
        lambda c: UvaBufferPool(4, F16).copy_to_uva([70000]),
        ValueError,
        "x holds finite values beyond",
    ),
    Case(
        COPY,
        "out of range int into float16 (int32 minimum)",
        lambda c: UvaBufferPool(4, F16).copy_to_uva(np.array([-(2**31), 1], np.int32)),
        ValueError,
        "x holds finite values beyond",
    ),
    Case(
        COPY,
        "bool array into int",
        lambda c: c.pool.copy_to_uva(np.array([True, False])),
        TypeError,
        "bools and numbers are not converted",
    ),
    Case(COPY, "bool scalar", lambda c: c.pool.copy_to_uva(True), TypeError, "x must be a list"),
    Case(COPY, "None", lambda c: c.pool.copy_to_uva(None), TypeError, "x must be a list"),
    Case(COPY, "int scalar", lambda c: c.pool.copy_to_uva(5), TypeError, "x must be a list"),
    Case(COPY, "str", lambda c: c.pool.copy_to_uva("123"), TypeError, "x must be a list"),
    Case(COPY, "dict", lambda c: c.pool.copy_to_uva({"a": 1}), TypeError, "x must be a list"),
    Case(COPY, "generator", lambda c: c.pool.copy_to_uva(i for i in range(3)), TypeError, "x must be a list"),
    Case(
        COPY,
        "non-contiguous CPU tensor",
        lambda c: c.pool.copy_to_uva(_strided_i32()),
        None,
        "accepted: copied correctly",
        _pool_strided,
    ),
    Case(
        COPY,
        "non-contiguous ndarray",
        lambda c: c.pool.copy_to_uva(np.arange(8, dtype=np.int32)[::2]),
        None,
        "accepted: copied correctly",
        _pool_strided,
    ),
    Case(
        COPY,
        "tensor on another device (meta)",
        lambda c: c.pool.copy_to_uva(_meta()),
        ValueError,
        "x is a tensor on meta",
    ),
    Case(
        COPY,
        "tensor of unsupported dtype",
        lambda c: c.pool.copy_to_uva(torch.zeros(2, dtype=torch.cfloat)),
        TypeError,
        "x has dtype torch.complex64",
    ),
    Case(
        COPY,
        "list of mixed types (int, str)",
        lambda c: c.pool.copy_to_uva([1, "a"]),
        TypeError,
        "x holds elements numpy reads as",
    ),
    Case(
        COPY,
        "list of mixed types (int, None)",
        lambda c: c.pool.copy_to_uva([1, None]),
        TypeError,
        "x holds elements numpy reads as",
    ),
    Case(
        COPY,
        "int past 64 bits",
        lambda c: c.pool.copy_to_uva([2**70]),
        ValueError,
        "x holds values in [1180591620717411303424, 1180591620717411303424], outside int32's range",
    ),
    Case(
        COPY, "list of mixed types (bool, int)", lambda c: c.pool.copy_to_uva([True, 2]), TypeError, "bools"
    ),
    # --- UvaBufferPool.copy_to_gpu
    Case(
        COPY_GPU,
        "out of the wrong dtype",
        lambda c: c.pool.copy_to_gpu(c.a, out=torch.zeros(3, dtype=torch.int64, device=c.pool.device)),
        ValueError,
        "expected shape (3,), dtype torch.int32",
    ),
    Case(
        COPY_GPU,
        "out of the wrong shape",
        lambda c: c.pool.copy_to_gpu(c.a, out=torch.zeros(5, dtype=I32, device=c.pool.device)),
        ValueError,
        "out has shape (5,)",
    ),
    Case(
        COPY_GPU,
        "out not a tensor",
        lambda c: c.pool.copy_to_gpu(c.a, out=[0, 0, 0]),
        TypeError,
        "out must be a torch.Tensor",
    ),
    Case(
        COPY_GPU,
        "out on another device (meta)",
        lambda c: c.pool.copy_to_gpu(c.a, out=_meta()),
        ValueError,
        "device meta",
    ),
    Case(
        COPY_GPU,
        "x None (with out)",
        lambda c: c.pool.copy_to_gpu(None, out=torch.zeros(3, dtype=I32, device=c.pool.device)),
        TypeError,
        "x must be a list",
    ),
    Case(COPY_GPU, "NaN into int", lambda c: c.pool.copy_to_gpu([np.nan]), ValueError, "x holds NaN or inf"),
    Case(
        COPY_GPU,
        "non-contiguous out",
        _copy_to_gpu_strided_out,
        None,
        "accepted: written through its strides",
        _out_strided,
    ),
    # --- UvaBackedTensor
    Case(
        BT,
        "dtype unsupported",
        lambda c: UvaBackedTensor(4, torch.complex64),
        TypeError,
        "dtype=torch.complex64",
    ),
    Case(BT, "size negative", lambda c: UvaBackedTensor(-3, I32), ValueError, "size=-3"),
    Case(BT_COPY, "n negative", lambda c: c.bt.copy_to_uva(-1), ValueError, "n=-1"),
    Case(
        BT_COPY, "n past the rows", lambda c: c.bt.copy_to_uva(6), ValueError, "n=6 must be an int in [0, 5]"
    ),
    Case(BT_COPY, "n bool", lambda c: c.bt.copy_to_uva(True), ValueError, "n=True"),
    Case(BT_COPY, "n float", lambda c: c.bt.copy_to_uva(2.0), ValueError, "n=2.0"),
    Case(BT_COPY, "n str", lambda c: c.bt.copy_to_uva("2"), ValueError, "n='2'"),
    Case(
        BT_COPY,
        "n a numpy integer",
        lambda c: c.bt.copy_to_uva(np.int64(3)),
        None,
        "accepted: publishes 3 rows",
        _bt_n,
    ),
    # --- StepStager
    Case(STAGER, "capacity below 16 bytes", lambda c: StepStager(capacity=8), ValueError, "capacity=8"),
    Case(STAGER, "capacity None", lambda c: StepStager(capacity=None), ValueError, "capacity=None"),
    Case(STAGER, "capacity float", lambda c: StepStager(capacity=1024.0), ValueError, "capacity=1024.0"),
    Case(
        STAGER,
        "max_concurrency negative",
        lambda c: StepStager(max_concurrency=-1),
        ValueError,
        "max_concurrency=-1",
    ),
    Case(STAGER, "guard unknown", lambda c: StepStager(guard="never"), ValueError, "guard='never'"),
    Case(STEP, "step() while a step is open", lambda c: c.stager.step(), RuntimeError, "is still open"),
    Case(
        STEP,
        "mark_consumed() while a step is open",
        lambda c: c.stager.mark_consumed(),
        RuntimeError,
        "is still open",
    ),
    Case(
        STAGE,
        "dtype unsupported",
        lambda c: c.step.stage([1], dtype=torch.complex64),
        TypeError,
        "dtype=torch.complex64",
    ),
    Case(
        STAGE,
        "dtype not a dtype name",
        lambda c: c.step.stage([1], dtype="int33"),
        TypeError,
        "dtype='int33'",
    ),
    Case(
        STAGE,
        "wrong dtype (str array)",
        lambda c: c.step.stage(np.array(["a"])),
        TypeError,
        "x has dtype <U1",
    ),
    Case(STAGE, "wrong rank (3-D)", lambda c: c.step.stage(np.zeros((2, 2, 2))), ValueError, "x has rank 3"),
    Case(STAGE, "wrong rank (0-D)", lambda c: c.step.stage(np.array(1.0)), ValueError, "x has rank 0"),
    Case(
        STAGE,
        "too long (8000 bytes into 256)",
        lambda c: c.step.stage(np.arange(1000)),
        None,
        "accepted: the slot grows, earlier arrays of the step stay valid",
        _stage_grew,
    ),
    Case(
        STAGE,
        "NaN into int",
        lambda c: c.step.stage([1.0, np.nan], dtype=I32),
        ValueError,
        "x holds NaN or inf",
    ),
    Case(
        STAGE,
        "out of range (300 into uint8)",
        lambda c: c.step.stage([300], dtype=torch.uint8),
        ValueError,
        "x holds values in",
    ),
    Case(
        STAGE,
        "negative into uint8",
        lambda c: c.step.stage([-1], dtype=torch.uint8),
        ValueError,
        "x holds values in",
    ),
    Case(
        STAGE,
        "out of range int into float16 (70000)",
        lambda c: c.step.stage([70000], dtype=F16),
        ValueError,
        "x holds finite values beyond",
    ),
    Case(
        STAGE,
        "out of range int into float16 (int64 minimum)",
        lambda c: c.step.stage(np.array([-(2**63)], np.int64), dtype=F16),
        ValueError,
        "x holds finite values beyond",
    ),
    Case(
        STAGE,
        "bool into int",
        lambda c: c.step.stage([True], dtype=I32),
        TypeError,
        "bools and numbers are not converted",
    ),
    Case(STAGE, "None", lambda c: c.step.stage(None), TypeError, "x must be a list"),
    Case(STAGE, "int scalar", lambda c: c.step.stage(5), TypeError, "x must be a list"),
    Case(
        STAGE,
        "non-contiguous CPU tensor",
        lambda c: c.step.stage(_strided_i32()),
        None,
        "accepted: copied correctly",
        _stage_strided,
    ),
    Case(
        STAGE,
        "tensor on another device (meta)",
        lambda c: c.step.stage(_meta()),
        ValueError,
        "x is a tensor on meta",
    ),
    Case(
        STAGE,
        "list of mixed types",
        lambda c: c.step.stage([1, "a"]),
        TypeError,
        "x holds elements numpy reads as",
    ),
    Case(STAGE, "after the step was flushed", _after_flush, RuntimeError, "was already flushed"),
    # --- async_copy_to_gpu
    Case(ASYNC, "None", lambda c: async_copy_to_gpu(None), TypeError, "x must be a list"),
    Case(
        ASYNC,
        "dtype unsupported",
        lambda c: async_copy_to_gpu([1], dtype=torch.complex64),
        TypeError,
        "dtype=torch.complex64",
    ),
    Case(
        ASYNC,
        "NaN into int (dtype=int32)",
        lambda c: async_copy_to_gpu([np.nan], dtype=I32),
        ValueError,
        "x holds NaN or inf",
    ),
    Case(
        ASYNC,
        "NaN into an int32 out",
        lambda c: async_copy_to_gpu(np.array([1.0, np.nan]), out=torch.zeros(2, dtype=I32, device=c.device)),
        ValueError,
        "x holds NaN or inf",
    ),
    Case(
        ASYNC,
        "fractional into an int32 out",
        lambda c: async_copy_to_gpu([1.5], out=torch.zeros(1, dtype=I32, device=c.device)),
        ValueError,
        "x holds fractional values",
    ),
    Case(
        ASYNC,
        "out of the wrong shape",
        lambda c: async_copy_to_gpu([1, 2], out=torch.zeros(3, dtype=torch.int64, device=c.device)),
        ValueError,
        "out has shape (3,)",
    ),
    Case(
        ASYNC,
        "out not a tensor",
        lambda c: async_copy_to_gpu([1], out=np.zeros(1)),
        TypeError,
        "out must be a torch.Tensor",
    ),
    Case(
        ASYNC,
        "out on another device (meta)",
        lambda c: async_copy_to_gpu([1, 2, 3], out=_meta(torch.int64)),
        ValueError,
        "on meta",
    ),
    Case(
        ASYNC, "wrong rank (9-D)", lambda c: async_copy_to_gpu(np.zeros((1,) * 9)), ValueError, "x has rank 9"
    ),
    Case(
        ASYNC,
        "tensor on another device (meta)",
        lambda c: async_copy_to_gpu(_meta()),
        ValueError,
        "x is a tensor on meta",
    ),
    Case(
        ASYNC,
        "non-contiguous CPU tensor",
        lambda c: async_copy_to_gpu(_strided_i32()),
        None,
        "accepted: copied correctly",
        _async_strided,
    ),
    Case(
        ASYNC,
        "list of mixed types",
        lambda c: async_copy_to_gpu([1, "a"]),
        TypeError,
        "x holds elements numpy reads as",
    ),
    # --- make_buffer, set_default_max_concurrency, capabilities
    Case(MAKE, "tier unknown", lambda c: make_buffer(4, I32, tier="fast"), ValueError, "tier='fast'"),
    Case(MAKE, "size negative", lambda c: make_buffer(-2, I32), ValueError, "size=-2"),
    Case(MAKE, "dtype unsupported", lambda c: make_buffer(4, "complex64"), TypeError, "dtype='complex64'"),
    Case(
        BUFS,
        "HostBuffer on another device",
        lambda c: HostBuffer(4, I32, device="meta"),
        ValueError,
        "HostBuffer: device='meta'",
    ),
    Case(
        BUFS, "UvaBuffer for the CPU", lambda c: UvaBuffer(4, I32, "cpu"), TierUnavailableError, "accelerator"
    ),
    Case(
        BUFS,
        "PinnedBuffer for the CPU",
        lambda c: PinnedBuffer(4, I32, "cpu"),
        TierUnavailableError,
        "accelerator",
    ),
    Case(BUF_N, "n past the rows", lambda c: make_buffer(4, I32).uva(5), ValueError, "n=5"),
    Case(
        BUF_N,
        "n negative (copy_to)",
        lambda c: make_buffer(4, I32).copy_to(torch.zeros(4, dtype=I32, device=c.device), -1),
        ValueError,
        "n=-1",
    ),
    Case(CAPS, "device string unknown", lambda c: capabilities("gpu9"), RuntimeError, "gpu9"),
    Case(SETMC, "n 0", lambda c: set_default_max_concurrency(0), ValueError, "n=0"),
    Case(SETMC, "n str", lambda c: set_default_max_concurrency("2"), ValueError, "n='2'"),
    Case(SETMC, "n bool", lambda c: set_default_max_concurrency(True), ValueError, "n=True"),
    Case(CAPS, "STAGEBUF_TIER unknown", _unknown_tier, ValueError, "STAGEBUF_TIER='fast'"),
    # --- staged writes (int32 target of (4, 6); float32 target of (3, 4))
    Case(
        SWT,
        "size of rank 3",
        lambda c: StagedWriteTensor((2, 3, 4), I32, c.device),
        ValueError,
        "size=(2, 3, 4) has rank 3",
    ),
    Case(SWT, "size negative", lambda c: StagedWriteTensor(-4, I32, c.device), ValueError, "size=-4"),
    Case(
        SWT,
        "dtype unsupported (float16)",
        lambda c: StagedWriteTensor(4, F16, c.device),
        ValueError,
        "dtype=torch.float16",
    ),
    Case(SWT, "dtype None", lambda c: StagedWriteTensor(4, None, c.device), ValueError, "dtype=None"),
    Case(SW, "index negative", lambda c: c.swt.stage_write(-1, 0, [1]), ValueError, "index=-1"),
    Case(
        SW,
        "index past the rows",
        lambda c: c.swt.stage_write(4, 0, [1]),
        ValueError,
        "index=4 is not a valid index; allowed: an int in [0, 3]",
    ),
    Case(SW, "index bool", lambda c: c.swt.stage_write(True, 0, [1]), ValueError, "index=True"),
    Case(SW, "index float", lambda c: c.swt.stage_write(1.0, 0, [1]), ValueError, "index=1.0"),
    Case(SW, "index None", lambda c: c.swt.stage_write(None, 0, [1]), ValueError, "index=None"),
    Case(SW, "start negative", lambda c: c.swt.stage_write(0, -1, [1]), ValueError, "start=-1"),
    Case(
        SW,
        "start past the row",
        lambda c: c.swt.stage_write(0, 7, []),
        ValueError,
        "past the end of the row (6 columns)",
    ),
    Case(
        SW,
        "values too long",
        lambda c: c.swt.stage_write(0, 0, list(range(7))),
        ValueError,
        "ends at column 7, past the end of the row",
    ),
    Case(
        SW,
        "values of the wrong dtype (str)",
        lambda c: c.swt.stage_write(0, 0, np.array(["1"])),
        TypeError,
        "values (edit index=0, start=0) has dtype <U1",
    ),
    Case(
        SW,
        "values of rank 2",
        lambda c: c.swt.stage_write(0, 0, np.zeros((1, 2), np.int32)),
        ValueError,
        "values (edit index=0, start=0) has rank 2",
    ),
    _at_apply(SW, "NaN into int (a list: checked at apply)", "swt", (0, 0, [np.nan]), "holds NaN or inf"),
    Case(
        SW,
        "NaN into int (an array: checked now)",
        lambda c: c.swt.stage_write(0, 0, np.array([np.nan])),
        ValueError,
        "holds NaN or inf",
    ),
    Case(
        SW,
        "inf into int",
        lambda c: c.swt.stage_write(0, 0, np.array([-np.inf])),
        ValueError,
        "holds NaN or inf",
    ),
    _at_apply(
        SW,
        "out of range (2**40 into int32)",
        "swt",
        (0, 0, [2**40]),
        "holds values in [1099511627776, 1099511627776], outside",
    ),
    Case(
        SW,
        "fractional into int (a tuple: checked now)",
        lambda c: c.swt.stage_write(0, 0, (1, 2.5)),
        ValueError,
        "holds fractional values",
    ),
    _at_apply(
        SW, "out of range float (1e39 into float32)", "swf", (1, 0, [1e39]), "holds finite values beyond"
    ),
    Case(
        SW,
        "float16 whole numbers into int",
        _sw_f16_into_int,
        None,
        "accepted: applied exactly, with no warning",
        _sw_accepted(2, 0, [1, -3]),
    ),
    _at_apply(
        SW, "bool values into int", "swt", (0, 0, [True, False]), "are bools; allowed: int or float values"
    ),
    Case(
        SW,
        "bools mixed with ints",
        lambda c: c.swt.stage_write(3, 0, [True, 2]),
        None,
        "accepted: bools read as ints (as numpy and torch read them)",
        _sw_accepted(3, 0, [1, 2]),
    ),
    Case(
        SW,
        "bool array into int",
        lambda c: c.swt.stage_write(0, 0, np.array([True])),
        TypeError,
        "bools and numbers are not converted",
    ),
    Case(
        SW,
        "values None",
        lambda c: c.swt.stage_write(0, 0, None),
        TypeError,
        "values (edit index=0, start=0) must be a list",
    ),
    Case(
        SW,
        "non-contiguous CPU tensor",
        lambda c: c.swt.stage_write(2, 1, _strided_i32()),
        None,
        "accepted: applied correctly",
        _sw_accepted(2, 1, [0, 2, 4, 6]),
    ),
    Case(
        SW,
        "an iterable (generator)",
        lambda c: c.swt.stage_write(3, 0, (v for v in (5, 6))),
        None,
        "accepted: applied correctly",
        _sw_accepted(3, 0, [5, 6]),
    ),
    Case(
        SW,
        "tensor on another device (meta)",
        lambda c: c.swt.stage_write(0, 0, _meta()),
        ValueError,
        "is a tensor on meta",
    ),
    _at_apply(SW, "list of mixed types", "swt", (0, 0, [1, "a"]), "holds elements numpy reads as"),
    _at_apply(SW, "nested list", "swt", (2, 3, [[1, 2]]), "has rank 2"),
    Case(SWE, "index past the rows", lambda c: c.swt.stage_write_elem(4, 1), ValueError, "index=4"),
    Case(SWE, "index negative", lambda c: c.swt.stage_write_elem(-1, 1), ValueError, "index=-1"),
    _at_apply(SWE, "NaN into int", "swt", (0, float("nan")), "holds NaN or inf"),
    Case(
        SWE,
        "a numpy NaN into int (checked now)",
        lambda c: c.swt.stage_write_elem(0, np.float64("nan")),
        ValueError,
        "holds NaN or inf",
    ),
    Case(
        SWE,
        "bool into int",
        lambda c: c.swt.stage_write_elem(0, True),
        TypeError,
        "value=True is a bool; allowed: an int or float",
    ),
    Case(
        SWE,
        "None",
        lambda c: c.swt.stage_write_elem(0, None),
        TypeError,
        "value=None is a NoneType; allowed: an int or float",
    ),
    Case(
        SWE,
        "str",
        lambda c: c.swt.stage_write_elem(0, "3"),
        TypeError,
        "value='3' is a str; allowed: an int or float",
    ),
    Case(
        SWE,
        "a list",
        lambda c: c.swt.stage_write_elem(0, [1]),
        ValueError,
        "value is a list; stage_write_elem takes one scalar",
    ),
    _at_apply(
        SWE,
        "out of range (2**31 into int32)",
        "swt",
        (0, 2**31),
        "holds values in [2147483648, 2147483648], outside",
    ),
    _at_apply(SWE, "out of range float (1e39 into float32)", "swf", (2, 1e39), "holds finite values beyond"),
    Case(
        SWE,
        "a 0-d tensor",
        lambda c: c.swt.stage_write_elem(3, torch.tensor(42)),
        None,
        "accepted: applied correctly",
        _sw_accepted(3, 0, [42]),
    ),
    Case(
        SWS,
        "a row past the rows",
        lambda c: c.swt.stage_writes([0, 4], [0, 0], [[1], [2]]),
        ValueError,
        "rows[1]=4 is out of range; allowed: [0, 3]",
    ),
    Case(
        SWS,
        "a start negative",
        lambda c: c.swt.stage_writes([0, 1], [0, -1], [5, 6]),
        ValueError,
        "starts[1]=-1 is negative",
    ),
    Case(
        SWS,
        "an edit past the end of its row",
        lambda c: c.swt.stage_writes([2], [5], [[1, 2]]),
        ValueError,
        "edit 0 (rows[0]=2, starts[0]=5, 2 values) ends at column 7, past the end of the row (6 columns)",
    ),
    Case(
        SWS,
        "lengths not adding up to the values",
        lambda c: c.swt.stage_writes([0, 1], [0, 0], [1, 2, 3], lengths=[1, 1]),
        ValueError,
        "values has 3 elements but lengths add up to 2",
    ),
    Case(
        SWS,
        "fractional values into int",
        lambda c: c.swt.stage_writes([0, 1], [0, 0], [[1.0], [2.5]]),
        ValueError,
        "edit 1 (rows[1]=1, starts[1]=0): values holds fractional values",
    ),
    Case(
        SWS,
        "NaN into int",
        lambda c: c.swt.stage_writes([3], [1], np.array([np.nan])),
        ValueError,
        "edit 0 (rows[0]=3, starts[0]=1): values holds NaN or inf",
    ),
    Case(
        SWS,
        "values of the wrong dtype (str)",
        lambda c: c.swt.stage_writes([0], [0], np.array(["1"])),
        TypeError,
        "values has dtype <U1",
    ),
    Case(
        SWS,
        "bool values into int",
        lambda c: c.swt.stage_writes([0], [0], np.array([True])),
        TypeError,
        "bools and numbers are not converted",
    ),
    Case(
        SWS,
        "rows of the wrong dtype (float)",
        lambda c: c.swt.stage_writes([0.5], [0], [1]),
        TypeError,
        "rows has dtype float64; allowed: an integer array",
    ),
    Case(
        SWS,
        "values of rank 3",
        lambda c: c.swt.stage_writes([0], [0], np.zeros((1, 1, 1), np.int32)),
        ValueError,
        "values has rank 3",
    ),
    Case(
        SWS,
        "a batch",
        lambda c: c.swt.stage_writes([3, 0], [0, 4], [[1, 2], [3, 4]]),
        None,
        "accepted: applied in staging order",
        _sw_batch,
    ),
    Case(FW, "max_writes 0", lambda c: FusedStagedWriter(c.device, 0), ValueError, "max_writes=0"),
    Case(FW, "max_writes None", lambda c: FusedStagedWriter(c.device, None), ValueError, "max_writes=None"),
    Case(
        FWA,
        "an item not a StagedWriteTensor",
        lambda c: c.writer.apply([c.swf, "x"]),
        TypeError,
        "tensors[1] is a str",
    ),
    Case(FWA, "an item None", lambda c: c.writer.apply([c.swf, None]), TypeError, "tensors[1] is a NoneType"),
    Case(
        FWA,
        "tensors of two dtypes",
        lambda c: c.writer.apply([c.swf, c.swt]),
        ValueError,
        "tensors[1] has dtype torch.int32",
    ),
    Case(FWA, "None", lambda c: c.writer.apply(None), TypeError, "tensors"),
    Case(FWA, "a bare StagedWriteTensor (no list)", lambda c: c.writer.apply(c.swf), TypeError, "tensors"),
    _at_apply(
        FWA,
        "a bad list value in one of two tensors",
        "swf",
        (2, 0, [1.0, "x"]),
        "holds elements numpy reads as",
        apply=lambda c: c.writer.apply([c.swf2, c.swf]),
    ),
    Case(
        FWA,
        "output_ptrs not the tensors'",
        lambda c: c.writer.apply([c.swf], output_ptrs=[0]),
        ValueError,
        "output_ptrs=[0] does not match the tensors passed",
    ),
    Case(
        FWA,
        "output_strides not ints",
        lambda c: c.writer.apply([c.swf], output_strides=["a"]),
        TypeError,
        "output_strides must be None or a sequence (or tensor) of ints",
    ),
    Case(
        FWA,
        "the same tensor twice",
        lambda c: c.writer.apply([c.swf, c.swf]),
        None,
        "accepted: its edits are applied once",
        _fused_twice,
    ),
    # --- param table
    Case(
        PT,
        "num_rows negative",
        lambda c: DeviceParamTable(-1, {"a": I32}, c.device),
        ValueError,
        "num_rows=-1",
    ),
    Case(
        PT,
        "num_rows None",
        lambda c: DeviceParamTable(None, {"a": I32}, c.device),
        ValueError,
        "num_rows=None",
    ),
    Case(PT, "fields empty", lambda c: DeviceParamTable(2, {}, c.device), ValueError, "fields={}"),
    Case(
        PT,
        "fields a list of pairs",
        lambda c: DeviceParamTable(2, [("a", I32)], c.device),
        ValueError,
        "fields=[('a', torch.int32)]",
    ),
    Case(
        PT,
        "a field of unsupported dtype",
        lambda c: DeviceParamTable(2, {"a": torch.complex64}, c.device),
        TypeError,
        "fields['a']=torch.complex64",
    ),
    Case(
        PT,
        "a field name not a str",
        lambda c: DeviceParamTable(2, {1: I32}, c.device),
        ValueError,
        "field name 1",
    ),
    Case(
        PTF,
        "unknown field",
        lambda c: c.table["nope"],
        KeyError,
        "no field 'nope'; fields: temperature, top_k",
    ),
    Case(
        PTF,
        "NaN into an int field's .np",
        lambda c: _set_field(c, np.nan),
        ValueError,
        "cannot convert float NaN to integer",
    ),
    Case(PTF, "wrong length into .np", lambda c: _set_field(c, [1, 2, 3]), ValueError, "could not broadcast"),
]


# The CPU tiers everywhere; the CUDA tiers carry the gpu marker (so `pytest -m gpu` and the
# sanitizer runs include the matrix). On a GPU machine "pageable" targets the GPU too.
TIERS = [
    pytest.param("host", id="host"),
    pytest.param("pageable", id="pageable"),
    pytest.param("uva", id="cuda-uva", marks=pytest.mark.gpu),
    pytest.param("pinned", id="cuda-pinned", marks=pytest.mark.gpu),
    pytest.param("pageable", id="cuda-pageable", marks=pytest.mark.gpu),
]


@pytest.fixture(params=TIERS)
def tier(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.node.get_closest_marker("gpu") and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    force_tier(monkeypatch, request.param)
    return request.param


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(tier: str, monkeypatch: pytest.MonkeyPatch, case: Case) -> None:
    ctx = Ctx(monkeypatch)
    assert ctx.pool.tier.name == tier.upper()
    if case.raises is None:
        result = case.call(ctx)
        assert case.check is not None
        case.check(ctx, result)
    else:
        staged = case.apply is not None
        if staged:
            case.call(ctx)  # accepted when staged: the value is checked at apply
        with pytest.raises(case.raises) as ei:
            (case.apply or case.call)(ctx)
        msg = str(ei.value.args[0]) if isinstance(ei.value, KeyError) else str(ei.value)
        assert case.text in msg, f"message {msg!r} lacks {case.text!r}"
        if staged:
            assert isinstance(ei.value, StagedWriteError) and ei.value.position == 1
            ctx.after_apply_error()
    ctx.intact()


def test_rows_are_unique_and_cover_every_bad_input_kind() -> None:
    assert len({c.id for c in CASES}) == len(CASES)
    kinds = [
        "dtype",
        "rank",
        "too long",
        "negative",
        "past the",
        "NaN",
        "inf",
        "bool",
        "None",
        "non-contiguous",
        "another device",
        "mixed types",
    ]
    for k in kinds:
        assert any(k in c.bad for c in CASES), f"no row for {k}"


# --------------------------------------------------------------------------- the table in the doc


def _text(s: str) -> str:
    """``s`` as reStructuredText inline text: markup characters escaped."""
    s = s.replace("\\", "\\\\")
    for ch in "*`|_":
        s = s.replace(ch, "\\" + ch)
    return s


def _outcome(c: Case) -> str:
    if c.raises is None:
        return _text(c.text)
    when = " at apply (staged, nothing written, every edit kept)" if c.apply is not None else ""
    return f"``{c.raises.__name__}``{when}: “``{c.text}``”"


def table() -> str:
    """The matrix as a reStructuredText list table, the entry point named on the first row of its group."""
    lines = [
        ".. list-table::",
        "   :header-rows: 1",
        "   :widths: 30 30 40",
        "",
        "   * - entry point",
        "     - bad input",
        "     - outcome (exception: text the message contains)",
    ]
    entry = None
    for c in CASES:
        lines.append(f"   * - ``{c.entry}``" if c.entry != entry else "   * -")
        lines += [f"     - {_text(c.bad)}", f"     - {_outcome(c)}"]
        entry = c.entry
    return "\n".join(lines)


REGENERATE = "PYTHONPATH=src:tests .venv/bin/python tests/unit/test_bad_inputs.py --write"
"""How docs/api/bad_inputs.rst says to regenerate its matrix (from the checkout's root)."""


def test_the_documented_command_runs() -> None:
    """The command docs/api/bad_inputs.rst gives, as written (the venv's Python: this one), printing it."""
    import shlex
    import subprocess

    text = " ".join(DOC.read_text().split())
    assert f"`{REGENERATE}`" in text, f"{DOC.name} does not give the command {REGENERATE!r}"
    env_part, *cmd = shlex.split(REGENERATE)
    assert env_part.startswith("PYTHONPATH=") and cmd[0] == ".venv/bin/python" and cmd[-1] == "--write"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = env_part.split("=", 1)[1]
    p = subprocess.run(
        [sys.executable, *cmd[1:-1]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == table()


def test_doc_matrix_is_in_sync() -> None:
    text = DOC.read_text()
    assert BEGIN in text and END in text, f"{DOC} lacks the {BEGIN} ... {END} markers"
    in_doc = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert in_doc == table(), (
        f"docs/api/bad_inputs.rst's bad-input matrix is out of date: regenerate it with `{REGENERATE}`"
    )


def _write_doc() -> None:
    text = DOC.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(f"{head}{BEGIN}\n\n{table()}\n\n{END}{tail}")


if __name__ == "__main__":
    if "--write" in sys.argv[1:]:
        _write_doc()
        print(f"wrote {len(CASES)} rows into {os.path.relpath(DOC)}")
    else:
        print(table())
