"""The staged-write kernels on the CPU: Triton (through its interpreter) against its torch twin and numpy.

``_staged_write_kernel`` (programs per edit: ``programs_per_edit``) runs under Triton's CPU
interpreter on the packed layout ``_edit_meta`` builds; ``torch_twin`` (the same
kernel in plain torch ops, here) runs on the same layout. Both must equal a numpy
model that applies the edits by slicing. Then the whole apply path with a forced
kernel (``STAGEBUF_WRITE_KERNEL=triton`` under ``TRITON_INTERPRET=1``, and
``scatter``) is compared with the numpy model. The interpreter is slow: sizes
stay small.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stagebuf
from stagebuf import FusedStagedWriter, StagedWriteTensor
from stagebuf._rings.staged_write import kernel as sw_kernel
from stagebuf._rings.staged_write import launcher as sw_plan
from stagebuf._rings.staged_write.launcher import WriteBatch
from stagebuf._tiers.settings import ENV_KERNEL

pytest.importorskip("triton")

NP = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32}
DTYPES = [torch.int32, torch.int64, torch.float32]
CPU = torch.device("cpu")


def examples(n: int) -> settings:
    return settings(
        max_examples=n, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
    )


@pytest.fixture
def interpret(monkeypatch):
    """Triton's CPU interpreter for the applies of this test."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(ENV_KERNEL, raising=False)
    if not sw_kernel._triton_available():
        pytest.skip(f"triton.language does not import: {sw_kernel._triton_error}")
    assert sw_kernel.triton_usable(CPU)


