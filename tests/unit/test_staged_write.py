"""StagedWriteTensor and FusedStagedWriter against a numpy model, on every tier this machine runs.

The model (``Model``) applies edits one by one in staging order with numpy
slicing; it never calls stagebuf. List values are checked at ``apply_write()``
(a bad one raises ``StagedWriteError`` naming the edit, writes nothing and keeps
every edit staged); everything else is checked when staged.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stagebuf
from helpers import force_tier
from stagebuf import FusedStagedWriter, StagedWriteError, StagedWriteTensor
from stagebuf._rings.staged_write import kernel as sw_kernel
from stagebuf._tiers.settings import ENV_KERNEL

NP = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32}
DTYPES = [torch.int32, torch.int64, torch.float32]
HOST = stagebuf.Tier.HOST

HAS_TRITON = True
try:
    import triton  # noqa: F401
except Exception:
    HAS_TRITON = False


def examples(n: int) -> settings:
    """n examples, no deadline, and the tier fixture (constant across examples) allowed."""
    return settings(
        max_examples=n, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
    )


@pytest.fixture(autouse=True)
def _auto_kernel(monkeypatch):
    """Each test starts with the kernel chosen per batch and no Triton interpreter (tests force them)."""
    monkeypatch.delenv(ENV_KERNEL, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


class Model:
    """The numpy model: edits applied one by one, in staging order.

    ``pending`` holds (index, start, values, bad): the values as the target dtype, or
    for a bad edit (refused at apply) the raw list.
    """

    def __init__(self, rows: int, cols: int, dtype: torch.dtype):
        self.a = np.zeros((rows, cols), NP[dtype])
        self.pending: list[tuple[int, int, Any, bool]] = []

    def stage(self, index: int, start: int, values) -> None:
        if isinstance(values, torch.Tensor):
            values = values.numpy()
        v = np.array(values, dtype=self.a.dtype).reshape(-1)
        if v.size:
            self.pending.append((index, start, v, False))

    def stage_bad(self, index: int, start: int, raw: list) -> None:
        self.pending.append((index, start, list(raw), True))

    def stage_many(self, rows, starts, values, lengths=None) -> None:
        v = np.asarray(values, dtype=self.a.dtype)
        if lengths is None:
            chunks = [v[i].reshape(-1) for i in range(len(rows))]
        else:
            ends = np.cumsum(lengths)
            chunks = [v[e - n : e] for e, n in zip(ends, lengths)]
        for r, s, c in zip(rows, starts, chunks):
            self.stage(int(r), int(s), c)

    def first_bad(self) -> int | None:
        return next((i for i, p in enumerate(self.pending) if p[3]), None)

    def good(self) -> list[tuple[int, int, np.ndarray]]:
        return [(i, s, v) for i, s, v, bad in self.pending if not bad]

    def apply(self) -> None:
        assert self.first_bad() is None
        for i, s, v, _ in self.pending:
            self.a[i, s : s + len(v)] = v
        self.pending.clear()


def device_of(tier: stagebuf.Tier) -> str:
    """The device the CPU tiers target (HOST, and PAGEABLE copying into a CPU tensor)."""
    return "cpu"


def read(t: StagedWriteTensor) -> np.ndarray:
    return t.gpu.detach().cpu().numpy().reshape(t.rows, t.cols)


def check(t: StagedWriteTensor, m: Model) -> None:
    np.testing.assert_array_equal(read(t), m.a)


def check_pending(t: StagedWriteTensor, m: Model) -> None:
    """``num_staged`` and ``pending_writes()`` list the model's pending edits, in order."""
    got = t.pending_writes()
    assert t.num_staged == len(got) == len(m.pending)
    for k, ((r, s, vals), (mr, ms, mv, bad)) in enumerate(zip(got, m.pending)):
        assert (r, s) == (mr, ms), f"pending edit {k}"
        assert isinstance(vals, list) and len(vals) == len(mv)
        if bad:
            assert repr(vals) == repr(mv)
        else:
            np.testing.assert_array_equal(np.array(vals, dtype=m.a.dtype), mv)


def make(shape, dtype, tier, dev: str | None = None, **kw):
    t = StagedWriteTensor(shape, dtype, dev or device_of(tier), **kw)
    rows = shape if isinstance(shape, int) else shape[0]
    cols = 1 if isinstance(shape, int) else shape[1]
    return t, Model(rows, cols, dtype)


def apply_both(t: StagedWriteTensor, m: Model) -> None:
    t.apply_write()
    m.apply()
    assert t.num_staged == 0 and t.pending_writes() == []
    check(t, m)


def stage_both(t, m, index, start, values):
    t.stage_write(index, start, values)
    m.stage(index, start, values)


def stage_many_both(t, m, rows, starts, values, lengths=None):
    t.stage_writes(rows, starts, values, lengths)
    m.stage_many(rows, starts, values, lengths)


def apply_fails(t: StagedWriteTensor, m: Model, match: str | None = None) -> StagedWriteError:
    """apply_write() raises naming the model's first bad edit; nothing written, everything still staged."""
    pos = m.first_bad()
    assert pos is not None
    index, start = m.pending[pos][:2]
    before, stats, pending = read(t).copy(), t.stats(), repr(t.pending_writes())
    with pytest.raises(StagedWriteError, match=match) as ei:
        t.apply_write()
    err = ei.value
    assert isinstance(err, ValueError)
    assert (err.position, err.index, err.start) == (pos, index, start)
    assert f"staged edit {pos} (stage_write(index={index}, start={start}," in str(err)
    np.testing.assert_array_equal(read(t), before)
    check(t, m)
    assert t.stats() == stats  # not even a staging step
    assert repr(t.pending_writes()) == pending
    check_pending(t, m)
    return err


def restage_good(t: StagedWriteTensor, m: Model) -> None:
    """The caller's recovery: drop everything, stage the good edits again."""
    good = m.good()
    t.clear_staged_writes()
    m.pending.clear()
    assert t.num_staged == 0 and t.pending_writes() == []
    for k, (i, s, v) in enumerate(good):
        stage_both(t, m, i, s, v.tolist() if k % 2 else v)


