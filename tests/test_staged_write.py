"""StagedWriteTensor and FusedStagedWriter against a numpy model, on every tier this machine runs."""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stagebuf
from stagebuf.staged_write import FusedStagedWriter, StagedWriteTensor

NP = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32}
DTYPES = [torch.int32, torch.int64, torch.float32]


def examples(n: int) -> settings:
    """n examples, no deadline, and the tier fixture (constant across examples) allowed."""
    return settings(max_examples=n, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


class Model:
    """The numpy model: edits applied one by one, in staging order."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype):
        self.a = np.zeros((rows, cols), NP[dtype])
        self.pending: list[tuple[int, int, np.ndarray]] = []

    def stage(self, index: int, start: int, values) -> None:
        v = np.asarray(values, dtype=self.a.dtype).reshape(-1)
        self.pending.append((index, start, v.copy()))

    def apply(self) -> None:
        for i, s, v in self.pending:
            self.a[i, s: s + len(v)] = v
        self.pending.clear()


def device_of(tier: stagebuf.Tier) -> str:
    """The device the CPU tiers target (HOST, and PAGEABLE copying into a CPU tensor)."""
    return "cpu"


def read(t: StagedWriteTensor) -> np.ndarray:
    return t.gpu.detach().cpu().numpy().reshape(t.rows, t.cols)


def check(t: StagedWriteTensor, m: Model) -> None:
    np.testing.assert_array_equal(read(t), m.a)


def make(shape, dtype, tier, **kw):
    t = StagedWriteTensor(shape, dtype, device_of(tier), **kw)
    rows = shape if isinstance(shape, int) else shape[0]
    cols = 1 if isinstance(shape, int) else shape[1]
    return t, Model(rows, cols, dtype)


def apply_both(t: StagedWriteTensor, m: Model) -> None:
    t.apply_write()
    m.apply()
    check(t, m)


def stage_both(t, m, index, start, values):
    t.stage_write(index, start, values)
    m.stage(index, start, values)


# --- basic behaviour on the CPU tiers ------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_ragged_multi_row_writes(cpu_tier, dtype):
    t, m = make((6, 33), dtype, cpu_tier)
    assert t.tier is cpu_tier and t.kernel in ("torch", "triton")
    rng = np.random.default_rng(1)
    for row, start, n in [(0, 0, 33), (5, 3, 7), (2, 30, 3), (4, 1, 1), (1, 10, 20)]:
        stage_both(t, m, row, start, rng.integers(-1000, 1000, n))
    assert t.num_staged == 5
    np.testing.assert_array_equal(read(t), 0)  # nothing written before apply
    t.apply_write()
    assert t.num_staged == 0
    m.apply()
    check(t, m)
    stage_both(t, m, 5, 0, [9, 8, 7])  # a second batch keeps the first one's values
    apply_both(t, m)


def test_float_writes(cpu_tier):
    t, m = make((3, 9), torch.float32, cpu_tier)
    stage_both(t, m, 0, 2, [1.5, -2.25, 3e38, float("inf")])
    stage_both(t, m, 2, 0, np.linspace(0, 1, 9, dtype=np.float64))  # float64 input, float32 target
    stage_both(t, m, 1, 4, torch.tensor([7.0, 8.0]))
    stage_both(t, m, 1, 7, [1, 2])  # ints into a float target
    apply_both(t, m)


def test_nan_values_into_float(cpu_tier):
    t, _ = make((2, 4), torch.float32, cpu_tier)
    t.stage_write(1, 1, [float("nan"), 2.0])
    t.apply_write()
    got = read(t)
    assert math.isnan(got[1, 1]) and got[1, 2] == 2.0 and np.count_nonzero(got) == 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_single_elements(cpu_tier, dtype):
    t, m = make((5, 4), dtype, cpu_tier)
    value = 3.5 if dtype.is_floating_point else 7
    for i, v in [(0, value), (4, -1), (2, np.int64(5)), (2, value)]:
        t.stage_write_elem(i, v)
        m.stage(i, 0, [v])
    t.stage_write_elem(3, torch.tensor(11))  # 0-d tensor
    m.stage(3, 0, [11])
    apply_both(t, m)


def test_int_extremes(cpu_tier):
    t, m = make((2, 3), torch.int64, cpu_tier)
    stage_both(t, m, 0, 0, [2**63 - 1, -(2**63), 0])
    t.stage_write_elem(1, 2**62)
    m.stage(1, 0, [2**62])
    apply_both(t, m)
    t32, m32 = make((1, 2), torch.int32, cpu_tier)
    stage_both(t32, m32, 0, 0, np.array([2**31 - 1, -(2**31)], dtype=np.int64))
    apply_both(t32, m32)


def test_empty_writes_are_no_ops(cpu_tier):
    t, m = make((3, 5), torch.int32, cpu_tier)
    for values in ([], (), np.empty(0, np.int64), torch.empty(0), iter(())):
        t.stage_write(1, 2, values)
    t.stage_write(2, 5, [])  # an empty edit may start at the end of the row
    assert t.num_staged == 0
    t.apply_write()
    assert t.stats()["steps"] == 0 and t.stats()["transfers"] == 0
    stage_both(t, m, 0, 1, [4, 5])
    t.stage_write(0, 0, [])
    apply_both(t, m)


def test_overlapping_writes_apply_in_staging_order(cpu_tier):
    t, m = make((3, 40), torch.int32, cpu_tier)
    stage_both(t, m, 1, 0, np.arange(40) + 100)
    stage_both(t, m, 1, 5, np.arange(10) + 200)  # inside the first
    stage_both(t, m, 2, 0, [1, 1, 1])
    stage_both(t, m, 1, 12, np.arange(20) + 300)  # overlaps the second's tail
    stage_both(t, m, 1, 0, [7])
    stage_both(t, m, 1, 39, [9])
    stage_both(t, m, 2, 1, [2])
    stage_both(t, m, 1, 5, np.arange(3) + 400)
    apply_both(t, m)
    assert read(t)[1, 5] == 400 and read(t)[1, 14] == 302 and read(t)[1, 39] == 9


def test_many_overlaps_on_one_row(cpu_tier):
    t, m = make((2, 64), torch.int64, cpu_tier)
    rng = np.random.default_rng(7)
    for k in range(60):
        start = int(rng.integers(0, 60))
        n = int(rng.integers(1, 64 - start + 1))
        stage_both(t, m, 1, start, np.full(n, k))
    apply_both(t, m)


def test_one_d_target(cpu_tier):
    t, m = make(10, torch.int64, cpu_tier)
    assert t.gpu.shape == (10,) and t.cols == 1
    for i, v in [(3, 30), (0, 1), (9, 99), (3, 31)]:
        t.stage_write_elem(i, v)
        m.stage(i, 0, [v])
    stage_both(t, m, 5, 0, [55])
    t.stage_write(6, 1, [])  # empty, at the end of a one-column row
    apply_both(t, m)
    assert t.gpu[3].item() == 31
    with pytest.raises(ValueError, match="past the end"):
        t.stage_write(2, 0, [1, 2])
    with pytest.raises(ValueError, match="past the end"):
        t.stage_write(2, 1, [1])


def test_inputs_are_copied_when_staged(cpu_tier):
    t, m = make((2, 4), torch.int32, cpu_tier)
    src = np.array([1, 2, 3], dtype=np.int32)
    stage_both(t, m, 0, 0, src)
    src[:] = -5  # after staging: must not change what is applied
    apply_both(t, m)


def test_accepted_input_types(cpu_tier):
    t, m = make((6, 5), torch.int32, cpu_tier)
    stage_both(t, m, 0, 0, [1, 2])
    stage_both(t, m, 1, 0, (3, 4))
    stage_both(t, m, 2, 0, np.array([5, 6], dtype=np.int64))
    stage_both(t, m, 3, 0, torch.tensor([7, 8], dtype=torch.int16))
    t.stage_write(4, 0, (x for x in [9, 10]))
    m.stage(4, 0, [9, 10])
    t.stage_write(5, 0, range(5))
    m.stage(5, 0, list(range(5)))
    apply_both(t, m)


def test_clear_staged_writes(cpu_tier):
    t, m = make((2, 3), torch.int32, cpu_tier)
    t.stage_write(0, 0, [1, 2, 3])
    t.clear_staged_writes()
    assert t.num_staged == 0
    stage_both(t, m, 1, 1, [5])
    apply_both(t, m)


def test_gpu_keeps_its_address(cpu_tier):
    t, m = make((4, 8), torch.int32, cpu_tier)
    ptr = t.gpu.data_ptr()
    for k in range(5):
        stage_both(t, m, k % 4, 0, np.full(8 if k % 2 else 1, k))
        t.apply_write()
    assert t.gpu.data_ptr() == ptr
    m.apply()
    check(t, m)


# --- bad edits ---------------------------------------------------------------------

BAD_EDITS = [
    ("index", (4, 0, [1])),
    ("index", (-1, 0, [1])),
    ("index", (True, 0, [1])),
    ("index", (1.0, 0, [1])),
    ("index", ("1", 0, [1])),
    ("index", (None, 0, [1])),
    ("index", (4, 0, [])),  # empty edits are checked too
    ("start", (0, -1, [1])),
    ("start", (0, False, [1])),
    ("start", (0, 0.5, [1])),
    ("past the end", (0, 9, [])),
    ("past the end", (0, 6, [1, 2, 3])),
    ("past the end", (3, 0, list(range(9)))),
    ("fractional", (0, 0, [1, 1.5])),
    ("NaN or inf", (0, 0, [float("nan")])),
    ("NaN or inf", (0, 0, np.array([1.0, np.inf]))),
    ("outside", (0, 0, [2**31])),
    ("outside", (0, 0, np.array([-(2**31) - 1], dtype=np.int64))),
    ("rank", (0, 0, [[1, 2]])),
]
BAD_TYPES = [
    (0, 0, [True, False]),  # bools are not numbers here
    (0, 0, ["a"]),
    (0, 0, 5),
    (0, 0, {"a": 1}),
]


def _staged_before(tier):
    t, m = make((4, 8), torch.int32, tier)
    stage_both(t, m, 1, 2, [11, 12, 13])
    stage_both(t, m, 3, 0, [21])
    return t, m


@pytest.mark.parametrize(("match", "edit"), BAD_EDITS, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD_EDITS)])
def test_bad_edit_rejected_earlier_edits_kept(cpu_tier, match, edit):
    t, m = _staged_before(cpu_tier)
    with pytest.raises(ValueError, match=match):
        t.stage_write(*edit)
    assert t.num_staged == 2
    np.testing.assert_array_equal(read(t), 0)  # nothing written
    apply_both(t, m)  # the earlier edits, and nothing of the bad one


@pytest.mark.parametrize("edit", BAD_TYPES, ids=range(len(BAD_TYPES)))
def test_bad_value_types_rejected(cpu_tier, edit):
    t, m = _staged_before(cpu_tier)
    with pytest.raises((TypeError, ValueError)):
        t.stage_write(*edit)
    assert t.num_staged == 2
    apply_both(t, m)


@pytest.mark.parametrize(("index", "value", "exc"), [
    (4, 1, ValueError), (-1, 1, ValueError), (0, 1.5, ValueError), (0, 2**40, ValueError),
    (0, float("inf"), ValueError), (0, True, TypeError), (0, [1, 2], ValueError), (0, "x", TypeError),
])
def test_bad_elem_rejected(cpu_tier, index, value, exc):
    t, m = _staged_before(cpu_tier)
    with pytest.raises(exc):
        t.stage_write_elem(index, value)
    assert t.num_staged == 2
    apply_both(t, m)


def test_bad_float_values(cpu_tier):
    t, m = make((2, 4), torch.float32, cpu_tier)
    stage_both(t, m, 0, 0, [1.0])
    with pytest.raises(ValueError, match="range"):
        t.stage_write(1, 0, [1e39])
    with pytest.raises(ValueError, match="range"):
        t.stage_write_elem(1, -1e39)
    apply_both(t, m)


def test_bad_int64_values(cpu_tier):
    t, m = make((2, 4), torch.int64, cpu_tier)
    with pytest.raises(ValueError):
        t.stage_write(0, 0, [2**63])
    with pytest.raises(ValueError):
        t.stage_write(0, 0, [2.0**63])  # == 2**63 in float: one past the range, must not wrap
    with pytest.raises(ValueError):
        t.stage_write(0, 0, np.array([2.0**63], np.float32))
    with pytest.raises(ValueError):
        t.stage_write(0, 0, [-(2.0**63) - 4096])
    stage_both(t, m, 0, 0, [-(2.0**63), 2.0**62])  # in range: exact
    assert t.num_staged == 1
    apply_both(t, m)


def test_float_one_past_int32_range(cpu_tier):
    t, m = make((1, 4), torch.int32, cpu_tier)
    for bad in ([2.0**31], np.array([2.0**31], np.float32), torch.tensor([2.0**31]), [-(2.0**31) - 1]):
        with pytest.raises(ValueError, match="range"):
            t.stage_write(0, 0, bad)
    with pytest.raises(ValueError):
        t.stage_write_elem(0, 2.0**31)
    stage_both(t, m, 0, 0, np.array([-(2.0**31), 2.0**30], np.float32))
    apply_both(t, m)


def test_zero_row_target_rejects_every_index(cpu_tier):
    t, _ = make((0, 4), torch.int32, cpu_tier)
    with pytest.raises(ValueError, match="0 rows"):
        t.stage_write(0, 0, [])
    t.apply_write()


@pytest.mark.parametrize("dtype", [torch.float64, torch.int16, torch.bool, torch.uint8, "complex64", "nope"])
def test_unsupported_dtype(dtype):
    with pytest.raises(ValueError, match="int32, int64, float32"):
        StagedWriteTensor((2, 2), dtype, "cpu")


def test_dtype_by_name():
    assert StagedWriteTensor((1, 1), "int32", "cpu").dtype == torch.int32
    assert StagedWriteTensor((1, 1), np.float32, "cpu").dtype == torch.float32


@pytest.mark.parametrize("size", [(2, 3, 4), (-1, 2), (2.5, 2), ()])
def test_bad_size(size):
    with pytest.raises(ValueError):
        StagedWriteTensor(size, torch.int32, "cpu")


# --- transfers, kernel choice, uva_instead_of_gpu on the CPU tiers -----------------

def test_one_transfer_per_apply(cpu_tier):
    t, m = make((8, 300), torch.int32, cpu_tier)
    rng = np.random.default_rng(3)
    applies = 0
    for k in range(6):
        for _ in range(k * 3 + 1):
            row, start = int(rng.integers(0, 8)), int(rng.integers(0, 300))
            stage_both(t, m, row, start, rng.integers(0, 9, int(rng.integers(0, 300 - start + 1))))
        if k == 4:
            stage_both(t, m, 0, 0, np.arange(300))
        if t.num_staged:
            applies += 1
        t.apply_write()
    big = np.arange(8 * 300).reshape(8, 300)
    for r in range(8):
        stage_both(t, m, r, 0, big[r])
    t.apply_write()
    applies += 1
    m.apply()
    check(t, m)
    s = t.stats()
    assert s["steps"] == applies
    assert s["transfers"] == (applies if cpu_tier is stagebuf.Tier.PAGEABLE else 0)


def test_growth_still_one_transfer_per_apply(cpu_tier):
    t, m = make((2, 200_000), torch.int32, cpu_tier)
    stage_both(t, m, 1, 0, np.arange(200_000))
    t.apply_write()
    stage_both(t, m, 0, 5, np.arange(100))
    apply_both(t, m)
    s = t.stats()
    assert s["growths"] >= 1
    assert s["transfers"] == (2 if cpu_tier is stagebuf.Tier.PAGEABLE else 0)


def test_kernel_is_torch_on_cpu_without_interpreter(cpu_tier, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    t, _ = make((2, 2), torch.int32, cpu_tier)
    t.stage_write_elem(0, 1)
    t.apply_write()
    assert t.kernel == "torch"


def test_uva_instead_of_gpu_falls_back_on_cpu_tiers(cpu_tier, caplog):
    with caplog.at_level(logging.WARNING, logger="stagebuf"):
        t, m = make((3, 4), torch.int32, cpu_tier, uva_instead_of_gpu=True)
        t2, _ = make((3, 4), torch.int32, cpu_tier, uva_instead_of_gpu=True)
    said = [r for r in caplog.records if "uva_instead_of_gpu" in r.getMessage()]
    assert len(said) == 1 and cpu_tier.name in said[0].getMessage()
    assert not t.in_host_memory and not t2.in_host_memory
    assert t.gpu.device.type == "cpu"
    stage_both(t, m, 2, 1, [1, 2, 3])
    apply_both(t, m)


def test_million_element_write_cpu(cpu_tier):
    n = 1_000_000
    t, m = make((2, n), torch.int32, cpu_tier)
    vals = np.arange(n, dtype=np.int32)
    t0 = time.perf_counter()
    t.stage_write(1, 0, vals)
    staged_s = time.perf_counter() - t0
    print(f"\n[{cpu_tier.name}] staging a {n}-element int32 write took {staged_s * 1e3:.3f} ms on the host")
    m.stage(1, 0, vals)
    apply_both(t, m)
    assert t.stats()["transfers"] == (1 if cpu_tier is stagebuf.Tier.PAGEABLE else 0)


# --- fused writer ------------------------------------------------------------------

def test_fused_writer_different_row_lengths(cpu_tier):
    dev = device_of(cpu_tier)
    shapes = [(4, 16), (4, 7), (3, 100), 5]
    ts, ms = [], []
    for s in shapes:
        t, m = make(s, torch.int32, cpu_tier)
        ts.append(t)
        ms.append(m)
    rng = np.random.default_rng(11)
    w = FusedStagedWriter(dev, max_writes=4)
    for _ in range(4):
        for t, m in zip(ts, ms):
            for _ in range(int(rng.integers(0, 5))):
                row = int(rng.integers(0, t.rows))
                start = int(rng.integers(0, t.cols + 1))
                stage_both(t, m, row, start, rng.integers(-50, 50, int(rng.integers(0, t.cols - start + 1))))
        w.apply(ts)
        for t, m in zip(ts, ms):
            m.apply()
            assert t.num_staged == 0
            check(t, m)
    assert w.kernel in ("torch", "triton")
    s = w.stats()
    assert s["transfers"] == (s["steps"] if cpu_tier is stagebuf.Tier.PAGEABLE else 0)
    assert all(t.stats()["steps"] == 0 for t in ts)  # the tensors' own stagers were not used


def test_fused_writer_one_transfer_per_apply(cpu_tier):
    dev = device_of(cpu_tier)
    a, ma = make((2, 50_000), torch.float32, cpu_tier)
    b, mb = make((3, 5), torch.float32, cpu_tier)
    w = FusedStagedWriter(dev, max_writes=2)
    for k in range(3):
        stage_both(a, ma, k % 2, 0, np.full(50_000, k, np.float32))
        stage_both(b, mb, k, 1, [k, k + 0.5])
        stage_both(b, mb, k, 2, [-k])
        w.apply([a, b])
    ma.apply()
    mb.apply()
    check(a, ma)
    check(b, mb)
    s = w.stats()
    assert s["steps"] == 3
    assert s["transfers"] == (3 if cpu_tier is stagebuf.Tier.PAGEABLE else 0)
    assert w.max_writes == 4 and s["edit_growths"] == 1


def test_fused_writer_rejects_mixed_dtypes_and_keeps_edits(cpu_tier):
    dev = device_of(cpu_tier)
    a, ma = make((2, 3), torch.int32, cpu_tier)
    b, _ = make((2, 3), torch.int64, cpu_tier)
    stage_both(a, ma, 0, 0, [1])
    b.stage_write(1, 0, [2])
    w = FusedStagedWriter(dev, max_writes=8)
    with pytest.raises(ValueError, match="dtype"):
        w.apply([a, b])
    assert a.num_staged == 1 and b.num_staged == 1
    np.testing.assert_array_equal(read(a), 0)
    with pytest.raises(TypeError):
        w.apply([a, torch.zeros(3)])
    for bad in (None, a, 3):
        with pytest.raises(TypeError, match="tensors"):
            w.apply(bad)
    assert a.num_staged == 1
    w.apply([a, a])  # a tensor listed twice is applied once
    ma.apply()
    check(a, ma)


def test_fused_writer_nothing_staged(cpu_tier):
    dev = device_of(cpu_tier)
    a, _ = make((2, 3), torch.int32, cpu_tier)
    w = FusedStagedWriter(dev, max_writes=8)
    w.apply([a])
    w.apply([])
    assert w.stats()["steps"] == 0 and w.stats()["transfers"] == 0


@pytest.mark.parametrize("max_writes", [0, -1, True, 1.5])
def test_fused_writer_bad_max_writes(max_writes):
    with pytest.raises(ValueError, match="max_writes"):
        FusedStagedWriter("cpu", max_writes)


@pytest.mark.parametrize("max_concurrency", [0, -2, True, 2.0, "2"])
def test_bad_max_concurrency(max_concurrency):
    with pytest.raises(ValueError, match="max_concurrency"):
        StagedWriteTensor((2, 2), torch.int32, "cpu", max_concurrency=max_concurrency)
    with pytest.raises(ValueError, match="max_concurrency"):
        FusedStagedWriter("cpu", 4, max_concurrency=max_concurrency)


def test_max_concurrency_slots_round_robin(cpu_tier):
    t, m = make((3, 6), torch.int32, cpu_tier, max_concurrency=3)
    for k in range(7):  # more applies than slots: every slot is reused
        stage_both(t, m, k % 3, k % 4, [k, k + 1])
        apply_both(t, m)
    assert t.stats()["steps"] == 7


# --- random edit streams against the model -------------------------------------------

BAD_KINDS = ["row_high", "row_neg", "start_neg", "too_long", "fraction", "range"]


@st.composite
def edit_streams(draw):
    dtype = draw(st.sampled_from(DTYPES))
    one_d = draw(st.booleans())
    rows = draw(st.integers(1, 6))
    cols = 1 if one_d else draw(st.integers(1, 40))
    ops = draw(st.lists(
        st.tuples(
            st.sampled_from(["write"] * 6 + ["elem", "bad", "apply", "apply", "clear"]),
            st.integers(0, 1000), st.integers(0, 1000), st.integers(0, 50),
            st.integers(0, 2**32 - 1), st.sampled_from(BAD_KINDS),
        ),
        max_size=40,
    ))
    return dtype, one_d, rows, cols, ops


def _values(dtype: torch.dtype, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype.is_floating_point:
        return rng.standard_normal(n).astype(np.float32) * 1e3
    info = np.iinfo(NP[dtype])
    return rng.integers(info.min, info.max, n, dtype=NP[dtype], endpoint=True)


def run_stream(t: StagedWriteTensor, m: Model, ops) -> None:
    rows, cols = t.rows, t.cols
    integer = not t.dtype.is_floating_point
    for kind, a, b, n, seed, bad in ops:
        row, start = a % rows, b % (cols + 1)
        if kind == "write":
            stage_both(t, m, row, start, _values(t.dtype, min(n, cols - start), seed))
        elif kind == "elem":
            v = _values(t.dtype, 1, seed)[0].item()
            t.stage_write_elem(row, v)
            m.stage(row, 0, [v])
        elif kind == "bad":
            before = t.num_staged
            args = {
                "row_high": (rows + a % 3, 0, [1]),
                "row_neg": (-1 - a % 3, 0, [1]),
                "start_neg": (row, -1 - b % 3, [1]),
                "too_long": (row, start, [1] * (cols - start + 1 + n % 3)),
                "fraction": (row, 0, [0.5] if integer else [1e39]),
                "range": (row, 0, [2**63] if integer else [-3e39]),
            }[bad]
            with pytest.raises((ValueError, TypeError)):
                t.stage_write(*args)
            assert t.num_staged == before
        elif kind == "apply":
            t.apply_write()
            m.apply()
            check(t, m)
        else:
            t.clear_staged_writes()
            m.pending.clear()
    t.apply_write()
    m.apply()
    check(t, m)


@examples(40)
@given(stream=edit_streams())
def test_random_edit_streams(cpu_tier, stream):
    dtype, one_d, rows, cols, ops = stream
    t, m = make(rows if one_d else (rows, cols), dtype, cpu_tier)
    run_stream(t, m, ops)


def run_fused_stream(data, w, pairs, dtype, max_start: int, max_len: int) -> None:
    """Random rounds of edits to every (tensor, model) pair, each round applied by ``w`` and checked."""
    edit = st.tuples(st.integers(0, 99), st.integers(0, max_start), st.integers(0, max_len),
                     st.integers(0, 999))
    for _ in range(data.draw(st.integers(1, 4))):
        for t, m in pairs:
            for a, b, n, seed in data.draw(st.lists(edit, max_size=6)):
                row, start = a % t.rows, b % (t.cols + 1)
                stage_both(t, m, row, start, _values(dtype, min(n, t.cols - start), seed))
        w.apply([t for t, _ in pairs])
        for t, m in pairs:
            m.apply()
            check(t, m)


@examples(25)
@given(data=st.data())
def test_random_fused_streams(cpu_tier, data):
    dtype = data.draw(st.sampled_from(DTYPES))
    shape = st.one_of(st.integers(1, 5), st.tuples(st.integers(1, 5), st.integers(1, 30)))
    shapes = data.draw(st.lists(shape, min_size=1, max_size=4))
    pairs = [make(s, dtype, cpu_tier) for s in shapes]
    w = FusedStagedWriter(device_of(cpu_tier), max_writes=data.draw(st.integers(1, 8)))
    run_fused_stream(data, w, pairs, dtype, max_start=99, max_len=40)


# --- GPU: the same checks on UVA, PINNED and PAGEABLE ---------------------------------

HAS_TRITON = True
try:
    import triton  # noqa: F401
except Exception:
    HAS_TRITON = False


@pytest.mark.gpu
@examples(30)
@given(stream=edit_streams())
def test_gpu_random_edit_streams(gpu_tier, stream):
    dtype, one_d, rows, cols, ops = stream
    t = StagedWriteTensor(rows if one_d else (rows, cols), dtype, "cuda")
    assert t.tier is gpu_tier and t.gpu.device.type == "cuda"
    assert t.kernel == ("triton" if HAS_TRITON else "torch")
    run_stream(t, Model(rows, cols, dtype), ops)


@pytest.mark.gpu
@examples(15)
@given(data=st.data())
def test_gpu_random_fused_streams(gpu_tier, data):
    dtype = data.draw(st.sampled_from(DTYPES))
    shapes = data.draw(st.lists(st.tuples(st.integers(1, 5), st.integers(1, 3000)), min_size=1, max_size=4))
    pairs = [(StagedWriteTensor(s, dtype, "cuda"), Model(*s, dtype)) for s in shapes]
    w = FusedStagedWriter("cuda", max_writes=4)
    run_fused_stream(data, w, pairs, dtype, max_start=5000, max_len=3000)
    s = w.stats()
    assert s["transfers"] == (0 if gpu_tier is stagebuf.Tier.UVA else s["steps"])


@pytest.mark.gpu
def test_gpu_heavy_overlaps_long_row(gpu_tier):
    """Many overlapping edits on a row spanning many kernel tiles: later must win, no races."""
    t = StagedWriteTensor((3, 10_000), torch.int32, "cuda")
    m = Model(3, 10_000, torch.int32)
    rng = np.random.default_rng(5)
    for _ in range(5):
        for k in range(200):
            start = int(rng.integers(0, 10_000))
            n = int(rng.integers(1, 10_000 - start + 1))
            stage_both(t, m, int(rng.integers(0, 3)), start, np.full(n, k, np.int32))
        t.apply_write()
        m.apply()
        check(t, m)


@pytest.mark.gpu
def test_gpu_one_transfer_per_apply(gpu_tier):
    t = StagedWriteTensor((16, 4096), torch.int64, "cuda")
    m = Model(16, 4096, torch.int64)
    rng = np.random.default_rng(2)
    for k in range(8):
        for _ in range(4 * k + 1):
            start = int(rng.integers(0, 4096))
            stage_both(t, m, int(rng.integers(0, 16)), start, rng.integers(0, 10**12, 4096 - start))
        t.apply_write()
    m.apply()
    check(t, m)
    s = t.stats()
    assert s["steps"] == 8
    assert s["transfers"] == (0 if gpu_tier is stagebuf.Tier.UVA else 8)


@pytest.mark.gpu
def test_gpu_uva_instead_of_gpu(gpu_tier, caplog):
    with caplog.at_level(logging.WARNING, logger="stagebuf"):
        t = StagedWriteTensor((64, 1000), torch.int32, "cuda", uva_instead_of_gpu=True)
    m = Model(64, 1000, torch.int32)
    said = [r for r in caplog.records if "uva_instead_of_gpu" in r.getMessage()]
    if gpu_tier is stagebuf.Tier.UVA:
        assert t.in_host_memory and t.uva_buffer is not None and not said
    else:
        assert not t.in_host_memory and len(said) == 1
    assert t.gpu.device.type == "cuda"
    rng = np.random.default_rng(9)
    for _ in range(3):
        for _ in range(20):
            start = int(rng.integers(0, 1000))
            stage_both(t, m, int(rng.integers(0, 64)), start, rng.integers(0, 10**6, 1000 - start))
        t.apply_write()
        m.apply()
        check(t, m)
    if t.in_host_memory:
        torch.cuda.synchronize()
        np.testing.assert_array_equal(t.uva_buffer.np, m.a)  # the kernel wrote host memory


@pytest.mark.gpu
def test_gpu_million_element_write(gpu_tier):
    n = 1_000_000
    t = StagedWriteTensor((2, n), torch.int32, "cuda")
    m = Model(2, n, torch.int32)
    vals = np.random.default_rng(0).integers(0, 2**31 - 1, n, dtype=np.int32)
    t0 = time.perf_counter()
    t.stage_write(1, 0, vals)
    staged_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    t.apply_write()
    applied_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    print(f"\n[{gpu_tier.name}] {n}-element int32 write: staging {staged_s * 1e3:.3f} ms, "
          f"apply (host side) {applied_s * 1e3:.3f} ms")
    m.stage(1, 0, vals)
    m.apply()
    check(t, m)
    s = t.stats()
    assert s["steps"] == 1
    assert s["transfers"] == (0 if gpu_tier is stagebuf.Tier.UVA else 1)