def values(dtype: torch.dtype, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype.is_floating_point:
        return (rng.standard_normal(n) * 1e6).astype(np.float32)
    info = np.iinfo(NP[dtype])
    return rng.integers(info.min, info.max, n, dtype=NP[dtype], endpoint=True)


# --- the kernel and its twin on one packed layout ------------------------------------

Edit = tuple[int, int, np.ndarray]


def model_apply(a: np.ndarray, edits: list[Edit]) -> None:
    for r, s, v in edits:
        a[r, s : s + len(v)] = v


def gathered(t: StagedWriteTensor, edits: list[Edit]) -> WriteBatch:
    """One target's edits as the apply path gathers them (rows distinct: the Triton kernel's contract)."""
    assert len({r for r, _, _ in edits}) == len(edits)
    rows = np.array([r for r, _, _ in edits], np.int64)
    starts = np.array([s for _, s, _ in edits], np.int64)
    lens = np.array([len(v) for _, _, v in edits], np.int64)
    vals = np.concatenate([v for _, _, v in edits]).astype(NP[t.dtype])
    return WriteBatch(t._target, rows * t.row_stride + starts, np.cumsum(lens), vals, lens, 0, False)


def torch_twin(
    flats: Sequence[torch.Tensor], addrs: Sequence[int], meta: torch.Tensor, content: torch.Tensor
) -> None:
    """The Triton kernel in plain torch ops, on the same packed layout: the oracle it is tested against.

    ``flats[k]`` receives the edits whose meta row names the target address ``addrs[k]``.
    """
    n = content.shape[0]
    tid, dst, ln, src = meta.unbind(1)
    edit_of = torch.repeat_interleave(ln, output_size=n)
    j = torch.arange(n, device=content.device) - (torch.cumsum(ln, 0) - ln)[edit_of]
    dest, source, owner = dst[edit_of] + j, src[edit_of] + j, tid[edit_of]
    for flat, addr in zip(flats, addrs):
        sel = owner == addr
        flat.index_copy_(0, dest[sel], content[source[sel]])


def kernel_vs_twin(targets: list[StagedWriteTensor], edits: list[list[Edit]]) -> None:
    """Run the Triton kernel (interpreted) and the twin on one layout; both equal the numpy model."""
    parts = [gathered(t, e) for t, e in zip(targets, edits) if e]
    meta, vals, longest = sw_plan.edit_meta(parts)
    assert meta.shape == (sum(len(e) for e in edits), 4) and vals.shape[0] == meta[:, 2].sum()
    models = [t.gpu.numpy().reshape(t.rows, t.cols).copy() for t in targets]
    for m, e in zip(models, edits):
        model_apply(m, e)
    twins = [t.gpu.clone() for t in targets]
    torch_twin(
        [twins[[t.gpu.data_ptr() for t in targets].index(p.target.ptr)].view(-1) for p in parts],
        [p.target.ptr for p in parts],
        torch.from_numpy(meta),
        torch.from_numpy(vals),
    )
    d_meta, d_vals = torch.from_numpy(meta), torch.from_numpy(vals)
    sw_kernel.launch_at(CPU, 0, 0, d_vals.dtype, meta.shape[0], longest, lambda: (d_meta, d_vals))
    for t, twin, m in zip(targets, twins, models):
        np.testing.assert_array_equal(twin.numpy().reshape(m.shape), m)  # the twin is the model
        np.testing.assert_array_equal(t.gpu.numpy().reshape(m.shape), m)  # so is the kernel


def target(shape, dtype) -> StagedWriteTensor:
    return StagedWriteTensor(shape, dtype, "cpu")


def test_kernel_basic(interpret):
    t = target((4, 20), torch.int32)
    kernel_vs_twin(
        [t],
        [
            [
                (1, 2, np.arange(5, dtype=np.int32)),
                (3, 0, np.arange(20, dtype=np.int32) * 3),
                (0, 19, np.array([7], np.int32)),
            ]
        ],
    )
    kernel_vs_twin([t], [[(1, 0, np.array([9], np.int32))]])  # a second launch keeps the first's values


@pytest.mark.parametrize("spread", [1, 10, 1024])
def test_kernel_edits_longer_than_a_block(interpret, monkeypatch, spread):
    """Edits longer than BLOCK, spread over ``programs_per_edit`` programs an edit: one program looping over
    every block (SPREAD 1), two looping over every other block (10 over 5 edits), one a block (1024)."""
    monkeypatch.setattr(sw_kernel, "MAX_BLOCK", 16)
    monkeypatch.setattr(sw_kernel, "SPREAD", spread)
    assert sw_kernel._block_for(70) == 16
    assert sw_kernel.programs_per_edit(5, 70, 16) == {1: 1, 10: 2, 1024: 5}[spread]
    t = target((5, 70), torch.int64)
    rng = np.random.default_rng(4)
    edits = []
    for r in range(5):
        start = int(rng.integers(0, 30))
        n = int(rng.integers(17, 70 - start + 1))  # always more than one block
        edits.append((r, start, np.full(n, (r + 1) * 2**40 + n, np.int64)))
    kernel_vs_twin([t], [edits])


def test_kernel_one_d_and_float(interpret):
    t = target(9, torch.float32)
    kernel_vs_twin([t], [[(i, 0, np.array([v], np.float32)) for i, v in [(0, 1.5), (8, -2.0), (4, 3e38)]]])
    special = np.array([np.nan, -0.0, np.inf], np.float32)
    u = target((2, 3), torch.float32)
    kernel_vs_twin([u], [[(1, 0, special)]])
    np.testing.assert_array_equal(np.signbit(u.gpu.numpy()[1]), [False, True, False])


def test_kernel_several_targets_one_launch(interpret):
    """Different row lengths (strides), 1-D included, through one pointer table."""
    ts = [target(s, torch.int64) for s in [(3, 5), (2, 33), 6]]
    rng = np.random.default_rng(8)
    for sel in ([0, 1, 2], [2, 0], [1]):
        edits: list[list[Edit]] = [[] for _ in ts]
        for i in sel:
            t = ts[i]
            for r in rng.permutation(t.rows)[:2]:
                start = int(rng.integers(0, t.cols))
                n = int(rng.integers(1, t.cols - start + 1))
                edits[i].append((int(r), start, values(torch.int64, n, int(rng.integers(0, 1000)))))
        kernel_vs_twin(ts, edits)


def test_programs_per_edit_against_its_rule():
    """One program per block of the longest edit, at most SPREAD // edits, at least one."""
    for e in (1, 2, 7, 100, 1024, 5000):
        for longest in (1, 15, 16, 17, 1024, 16384, 131072):
            for block in (16, 1024):
                blocks = (longest + block - 1) // block
                want = max(1, min(blocks, sw_kernel.SPREAD // e))
                assert sw_kernel.programs_per_edit(e, longest, block) == want
    assert sw_kernel.programs_per_edit(1, 131072, 1024) == 128  # a lone prompt: 128 programs, one block each


def test_block_sizes(monkeypatch):
    assert sw_kernel._block_for(1) == sw_kernel.MIN_BLOCK
    assert sw_kernel._block_for(sw_kernel.MIN_BLOCK + 1) == 2 * sw_kernel.MIN_BLOCK
    assert sw_kernel._block_for(10**9) == sw_kernel.MAX_BLOCK
    monkeypatch.setattr(sw_kernel, "MAX_BLOCK", 64)
    for n in range(1, 200):
        b = sw_kernel._block_for(n)
        assert b & (b - 1) == 0 and sw_kernel.MIN_BLOCK <= b <= 64 and (b >= n or b == 64)


@examples(30)
@given(data=st.data())
def test_kernel_random_layouts(interpret, monkeypatch, data):
    monkeypatch.setattr(sw_kernel, "MAX_BLOCK", data.draw(st.sampled_from([16, 64, 1024])))
    monkeypatch.setattr(sw_kernel, "SPREAD", data.draw(st.sampled_from([1, 3, 1024])))
    dtype = data.draw(st.sampled_from(DTYPES))
    shape = st.one_of(st.integers(1, 6), st.tuples(st.integers(1, 4), st.integers(1, 48)))
    shapes = data.draw(st.lists(shape, min_size=1, max_size=3))
    ts = [target(s, dtype) for s in shapes]
    edits: list[list[Edit]] = []
    for t in ts:
        rows = data.draw(st.lists(st.integers(0, t.rows - 1), unique=True, max_size=t.rows))
        es = []
        for r in rows:
            start = data.draw(st.integers(0, t.cols - 1))
            n = data.draw(st.integers(1, t.cols - start))
            es.append((r, start, values(dtype, n, data.draw(st.integers(0, 999)))))
        edits.append(es)
    if not any(edits):
        edits[0].append((0, 0, values(dtype, 1, 0)))
    kernel_vs_twin(ts, edits)


# --- the apply path with a forced kernel, against the numpy model ---------------------


@pytest.fixture
def pageable(monkeypatch) -> None:
    """The PAGEABLE tier on the CPU: applies go through the stager and a kernel (HOST needs neither)."""
    monkeypatch.setenv("STAGEBUF_TIER", "pageable")
    stagebuf.reset_capabilities()


class Twin:
    """One target per forced kernel (Triton, scatter), and the numpy model; every edit goes to all three."""

    def __init__(self, shape, dtype, monkeypatch):
        monkeypatch.setenv(ENV_KERNEL, "triton")  # read when a tensor is constructed
        self.tri = StagedWriteTensor(shape, dtype, "cpu")
        monkeypatch.setenv(ENV_KERNEL, "scatter")
        self.ref = StagedWriteTensor(shape, dtype, "cpu")
        monkeypatch.delenv(ENV_KERNEL)
        rows, cols = (shape, 1) if isinstance(shape, int) else shape
        self.model = np.zeros((rows, cols), NP[dtype])
        self.pending: list[Edit] = []

    def stage(self, row: int, start: int, v: np.ndarray, as_list: bool = False) -> None:
        x = v.tolist() if as_list else v
        self.tri.stage_write(row, start, x)
        self.ref.stage_write(row, start, x)
        if len(v):
            self.pending.append((row, start, np.array(v, dtype=self.model.dtype)))

    def apply(self) -> None:
        rows = [r for r, _, _ in self.pending]
        overlap = len(set(rows)) < len(rows)
        self.tri.apply_write()
        self.ref.apply_write()
        if rows:
            assert (self.tri.kernel, self.ref.kernel) == ("scatter" if overlap else "triton", "scatter")
        model_apply(self.model, self.pending)
        self.pending.clear()
        np.testing.assert_array_equal(self.ref.gpu.numpy().reshape(self.model.shape), self.model)
        np.testing.assert_array_equal(self.tri.gpu.numpy().reshape(self.model.shape), self.model)


def test_forced_kernels_basic(interpret, pageable, monkeypatch):
    tw = Twin((4, 20), torch.int32, monkeypatch)
    assert tw.tri.tier is stagebuf.Tier.PAGEABLE
    tw.stage(1, 2, np.arange(5, dtype=np.int32))
    tw.stage(3, 0, np.arange(20, dtype=np.int32) * 3, as_list=True)
    tw.stage(0, 19, np.array([7], np.int32))
    tw.apply()
    tw.stage(1, 4, np.array([-1, -2, -3], np.int32))
    tw.stage(1, 0, np.array([9], np.int32), as_list=True)  # the same row: overlaps go to scatter
    tw.apply()


def test_forced_kernels_fused(interpret, pageable, monkeypatch):
    shapes = [(3, 5), (2, 40), 6]
    tws = [Twin(s, torch.int64, monkeypatch) for s in shapes]
    monkeypatch.setattr(sw_kernel, "MAX_BLOCK", 16)
    monkeypatch.setenv(ENV_KERNEL, "triton")
    w_tri = FusedStagedWriter("cpu", max_writes=2)
    monkeypatch.setenv(ENV_KERNEL, "scatter")
    w_ref = FusedStagedWriter("cpu", max_writes=2)
    rng = np.random.default_rng(8)
    for sel in ([0, 1, 2], [0, 1, 2], [2, 0], [1]):
        for i in sel:
            t = tws[i].tri
            for r in rng.permutation(t.rows)[:2]:
                start = int(rng.integers(0, t.cols))
                n = int(rng.integers(1, t.cols - start + 1))
                tws[i].stage(int(r), start, values(torch.int64, n, int(rng.integers(0, 1000))), bool(r % 2))
        w_tri.apply([tws[i].tri for i in sel])
        w_ref.apply([tws[i].ref for i in sel])
        assert (w_tri.kernel, w_ref.kernel) == ("triton", "scatter")
        for i in sel:
            model_apply(tws[i].model, tws[i].pending)
            tws[i].pending.clear()
        for tw in tws:
            np.testing.assert_array_equal(tw.tri.gpu.numpy().reshape(tw.model.shape), tw.model)
            np.testing.assert_array_equal(tw.ref.gpu.numpy().reshape(tw.model.shape), tw.model)


@examples(25)
@given(data=st.data())
def test_forced_kernels_random_streams(interpret, pageable, monkeypatch, data):
    monkeypatch.setattr(sw_kernel, "MAX_BLOCK", data.draw(st.sampled_from([16, 64, 1024])))
    dtype = data.draw(st.sampled_from(DTYPES))
    shape = data.draw(st.one_of(st.integers(1, 6), st.tuples(st.integers(1, 4), st.integers(1, 48))))
    tw = Twin(shape, dtype, monkeypatch)
    rows, cols = tw.model.shape
    for _ in range(data.draw(st.integers(1, 3))):
        edits = data.draw(
            st.lists(
                st.tuples(
                    st.integers(0, 99),
                    st.integers(0, 99),
                    st.integers(0, 48),
                    st.integers(0, 999),
                    st.booleans(),
                ),
                max_size=8,
            )
        )
        for a, b, n, seed, as_list in edits:
            row, start = a % rows, b % (cols + 1)
            tw.stage(row, start, values(dtype, min(n, cols - start), seed), as_list)
        tw.apply()