def _values(dtype: torch.dtype, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype.is_floating_point:
        return rng.standard_normal(n).astype(np.float32) * 1e3
    info = np.iinfo(NP[dtype])
    return rng.integers(info.min, info.max, n, dtype=NP[dtype], endpoint=True)


# --- basic behaviour on the CPU tiers ------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_ragged_multi_row_writes(cpu_tier, dtype):
    t, m = make((6, 33), dtype, cpu_tier)
    assert t.tier is cpu_tier and t.kernel == ("host" if cpu_tier is HOST else "scatter")
    rng = np.random.default_rng(1)
    for row, start, n in [(0, 0, 33), (5, 3, 7), (2, 30, 3), (4, 1, 1), (1, 10, 20)]:
        stage_both(t, m, row, start, rng.integers(-1000, 1000, n))
    assert t.num_staged == 5
    check_pending(t, m)
    np.testing.assert_array_equal(read(t), 0)  # nothing written before apply
    apply_both(t, m)
    stage_both(t, m, 5, 0, [9, 8, 7])  # a second batch keeps the first one's values
    apply_both(t, m)


def test_attributes(cpu_tier):
    t = StagedWriteTensor((7, 3), "int64", max_concurrency=3)  # device=None: the accelerator, else CPU
    assert t.device == stagebuf.capabilities().device
    assert (t.num_rows, t.rows, t.cols, t.max_concurrency) == (7, 7, 3, 3)
    assert StagedWriteTensor(4, torch.int32, "cpu").max_concurrency >= 2  # the resolved default
    assert "staged=0" in repr(t)


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
    for i, v in [(0, value), (4, -1), (2, np.int64(5)), (2, value), (1, 2.0)]:
        t.stage_write_elem(i, v)
        m.stage(i, 0, [v])
    t.stage_write_elem(3, torch.tensor(11))  # 0-d tensor
    m.stage(3, 0, [11])
    check_pending(t, m)
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


def test_int64_list_values_stay_exact_next_to_float_values(cpu_tier):
    """Ints past 2**53 and floats in one apply: each int is written exactly (not through float64)."""
    t, m = make((4, 3), torch.int64, cpu_tier)
    stage_both(t, m, 0, 0, [2**62 + 1, 2**63 - 1, -(2**63) + 3])
    stage_both(t, m, 1, 0, [1.0, -2.0])
    t.stage_write_elem(2, 2**53 + 1)
    m.stage(2, 0, [2**53 + 1])
    t.stage_write_elem(3, 4.0)
    m.stage(3, 0, [4])
    stage_both(t, m, 3, 1, [2**60 + 7, 3.0])  # one edit mixing them
    apply_both(t, m)
    assert read(t)[0, 0] == 2**62 + 1 and read(t)[0, 1] == 2**63 - 1


def test_bools_mixed_with_ints_are_ints(cpu_tier):
    """A list mixing bools with numbers is read as numbers (as Python, numpy and torch read it)."""
    t, m = make((3, 4), torch.int32, cpu_tier)
    stage_both(t, m, 0, 0, [True, 2, False])
    stage_both(t, m, 1, 1, [0, 1, True])
    stage_both(t, m, 2, 0, [0, 1])  # 0/1 ints are ints
    apply_both(t, m)
    tf, mf = make((1, 3), torch.float32, cpu_tier)
    stage_both(tf, mf, 0, 0, [False, 0.5, True])
    apply_both(tf, mf)


def test_empty_writes_are_no_ops(cpu_tier):
    t, m = make((3, 5), torch.int32, cpu_tier)
    for values in ([], (), np.empty(0, np.int64), torch.empty(0), iter(())):
        t.stage_write(1, 2, values)
    t.stage_write(2, 5, [])  # an empty edit may start at the end of the row
    t.stage_writes([0, 2], [5, 0], np.zeros((2, 0), np.int32))
    t.stage_writes(np.array([], np.int64), [], np.zeros(0, np.int32))
    assert t.num_staged == 0 and t.pending_writes() == []
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
        stage_both(t, m, 1, start, np.full(n, k) if k % 2 else [k] * n)
    apply_both(t, m)


def test_one_d_target(cpu_tier):
    t, m = make(10, torch.int64, cpu_tier)
    assert t.gpu.shape == (10,) and t.cols == 1
    for i, v in [(3, 30), (0, 1), (9, 99), (3, 31)]:
        t.stage_write_elem(i, v)
        m.stage(i, 0, [v])
    stage_both(t, m, 5, 0, [55])
    t.stage_write(6, 1, [])  # empty, at the end of a one-column row
    stage_many_both(t, m, [7, 8, 7], [0, 0, 0], np.array([70, 80, 71]))
    apply_both(t, m)
    assert t.gpu[3].item() == 31 and t.gpu[7].item() == 71
    with pytest.raises(ValueError, match="past the end"):
        t.stage_write(2, 0, [1, 2])
    with pytest.raises(ValueError, match="past the end"):
        t.stage_write(2, 1, [1])


def test_inputs_are_copied_when_staged(cpu_tier):
    t, m = make((3, 4), torch.int32, cpu_tier)
    src = np.array([1, 2, 3], dtype=np.int32)
    lst = [4, 5]
    stage_both(t, m, 0, 0, src)
    stage_both(t, m, 1, 0, lst)
    batch = np.array([[6, 7], [8, 9]], np.int32)
    stage_many_both(t, m, [2, 1], [0, 2], batch)
    src[:] = -5  # after staging: must not change what is applied
    batch[:] = -5
    lst[0] = -5  # a list too: its values were taken at staging
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
    stage_both(t, m, 5, 3, [np.int64(11), 12.0])  # numpy scalars and whole floats in a list
    apply_both(t, m)


def test_clear_staged_writes(cpu_tier):
    t, m = make((2, 3), torch.int32, cpu_tier)
    t.stage_write(0, 0, [1, 2, 3])
    t.stage_writes([1], [0], [[4, 5, 6]])
    t.clear_staged_writes()
    assert t.num_staged == 0 and t.pending_writes() == []
    stage_both(t, m, 1, 1, [5])
    apply_both(t, m)


def test_gpu_keeps_its_address(cpu_tier):
    t, m = make((4, 8), torch.int32, cpu_tier)
    ptr = t.gpu.data_ptr()
    for k in range(5):
        stage_both(t, m, k % 4, 0, np.full(8 if k % 2 else 1, k))
        t.apply_write()
        m.apply()
    assert t.gpu.data_ptr() == ptr
    check(t, m)


# --- bad edits refused when staged (row, columns, non-list values) -------------------

STAGE_BAD = [
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
    ("past the end", (3, 0, [1.5] * 9)),  # the columns are checked at once, whatever the values
    ("NaN or inf", (0, 0, np.array([1.0, np.inf]))),
    ("fractional", (0, 0, (1, 1.5))),  # a tuple is checked now
    ("fractional", (0, 0, np.array([0.25]))),
    ("outside", (0, 0, np.array([-(2**31) - 1], dtype=np.int64))),
    ("outside", (0, 0, torch.tensor([2**40]))),
    ("rank", (0, 0, np.zeros((1, 2), np.int32))),
    ("bools and numbers", (0, 0, np.array([True]))),
    ("must be a", (0, 0, 5)),
    ("must be a", (0, 0, None)),
    ("must be a", (0, 0, "12")),
    ("must be a", (0, 0, {"a": 1})),
]


def _staged_before(tier):
    t, m = make((4, 8), torch.int32, tier)
    stage_both(t, m, 1, 2, [11, 12, 13])
    stage_both(t, m, 3, 0, np.array([21]))
    return t, m


@pytest.mark.parametrize(("match", "edit"), STAGE_BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(STAGE_BAD)])
def test_bad_edit_refused_when_staged(cpu_tier, match, edit):
    t, m = _staged_before(cpu_tier)
    with pytest.raises((ValueError, TypeError), match=match):
        t.stage_write(*edit)
    check_pending(t, m)  # the earlier edits, and nothing of the bad one
    np.testing.assert_array_equal(read(t), 0)  # nothing written
    apply_both(t, m)


