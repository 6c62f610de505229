"""The Triton staged-write kernel, run by Triton's CPU interpreter, equals the torch twin and the model.

``TRITON_INTERPRET=1`` makes an apply on CPU tensors run the Triton kernel through
the interpreter; without it the torch twin runs. Each check applies the same
edits to two identical targets, one per kernel, and compares both with the
numpy model. The interpreter is slow: sizes stay small.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stagebuf import staged_write
from stagebuf.staged_write import FusedStagedWriter, StagedWriteTensor

pytest.importorskip("triton")

NP = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32}
DTYPES = [torch.int32, torch.int64, torch.float32]


def examples(n: int) -> settings:
    return settings(max_examples=n, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture
def kernel_mode(monkeypatch):
    """``kernel_mode(True)`` makes the next applies on CPU run the Triton kernel under the interpreter."""

    def set_mode(interpret: bool) -> None:
        if interpret:
            monkeypatch.setenv("TRITON_INTERPRET", "1")
        else:
            monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    return set_mode


def values(dtype: torch.dtype, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype.is_floating_point:
        return (rng.standard_normal(n) * 1e6).astype(np.float32)
    info = np.iinfo(NP[dtype])
    return rng.integers(info.min, info.max, n, dtype=NP[dtype], endpoint=True)


class Twin:
    """One target per kernel, and the model; every edit goes to all three."""

    def __init__(self, shape, dtype):
        self.tri = StagedWriteTensor(shape, dtype, "cpu")
        self.ref = StagedWriteTensor(shape, dtype, "cpu")
        rows, cols = (shape, 1) if isinstance(shape, int) else shape
        self.model = np.zeros((rows, cols), NP[dtype])
        self.pending: list[tuple[int, int, np.ndarray]] = []

    def stage(self, row: int, start: int, v: np.ndarray) -> None:
        self.tri.stage_write(row, start, v)
        self.ref.stage_write(row, start, v)
        self.pending.append((row, start, np.array(v, dtype=self.model.dtype)))

    def model_apply(self) -> None:
        for r, s, v in self.pending:
            self.model[r, s: s + len(v)] = v
        self.pending.clear()

    def check(self) -> None:
        tri = self.tri.gpu.numpy().reshape(self.model.shape)
        ref = self.ref.gpu.numpy().reshape(self.model.shape)
        np.testing.assert_array_equal(tri, ref)
        np.testing.assert_array_equal(tri, self.model)


def apply_single(tw: Twin, kernel_mode) -> None:
    kernel_mode(True)
    tw.tri.apply_write()
    kernel_mode(False)
    tw.ref.apply_write()
    assert (tw.tri.kernel, tw.ref.kernel) == ("triton", "torch")
    tw.model_apply()
    tw.check()


def test_interpreter_basic(cpu_tier, kernel_mode):
    tw = Twin((4, 20), torch.int32)
    tw.stage(1, 2, np.arange(5, dtype=np.int32))
    tw.stage(3, 0, np.arange(20, dtype=np.int32) * 3)
    tw.stage(1, 4, np.array([-1, -2, -3], np.int32))  # overlaps the first edit: later wins
    tw.stage(0, 19, np.array([7], np.int32))
    apply_single(tw, kernel_mode)
    tw.stage(1, 0, np.array([9], np.int32))
    apply_single(tw, kernel_mode)


def test_interpreter_multi_tile_overlaps(cpu_tier, kernel_mode, monkeypatch):
    """Rows longer than a tile: several programs per row, each owning its columns."""
    monkeypatch.setattr(staged_write, "MAX_BLOCK", 16)
    tw = Twin((3, 70), torch.int64)
    rng = np.random.default_rng(4)
    for k in range(12):
        start = int(rng.integers(0, 70))
        n = int(rng.integers(1, 70 - start + 1))
        tw.stage(int(rng.integers(0, 3)), start, np.full(n, (k + 1) * 2**40, np.int64))
    apply_single(tw, kernel_mode)


def test_interpreter_one_d_and_float(cpu_tier, kernel_mode):
    tw = Twin(9, torch.float32)
    for i, v in [(0, 1.5), (8, -2.0), (4, 3e38), (0, 7.25)]:
        tw.stage(i, 0, np.array([v], np.float32))
    apply_single(tw, kernel_mode)


def test_interpreter_fused_tables(cpu_tier, kernel_mode):
    """Different row lengths (strides), 1-D included; the pointer table follows the tensor set."""
    shapes = [(3, 5), (2, 33), 6]
    tws = [Twin(s, torch.int64) for s in shapes]
    w_tri = FusedStagedWriter("cpu", max_writes=2)
    w_ref = FusedStagedWriter("cpu", max_writes=2)
    rng = np.random.default_rng(8)
    for sel in ([0, 1, 2], [0, 1, 2], [2, 0], [1], [0, 1, 2]):
        for i in sel:
            t = tws[i].tri
            for _ in range(3):
                row = int(rng.integers(0, t.rows))
                start = int(rng.integers(0, t.cols))
                tws[i].stage(row, start, values(torch.int64, int(rng.integers(1, t.cols - start + 1)),
                                                int(rng.integers(0, 1000))))
        kernel_mode(True)
        w_tri.apply([tws[i].tri for i in sel])
        kernel_mode(False)
        w_ref.apply([tws[i].ref for i in sel])
        assert (w_tri.kernel, w_ref.kernel) == ("triton", "torch")
        for i in sel:
            tws[i].model_apply()
        for tw in tws:
            tw.check()


@examples(30)
@given(data=st.data())
def test_interpreter_random_streams(cpu_tier, kernel_mode, monkeypatch, data):
    monkeypatch.setattr(staged_write, "MAX_BLOCK", data.draw(st.sampled_from([16, 64, 1024])))
    dtype = data.draw(st.sampled_from(DTYPES))
    shape = data.draw(st.one_of(st.integers(1, 6), st.tuples(st.integers(1, 4), st.integers(1, 48))))
    tw = Twin(shape, dtype)
    rows, cols = tw.model.shape
    for _ in range(data.draw(st.integers(1, 3))):
        edits = data.draw(st.lists(st.tuples(st.integers(0, 99), st.integers(0, 99), st.integers(0, 48),
                                             st.integers(0, 999)), max_size=8))
        for a, b, n, seed in edits:
            row, start = a % rows, b % (cols + 1)
            tw.stage(row, start, values(dtype, min(n, cols - start), seed))
        apply_single(tw, kernel_mode)