@pytest.mark.parametrize(
    ("index", "value", "exc"),
    [
        (4, 1, ValueError),
        (-1, 1, ValueError),
        (True, 1, ValueError),
        (0, True, TypeError),
        (0, np.bool_(True), TypeError),
        (0, [1, 2], ValueError),
        ((0, 1), 1, ValueError),
        (0, "x", TypeError),
        (0, None, TypeError),
        (0, np.array([1, 2]), ValueError),
        (0, np.float64(1.5), ValueError),
        (0, torch.tensor(2**40), ValueError),
    ],
)
def test_bad_elem_refused_when_staged(cpu_tier, index, value, exc):
    t, m = _staged_before(cpu_tier)
    with pytest.raises(exc):
        t.stage_write_elem(index, value)
    check_pending(t, m)
    apply_both(t, m)


# --- bad list values: refused at apply, naming the edit; nothing written, all kept ---------

# (dtype, how it is staged, the raw value(s), what the message says)
APPLY_BAD = [
    (torch.int32, "list", [1, 1.5], "fractional"),
    (torch.int32, "list", [float("nan")], "NaN or inf"),
    (torch.int32, "list", [1, float("-inf")], "NaN or inf"),
    (torch.int32, "list", [2**31], "outside"),
    (torch.int32, "list", [-(2**31) - 1], "outside"),
    (torch.int32, "list", [2.0**31], "outside"),  # one past the range: must not wrap
    (torch.int32, "list", ["a"], "numpy reads as"),
    (torch.int32, "list", [1, "a"], "numpy reads as"),
    (torch.int32, "list", [1, None], "numpy reads as"),
    (
        torch.int32,
        "list",
        [2**70],
        r"values holds values in \[1180591620717411303424, .*outside int32.s range",
    ),
    (torch.int32, "list", [[1, 2]], "rank 2"),
    (torch.int32, "list", [True, False], "bools"),
    (torch.int32, "list", [True], "bools"),
    (torch.int64, "list", [2**63], "outside"),
    (torch.int64, "list", [2.0**63], "outside"),
    (torch.int64, "list", [-(2.0**63) - 4096], "outside"),
    (torch.int64, "list", [0.5, 2**62 + 1], "fractional"),
    (torch.float32, "list", [1e39], "beyond"),
    (torch.float32, "list", [1.0, -1e39], "beyond"),
    (torch.float32, "list", [False], "bools"),
    (torch.float32, "list", ["x"], "numpy reads as"),
    (torch.float32, "list", [[1.0]], "rank 2"),
    (torch.int32, "elem", 1.5, "fractional"),
    (torch.int32, "elem", 2**40, "outside"),
    (torch.int32, "elem", float("inf"), "NaN or inf"),
    (torch.int32, "elem", 2.0**31, "outside"),
    (torch.int64, "elem", 2**63, "outside"),
    (torch.int64, "elem", 2.0**63, "outside"),
    (torch.float32, "elem", -1e39, "beyond"),
]
APPLY_BAD_IDS = [
    f"{i}-{d}-{how}-{match}".replace("torch.", "") for i, (d, how, _, match) in enumerate(APPLY_BAD)
]


def stage_bad(t: StagedWriteTensor, m: Model, how: str, raw: Any, row: int = 3, start: int = 1) -> None:
    """Stage a bad value that only apply refuses (a list, or a Python scalar for stage_write_elem)."""
    if how == "elem":
        t.stage_write_elem(row, raw)
        m.stage_bad(row, 0, [raw])
    else:
        t.stage_write(row, start, raw)
        m.stage_bad(row, start, raw)


def bad_among_good(t: StagedWriteTensor, m: Model, how: str, raw: Any, match: str) -> None:
    """Good edits of every staging kind around one bad list edit: apply raises, nothing changes."""
    dtype = t.dtype
    stage_both(t, m, 0, 0, _values(dtype, 8, 1))  # a first apply: "unchanged" is not just zeros
    stage_both(t, m, 4, 3, _values(dtype, 5, 2).tolist())
    apply_both(t, m)
    stage_both(t, m, 1, 2, _values(dtype, 4, 3).tolist())  # edit 0: a list
    stage_many_both(t, m, [2, 0], [0, 4], _values(dtype, 8, 4).reshape(2, 4))  # edits 1, 2: a batch
    stage_both(t, m, 4, 1, tuple(_values(dtype, 3, 5).tolist()))  # edit 3: a tuple (checked now)
    stage_bad(t, m, how, raw)  # edit 4: the bad one
    t.stage_write_elem(4, _values(dtype, 1, 6)[0].item())  # edit 5
    m.stage(4, 0, _values(dtype, 1, 6))
    stage_both(t, m, 1, 0, _values(dtype, 8, 7).tolist())  # edit 6: overlaps edit 0 (later wins)
    stage_many_both(t, m, [3, 3], [0, 5], _values(dtype, 5, 8), lengths=[2, 3])  # edits 7, 8
    check_pending(t, m)
    apply_fails(t, m, match)
    apply_fails(t, m, match)  # a retry raises the same: everything is still staged
    restage_good(t, m)
    apply_both(t, m)


@pytest.mark.parametrize(("dtype", "how", "raw", "match"), APPLY_BAD, ids=APPLY_BAD_IDS)
def test_bad_list_edit_refused_at_apply(cpu_tier, dtype, how, raw, match):
    t, m = make((5, 8), dtype, cpu_tier)
    bad_among_good(t, m, how, raw, match)


def test_first_bad_edit_is_named(cpu_tier):
    t, m = make((4, 6), torch.int32, cpu_tier)
    stage_both(t, m, 0, 0, [1, 2])
    stage_bad(t, m, "list", [0.5], row=2, start=3)
    stage_many_both(t, m, [1], [1], [[5, 6]])  # a checked batch between two bad list edits
    stage_bad(t, m, "list", ["x"], row=3, start=0)
    err = apply_fails(t, m, "fractional")
    assert (err.position, err.index, err.start) == (1, 2, 3)
    restage_good(t, m)
    apply_both(t, m)


@pytest.mark.parametrize("dtype", [torch.int32, torch.float32])
def test_fused_bad_edit_writes_nothing_anywhere(cpu_tier, dtype):
    fused_bad_among_good(cpu_tier, device_of(cpu_tier), dtype)


def fused_bad_among_good(tier, dev: str, dtype: torch.dtype) -> None:
    pairs = [make(s, dtype, tier, dev) for s in [(3, 5), (4, 40), 6]]
    w = FusedStagedWriter(dev, max_writes=4)
    for k, (t, m) in enumerate(pairs):  # a first apply, so that "unchanged" means something
        stage_both(t, m, 0, 0, _values(dtype, t.cols, 10 + k))
    w.apply([t for t, _ in pairs])
    for t, m in pairs:
        m.apply()
        check(t, m)
    for k, (t, m) in enumerate(pairs):
        stage_both(t, m, t.rows - 1, 0, _values(dtype, t.cols, 20 + k).tolist())
        stage_many_both(t, m, [1, 0], [0, 0], _values(dtype, 2, 30 + k).reshape(2, 1))
    t1, m1 = pairs[1]
    stage_bad(t1, m1, "list", [0.5, "x"] if dtype.is_floating_point else [7, 0.5], row=2, start=30)
    stage_both(t1, m1, 2, 0, _values(dtype, 40, 40).tolist())
    before = [(read(t).copy(), t.stats(), repr(t.pending_writes())) for t, _ in pairs]
    wstats = w.stats()
    for _ in range(2):  # and again: still all staged
        with pytest.raises(StagedWriteError) as ei:
            w.apply([t for t, _ in pairs])
        assert (ei.value.position, ei.value.index, ei.value.start) == (3, 2, 30)
        for (t, m), (arr, stats, pending) in zip(pairs, before):
            np.testing.assert_array_equal(read(t), arr)
            check(t, m)
            assert t.stats() == stats and repr(t.pending_writes()) == pending
            check_pending(t, m)
        assert w.stats() == wstats
    restage_good(t1, m1)
    w.apply([t for t, _ in pairs])
    for t, m in pairs:
        m.apply()
        assert t.num_staged == 0
        check(t, m)


def test_zero_row_target_rejects_every_index(cpu_tier):
    t, _ = make((0, 4), torch.int32, cpu_tier)
    with pytest.raises(ValueError, match="0 rows"):
        t.stage_write(0, 0, [])
    with pytest.raises(ValueError, match=r"rows\[0\]=0 is out of range"):
        t.stage_writes([0], [0], np.zeros((1, 1), np.int32))
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


# --- stage_writes: batches from arrays -----------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_stage_writes_forms(cpu_tier, dtype):
    t, m = make((6, 10), dtype, cpu_tier)
    v2 = _values(dtype, 12, 1).reshape(3, 4)
    stage_many_both(t, m, np.array([0, 3, 5]), np.array([0, 2, 6]), v2)  # 2-D
    stage_many_both(t, m, [1, 2, 1], [9, 0, 3], _values(dtype, 3, 2))  # 1-D: one value each
    stage_many_both(t, m, [4, 0, 2, 4], [1, 5, 9, 0], _values(dtype, 10, 3), lengths=[3, 5, 0, 2])  # runs
    stage_many_both(t, m, [0], [0], [[1, 2, 3]])  # lists are arrays here: checked now
    stage_many_both(t, m, (5,), (0,), np.array([[7]], np.int16))  # a narrower dtype
    check_pending(t, m)
    apply_both(t, m)


def test_stage_writes_keep_staging_order_with_stage_write(cpu_tier):
    t, m = make((4, 12), torch.int64, cpu_tier)
    stage_both(t, m, 1, 0, list(range(100, 112)))
    stage_many_both(t, m, [1, 2, 1], [4, 0, 10], np.array([[1, 2], [3, 4], [5, 6]]))
    stage_both(t, m, 1, 5, [7, 8, 9])  # overlaps the batch's first edit
    t.stage_write_elem(2, 42)
    m.stage(2, 0, [42])
    stage_many_both(t, m, [2, 1], [0, 0], np.array([50, 60]), lengths=[1, 1])
    stage_both(t, m, 3, 0, np.arange(12))
    stage_many_both(t, m, [3, 3], [2, 3], np.array([[-1], [-2]]))
    check_pending(t, m)
    apply_both(t, m)
    assert read(t)[1, 0] == 60 and read(t)[1, 5] == 7 and read(t)[2, 0] == 50


# (rows, starts, values, lengths, exception, what the message says)
STAGE_WRITES_BAD = [
    (
        "row past the end",
        [0, 1, 2, 4],
        [0] * 4,
        np.ones((4, 2), np.int32),
        None,
        ValueError,
        r"rows\[3\]=4 is out of range",
    ),
    ("row negative", [0, -1], [0, 0], np.ones((2, 2), np.int32), None, ValueError, r"rows\[1\]=-1"),
    (
        "start negative",
        [0, 1, 2],
        [0, 0, -2],
        np.ones((3, 2), np.int32),
        None,
        ValueError,
        r"starts\[2\]=-2 is negative",
    ),
    (
        "past the end",
        [0, 1],
        [0, 7],
        np.ones((2, 2), np.int32),
        None,
        ValueError,
        r"edit 1 \(rows\[1\]=1, starts\[1\]=7, 2 values\) ends at column 9",
    ),
    (
        "past the end (runs)",
        [0, 1],
        [0, 5],
        np.ones(6, np.int32),
        [2, 4],
        ValueError,
        r"edit 1 \(rows\[1\]=1, starts\[1\]=5, 4 values\) ends at column 9",
    ),
    ("lengths sum", [0, 1], [0, 0], np.ones(5, np.int32), [2, 2], ValueError, "lengths add up to 4"),
    ("lengths negative", [0, 1], [0, 0], np.ones(4, np.int32), [5, -1], ValueError, r"lengths\[1\]=-1"),
    ("lengths count", [0, 1], [0, 0], np.ones(4, np.int32), [4], ValueError, "lengths has 1 entries"),
    ("starts count", [0, 1], [0], np.ones((2, 2), np.int32), None, ValueError, "starts has 1 entries"),
    ("values count", [0, 1], [0, 0], np.ones((3, 2), np.int32), None, ValueError, "values has 3 rows"),
    ("values rank 3", [0, 1], [0, 0], np.ones((2, 2, 1), np.int32), None, ValueError, "rank 3"),
    (
        "fractional into int",
        [0, 1, 2],
        [0, 0, 0],
        np.array([[1, 2], [3, 4], [5, 5.5]]),
        None,
        ValueError,
        r"edit 2 \(rows\[2\]=2, starts\[2\]=0\): values holds fractional",
    ),
    (
        "NaN into int (runs)",
        [2, 0],
        [1, 0],
        np.array([1, 2, 3, np.nan]),
        [1, 3],
        ValueError,
        r"edit 1 \(rows\[1\]=0, starts\[1\]=0\): values holds NaN",
    ),
    (
        "out of range into int32",
        [0, 1, 3],
        [0, 2, 0],
        np.array([[1, 2], [3, 4], [2**40, 0]]),
        None,
        ValueError,
        r"edit 2 \(rows\[2\]=3, starts\[2\]=0\): values holds values in",
    ),
    (
        "float16 whole numbers into int32 (accepted)",
        [0, 1],
        [0, 0],
        np.array([[1, 2], [-65504, 1]], np.float16),
        None,
        None,
        None,
    ),
    (
        "string values",
        [0, 1],
        [0, 0],
        np.array([["a", "b"], ["c", "d"]]),
        None,
        TypeError,
        "values has dtype <U1",
    ),
    ("bool values into int", [0, 1], [0, 0], np.ones((2, 2), bool), None, TypeError, "bools and numbers"),
    (
        "complex values",
        [0, 1],
        [0, 0],
        np.ones((2, 2), complex),
        None,
        TypeError,
        "values has dtype complex128",
    ),
    (
        "fractional rows",
        [0, 1.5],
        [0, 0],
        np.ones((2, 2), np.int32),
        None,
        TypeError,
        "rows has dtype float64",
    ),
    (
        "bool rows",
        np.array([True, False]),
        [0, 0],
        np.ones((2, 2), np.int32),
        None,
        TypeError,
        "rows has dtype bool",
    ),
    (
        "bool starts",
        [0, 1],
        np.array([False, True]),
        np.ones((2, 2), np.int32),
        None,
        TypeError,
        "starts has dtype bool",
    ),
    ("rows of rank 2", [[0, 1]], [0, 0], np.ones((2, 2), np.int32), None, ValueError, "rows has rank 2"),
]


@pytest.mark.parametrize(
    ("rows", "starts", "values", "lengths", "exc", "match"),
    [c[1:] for c in STAGE_WRITES_BAD],
    ids=[c[0] for c in STAGE_WRITES_BAD],
)
def test_stage_writes_bad_input(cpu_tier, rows, starts, values, lengths, exc, match):
    t, m = _staged_before(cpu_tier)
    if exc is None:
        stage_many_both(t, m, rows, starts, values, lengths)
    else:
        with pytest.raises(exc, match=match):
            t.stage_writes(rows, starts, values, lengths)
    check_pending(t, m)  # a refused batch stages nothing
    apply_both(t, m)


def test_stage_writes_float_target_range(cpu_tier):
    t, m = make((3, 4), torch.float32, cpu_tier)
    with pytest.raises(ValueError, match=r"edit 1 \(rows\[1\]=2, starts\[1\]=1\): values holds finite"):
        t.stage_writes([0, 2], [0, 1], np.array([[1.0, 2.0], [1e39, 0.0]]))
    stage_many_both(t, m, [0, 2], [0, 1], np.array([[np.nan, np.inf], [3e38, -0.0]]))
    apply_both(t, m)


# --- forced kernels: scatter, and the Triton kernel (CPU: through the interpreter) -----


def _kernel_round(rng, pairs, dtype, overlap: bool) -> None:
    """Random edits to every pair (long ones included); distinct rows unless ``overlap``."""
    for t, m in pairs:
        rows = rng.permutation(t.rows)[: int(rng.integers(1, t.rows + 1))]
        for k, r in enumerate(rows):
            start = int(rng.integers(0, t.cols))
            n = int(rng.integers(1, t.cols - start + 1))
            v = _values(dtype, n, int(rng.integers(0, 1 << 30)))
            if k % 3 == 2:
                stage_many_both(t, m, [int(r)], [start], v.reshape(1, -1))
            else:
                stage_both(t, m, int(r), start, v if k % 2 else v.tolist())
        if overlap:
            r = int(rows[0])
            stage_both(t, m, r, 0, _values(dtype, t.cols, int(rng.integers(0, 1 << 30))))
            stage_both(t, m, r, t.cols - 1, _values(dtype, 1, 5))


def forced_kernels(monkeypatch, tier, dev: str, kernel: str) -> None:
    monkeypatch.setattr(sw_kernel, "MAX_BLOCK", 16)
    monkeypatch.setenv(ENV_KERNEL, kernel)
    if kernel == "triton" and dev == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    runs_triton = kernel == "triton" and sw_kernel.triton_usable(torch.device(dev))
    rng = np.random.default_rng(17)
    for dtype in DTYPES:
        pairs = [make(s, dtype, tier, dev) for s in [(5, 70), (3, 17), 9]]  # rows of 70 > MAX_BLOCK
        w = FusedStagedWriter(dev, max_writes=4)
        for rnd in range(4):
            overlap = rnd == 2
            _kernel_round(rng, pairs, dtype, overlap)
            t0, m0 = pairs[0]
            t0.apply_write()  # one tensor
            m0.apply()
            check(t0, m0)
            want = "host" if tier is HOST else "scatter" if overlap or not runs_triton else "triton"
            assert t0.kernel == want
            w.apply([t for t, _ in pairs])  # several: one launch
            for t, m in pairs:
                m.apply()
                check(t, m)
            assert w.kernel == want


@pytest.mark.parametrize("kernel", ["scatter", "triton"])
def test_forced_kernels_match_the_model(cpu_tier, monkeypatch, kernel):
    if kernel == "triton" and not HAS_TRITON:
        pytest.skip("needs triton")
    forced_kernels(monkeypatch, cpu_tier, device_of(cpu_tier), kernel)


@pytest.mark.parametrize(
    ("targets", "edits", "length", "want"),
    [
        (1, 16, 8, "scatter"),  # one target: one launch either way; few elements
        (1, 1024, 8, "triton"),  # 8 192 elements, edits of 8
        (1, 8192, 1, "scatter"),  # as many elements, but lone ones
        (2, 16, 1, "triton"),  # few edits: one launch, not two
        (2, 64, 1, "scatter"),  # many lone elements on two targets
        (2, 64, 2, "triton"),
        (8, 1024, 1, "triton"),  # many lone elements, but eight targets: seven launches fewer
        (8, 2048, 1, "scatter"),
    ],
)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_auto_runs_the_kernel_measured_cheaper_and_writes_the_same(
    monkeypatch, device, targets, edits, length, want
):
    """On CUDA, the kernel of docs/DESIGN.md's rule (python -m benchmarks.kernels on the H200); on the CPU
    the scatter, even where Triton's interpreter could run (it is never the cheaper one)."""
    if not HAS_TRITON:
        pytest.skip("needs triton")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    tier = force_tier(monkeypatch, "pageable" if device == "cpu" else "uva")
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert sw_kernel.triton_usable(torch.device("cpu"))
    rng = np.random.default_rng(edits + targets)
    rows = edits // targets
    pairs = [make((rows, length), torch.int32, tier, device) for _ in range(targets)]
    for t, m in pairs:
        for r in range(rows):  # one edit a row: none overlap (overlaps would force the scatter)
            stage_both(t, m, r, 0, rng.integers(0, 1 << 20, length).tolist())
    if targets == 1:
        pairs[0][0].apply_write()
        ran = pairs[0][0].kernel
    else:
        w = FusedStagedWriter(device, max_writes=edits)
        w.apply([t for t, _ in pairs])
        ran = w.kernel
    assert ran == (want if device == "cuda" else "scatter")
    for t, m in pairs:
        m.apply()
        check(t, m)


def test_forced_triton_without_interpreter_falls_back_once(cpu_tier, monkeypatch, caplog):
    monkeypatch.setenv(ENV_KERNEL, "triton")
    t, m = make((3, 4), torch.int32, cpu_tier)
    with caplog.at_level(logging.WARNING, logger="stagebuf"):
        for k in range(3):
            stage_both(t, m, k, 0, [k, k + 1])
            apply_both(t, m)
    said = [r for r in caplog.records if "scatter kernel" in r.getMessage()]
    if cpu_tier is HOST:
        assert t.kernel == "host" and not said
    else:
        assert t.kernel == "scatter" and len(said) == 1


@pytest.mark.parametrize("value", ["cuda", "torch", "1"])
def test_bad_kernel_setting(monkeypatch, value):
    monkeypatch.setenv(ENV_KERNEL, value)
    with pytest.raises(
        ValueError,
        match=f"{ENV_KERNEL}={value!r} is not a staged-write kernel; allowed: auto, scatter, triton",
    ):
        StagedWriteTensor((2, 2), torch.int32, "cpu")
    with pytest.raises(ValueError, match=ENV_KERNEL):
        FusedStagedWriter("cpu")


def test_kernel_names_on_cpu(cpu_tier):
    t, m = make((2, 2), torch.int32, cpu_tier)
    assert t.kernel == ("host" if cpu_tier is HOST else "scatter")
    t.stage_write_elem(0, 1)
    m.stage(0, 0, [1])
    apply_both(t, m)
    assert t.kernel == ("host" if cpu_tier is HOST else "scatter")  # no interpreter: never triton


# --- transfers and steps on the CPU tiers ----------------------------------------------


def expect_steps(tier, stats: dict[str, int], applies: int) -> None:
    """HOST applies with one numpy assignment (no stager step); PAGEABLE: one step, one transfer each."""
    if tier is HOST:
        assert stats["steps"] == 0 and stats["transfers"] == 0 and stats["bytes"] == 0
    else:
        assert stats["steps"] == applies and stats["transfers"] == applies


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
        m.apply()
    big = np.arange(8 * 300).reshape(8, 300)
    for r in range(8):
        stage_both(t, m, r, 0, big[r])
    apply_both(t, m)
    expect_steps(cpu_tier, t.stats(), applies + 1)


def test_growth_still_one_transfer_per_apply(cpu_tier):
    t, m = make((2, 200_000), torch.int32, cpu_tier)
    stage_both(t, m, 1, 0, np.arange(200_000))
    t.apply_write()
    m.apply()
    stage_both(t, m, 0, 5, np.arange(100))
    apply_both(t, m)
    s = t.stats()
    expect_steps(cpu_tier, s, 2)
    assert (s["growths"] == 0) is (cpu_tier is HOST)


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
    expect_steps(cpu_tier, t.stats(), 1)


# --- fused writer ------------------------------------------------------------------


def test_fused_writer_different_row_lengths(cpu_tier):
    dev = device_of(cpu_tier)
    shapes = [(4, 16), (4, 7), (3, 100), 5]
    pairs = [make(s, torch.int32, cpu_tier) for s in shapes]
    rng = np.random.default_rng(11)
    w = FusedStagedWriter(dev, max_writes=4)
    applies = 0
    for _ in range(4):
        for t, m in pairs:
            for _ in range(int(rng.integers(0, 5))):
                row = int(rng.integers(0, t.rows))
                start = int(rng.integers(0, t.cols + 1))
                stage_both(t, m, row, start, rng.integers(-50, 50, int(rng.integers(0, t.cols - start + 1))))
        applies += any(t.num_staged for t, _ in pairs)
        w.apply([t for t, _ in pairs])
        for t, m in pairs:
            m.apply()
            assert t.num_staged == 0
            check(t, m)
    assert w.kernel == ("host" if cpu_tier is HOST else "scatter")
    expect_steps(cpu_tier, w.stats(), applies)
    assert all(t.stats()["steps"] == 0 for t, _ in pairs)  # the tensors' own stagers were not used


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
    expect_steps(cpu_tier, s, 3)
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


def test_fused_writer_checks_output_ptrs_and_strides(cpu_tier):
    dev = device_of(cpu_tier)
    pairs = [make(s, torch.int64, cpu_tier) for s in [(2, 3), (3, 8), 4]]
    ts = [t for t, _ in pairs]
    w = FusedStagedWriter(dev)
    for t, m in pairs:
        stage_both(t, m, 1, 0, [5] * t.cols)
    ptrs = [t.gpu.data_ptr() for t in ts]
    strides = [3, 8, 1]
    bad_calls: list[tuple[Callable[[], Any], type[Exception], str]] = [
        (lambda: w.apply(ts, output_ptrs=ptrs[::-1]), ValueError, "output_ptrs="),
        (lambda: w.apply(ts, output_ptrs=ptrs[:2]), ValueError, "output_ptrs="),
        (lambda: w.apply(ts, output_strides=[3, 8, 2]), ValueError, "output_strides="),
        (lambda: w.apply(ts, output_ptrs=5), TypeError, "output_ptrs must be None or a sequence"),
        (lambda: w.apply(ts, output_strides=["a", "b", "c"]), TypeError, "output_strides must be"),
    ]
    for call, exc, match in bad_calls:
        with pytest.raises(exc, match=match):
            call()
        for t, m in pairs:
            check(t, m)  # nothing written
            check_pending(t, m)  # nothing dropped
    w.apply(ts, output_ptrs=torch.tensor(ptrs, dtype=torch.int64), output_strides=strides)
    for t, m in pairs:
        m.apply()
        check(t, m)
    stage_both(*pairs[0], 0, 0, [1, 2, 3])
    w.apply(ts, ptrs, np.array(strides))  # positional, a numpy array
    pairs[0][1].apply()
    check(*pairs[0])


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
    expect_steps(cpu_tier, t.stats(), 7)


# --- random edit streams against the model -------------------------------------------

STAGE_BAD_KINDS = ["row_high", "row_neg", "start_neg", "too_long", "batch_row", "batch_start", "batch_frac"]
APPLY_BAD_KINDS = ["fraction", "range", "bools", "string", "nested"]
OPS = ["write"] * 6 + ["elem", "batch", "batch", "bad", "bad_list", "apply", "apply", "clear"]


@st.composite
def edit_streams(draw):
    dtype = draw(st.sampled_from(DTYPES))
    one_d = draw(st.booleans())
    rows = draw(st.integers(1, 6))
    cols = 1 if one_d else draw(st.integers(1, 40))
    ops = draw(
        st.lists(
            st.tuples(
                st.sampled_from(OPS),
                st.integers(0, 1000),
                st.integers(0, 1000),
                st.integers(0, 50),
                st.integers(0, 2**32 - 1),
                st.sampled_from(STAGE_BAD_KINDS + APPLY_BAD_KINDS),
            ),
            max_size=40,
        )
    )
    return dtype, one_d, rows, cols, ops


def _bad_list(kind: str, integer: bool) -> list:
    return {
        "fraction": [0.5, 1] if integer else [1e39],
        "range": [2**63, 1] if integer else [-3e39, 1.0],
        "bools": [True, False],
        "string": ["a", 1],
        "nested": [[1]],
    }[kind]


def _apply_stream(t: StagedWriteTensor, m: Model, seed: int) -> None:
    """Apply; when a bad list edit is staged, apply raises, and the stream clears or re-stages the good."""
    if m.first_bad() is None:
        apply_both(t, m)
        return
    apply_fails(t, m)
    if seed % 2:
        t.clear_staged_writes()
        m.pending.clear()
        check_pending(t, m)
    else:
        restage_good(t, m)
        check_pending(t, m)


def run_stream(t: StagedWriteTensor, m: Model, ops) -> None:
    rows, cols = t.rows, t.cols
    integer = not t.dtype.is_floating_point
    for kind, a, b, n, seed, bad in ops:
        row, start = a % rows, b % (cols + 1)
        if kind == "write":
            v = _values(t.dtype, min(n, cols - start), seed)
            stage_both(t, m, row, start, v.tolist() if seed % 3 == 0 else v)
        elif kind == "elem":
            v = _values(t.dtype, 1, seed)[0].item()
            t.stage_write_elem(row, v)
            m.stage(row, 0, [v])
        elif kind == "batch":
            e = n % 5
            r = np.random.default_rng(seed).integers(0, rows, e)
            if seed % 2:  # runs of lengths[i] values
                s = np.random.default_rng(seed + 1).integers(0, cols + 1, e)
                lens = np.minimum(np.random.default_rng(seed + 2).integers(0, 4, e), cols - s)
                stage_many_both(t, m, r, s, _values(t.dtype, int(lens.sum()), seed), lens)
            else:  # (E, L)
                width = min(n % 4, cols - start)
                v = _values(t.dtype, e * width, seed).reshape(e, width)
                stage_many_both(t, m, r, np.full(e, start), v)
        elif kind == "bad" and bad in STAGE_BAD_KINDS:
            args = {
                "row_high": (rows + a % 3, 0, [1]),
                "row_neg": (-1 - a % 3, 0, [1]),
                "start_neg": (row, -1 - b % 3, [1]),
                "too_long": (row, start, [1] * (cols - start + 1 + n % 3)),
            }
            with pytest.raises((ValueError, TypeError)):
                if bad in args:
                    t.stage_write(*args[bad])
                elif bad == "batch_row":
                    t.stage_writes([row, rows], [0, 0], np.zeros((2, 1), NP[t.dtype]))
                elif bad == "batch_start":
                    t.stage_writes([row, row], [0, cols], np.zeros((2, 1), NP[t.dtype]))
                else:
                    t.stage_writes([row], [0], np.array([[0.5 if integer else 1e39]]))
            check_pending(t, m)
        elif kind in ("bad", "bad_list"):
            raw = _bad_list(bad if bad in APPLY_BAD_KINDS else "fraction", integer)[:cols]
            stage_bad(t, m, "list", raw, row=row, start=min(start, cols - len(raw)))
        elif kind == "apply":
            _apply_stream(t, m, seed)
        else:
            t.clear_staged_writes()
            m.pending.clear()
        check_pending(t, m)
    _apply_stream(t, m, 1)
    apply_both(t, m)


@examples(30)
@given(stream=edit_streams())
def test_random_edit_streams(cpu_tier, stream):
    dtype, one_d, rows, cols, ops = stream
    t, m = make(rows if one_d else (rows, cols), dtype, cpu_tier)
    run_stream(t, m, ops)


def run_fused_stream(data, w, pairs, dtype, max_start: int, max_len: int) -> None:
    """Random rounds of edits to every (tensor, model) pair, each round applied by ``w`` and checked.

    A round may hold one bad list edit: the fused apply raises and writes nothing in any
    tensor; the round's tensors are cleared of it (the good edits re-staged) and applied.
    """
    edit = st.tuples(
        st.integers(0, 99),
        st.integers(0, max_start),
        st.integers(0, max_len),
        st.integers(0, 999),
        st.sampled_from(["list", "array", "batch"]),
    )
    integer = not dtype.is_floating_point
    for _ in range(data.draw(st.integers(1, 4))):
        for t, m in pairs:
            for a, b, n, seed, how in data.draw(st.lists(edit, max_size=6)):
                row, start = a % t.rows, b % (t.cols + 1)
                v = _values(dtype, min(n, t.cols - start), seed)
                if how == "batch":
                    stage_many_both(t, m, [row], [start], v.reshape(1, -1))
                else:
                    stage_both(t, m, row, start, v.tolist() if how == "list" else v)
        bad_in = data.draw(st.one_of(st.none(), st.integers(0, len(pairs) - 1)))
        if bad_in is not None:
            t, m = pairs[bad_in]
            stage_bad(t, m, "list", _bad_list("fraction", integer)[: t.cols], row=0, start=0)
            before = [read(t).copy() for t, _ in pairs]
            with pytest.raises(StagedWriteError) as ei:
                w.apply([t for t, _ in pairs])
            assert ei.value.position == m.first_bad()
            for (t, m), arr in zip(pairs, before):
                np.testing.assert_array_equal(read(t), arr)
                check_pending(t, m)
            restage_good(*pairs[bad_in])
        w.apply([t for t, _ in pairs])
        for t, m in pairs:
            m.apply()
            check(t, m)


@examples(20)
@given(data=st.data())
def test_random_fused_streams(cpu_tier, data):
    dtype = data.draw(st.sampled_from(DTYPES))
    shape = st.one_of(st.integers(1, 5), st.tuples(st.integers(1, 5), st.integers(1, 30)))
    shapes = data.draw(st.lists(shape, min_size=1, max_size=4))
    pairs = [make(s, dtype, cpu_tier) for s in shapes]
    w = FusedStagedWriter(device_of(cpu_tier), max_writes=data.draw(st.integers(1, 8)))
    run_fused_stream(data, w, pairs, dtype, max_start=99, max_len=40)


# --- GPU: the same checks on UVA, PINNED and PAGEABLE ---------------------------------

KERNEL_SETTINGS = ["auto", "scatter", "triton"]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNEL_SETTINGS)
@examples(30)
@given(stream=edit_streams())
def test_gpu_random_edit_streams(gpu_tier, monkeypatch, kernel, stream):
    monkeypatch.setenv(ENV_KERNEL, kernel)
    dtype, one_d, rows, cols, ops = stream
    t = StagedWriteTensor(rows if one_d else (rows, cols), dtype, "cuda")
    assert t.tier is gpu_tier and t.gpu.device.type == "cuda" and t.kernel == "scatter"
    run_stream(t, Model(rows, cols, dtype), ops)
    assert t.kernel in ("scatter", "triton")


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNEL_SETTINGS)
@examples(15)
@given(data=st.data())
def test_gpu_random_fused_streams(gpu_tier, monkeypatch, kernel, data):
    monkeypatch.setenv(ENV_KERNEL, kernel)
    dtype = data.draw(st.sampled_from(DTYPES))
    shapes = data.draw(st.lists(st.tuples(st.integers(1, 5), st.integers(1, 3000)), min_size=1, max_size=4))
    pairs = [(StagedWriteTensor(s, dtype, "cuda"), Model(*s, dtype)) for s in shapes]
    w = FusedStagedWriter("cuda", max_writes=4)
    run_fused_stream(data, w, pairs, dtype, max_start=5000, max_len=3000)
    s = w.stats()
    assert s["transfers"] == (0 if gpu_tier is stagebuf.Tier.UVA else s["steps"])
    if kernel != "auto":
        assert w.kernel in (kernel, "scatter")


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "how", "raw", "match"), APPLY_BAD, ids=APPLY_BAD_IDS)
def test_gpu_bad_list_edit_refused_at_apply(gpu_tier, dtype, how, raw, match):
    t, m = make((5, 8), dtype, gpu_tier, "cuda")
    assert t.tier is gpu_tier
    bad_among_good(t, m, how, raw, match)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.int32, torch.float32])
def test_gpu_fused_bad_edit_writes_nothing_anywhere(gpu_tier, dtype):
    fused_bad_among_good(gpu_tier, "cuda", dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["scatter", "triton"])
def test_gpu_forced_kernels_match_the_model(gpu_tier, monkeypatch, kernel):
    forced_kernels(monkeypatch, gpu_tier, "cuda", kernel)


@pytest.mark.gpu
def test_gpu_stage_writes_forms(gpu_tier):
    for dtype in DTYPES:
        t, m = make((6, 2000), dtype, gpu_tier, "cuda")
        stage_many_both(t, m, [0, 3, 5], [0, 2, 1000], _values(dtype, 3000, 1).reshape(3, 1000))
        stage_both(t, m, 3, 500, _values(dtype, 100, 2).tolist())
        stage_many_both(t, m, [1, 2, 1], [1999, 0, 3], _values(dtype, 3, 3))
        stage_many_both(t, m, [4, 0, 2, 4], [1, 5, 9, 0], _values(dtype, 1700, 4), lengths=[300, 900, 0, 500])
        check_pending(t, m)
        apply_both(t, m)


def random_rounds(t: StagedWriteTensor, m: Model, seed: int, counts: list[int], edit: Any) -> None:
    """Rounds of ``counts[k]`` random edits ``edit(rng, k, i) -> (row, start, values)``, each round
    applied to both and checked."""
    rng = np.random.default_rng(seed)
    for k, count in enumerate(counts):
        for i in range(count):
            stage_both(t, m, *edit(rng, k, i))
        apply_both(t, m)


def to_the_end(rows: int, cols: int, high: int) -> Any:
    """An edit from a random start to the end of a random row, of random values below ``high``."""

    def edit(rng: np.random.Generator, k: int, i: int) -> tuple[int, int, np.ndarray]:
        start = int(rng.integers(0, cols))
        return int(rng.integers(0, rows)), start, rng.integers(0, high, cols - start)

    return edit


@pytest.mark.gpu
def test_gpu_heavy_overlaps_long_row(gpu_tier):
    """Many overlapping edits on a row spanning many kernel tiles: later must win, no races."""

    def edit(rng: np.random.Generator, k: int, i: int) -> tuple[int, int, np.ndarray]:
        start = int(rng.integers(0, 10_000))
        n = int(rng.integers(1, 10_000 - start + 1))
        return int(rng.integers(0, 3)), start, np.full(n, i, np.int32)

    random_rounds(*make((3, 10_000), torch.int32, gpu_tier, "cuda"), 5, [200] * 5, edit)


@pytest.mark.gpu
def test_gpu_one_transfer_per_apply(gpu_tier):
    t, m = make((16, 4096), torch.int64, gpu_tier, "cuda")
    random_rounds(t, m, 2, [4 * k + 1 for k in range(8)], to_the_end(16, 4096, 10**12))
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
    random_rounds(t, m, 9, [20] * 3, to_the_end(64, 1000, 10**6))
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
    print(
        f"\n[{gpu_tier.name}] {n}-element int32 write: staging {staged_s * 1e3:.3f} ms, "
        f"apply (host side) {applied_s * 1e3:.3f} ms, kernel {t.kernel}"
    )
    m.stage(1, 0, vals)
    m.apply()
    check(t, m)
    assert t.kernel == ("triton" if HAS_TRITON else "scatter")
    s = t.stats()
    assert s["steps"] == 1
    assert s["transfers"] == (0 if gpu_tier is stagebuf.Tier.UVA else 1)
