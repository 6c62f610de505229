"""One rule for a bad staged value, on every tier, for single and fused applies.

A list value that does not fit the target dtype is accepted by ``stage_write``
(staging stays a list append) and refused by the apply: the apply writes nothing
on any tensor and raises ``StagedWriteError`` whose ``edits`` are the positions of
every bad edit of ``tensor``; ``discard_staged(err.edits)`` drops exactly those,
and the next apply writes the good ones. Checked against a numpy model.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import read_back
from stagebuf import FusedStagedWriter, StagedWriteError, StagedWriteTensor
from stagebuf._common.errors import StagebufError

ROWS, COLS = 6, 8
BAD_VALUES = [1.5, float("nan"), 2**31, -(2**31) - 1, 2**70, "x", None, True]
"""List values an int32 target cannot hold (or an all-bool edit)."""


def _good(rng: np.random.Generator) -> tuple[int, int, list[int]]:
    n = int(rng.integers(1, 4))
    start = int(rng.integers(0, COLS - n + 1))
    return int(rng.integers(0, ROWS)), start, [int(v) for v in rng.integers(-1000, 1000, n)]


def _stage(t: StagedWriteTensor, edits: list[tuple[int, int, list]]) -> None:
    for r, s, v in edits:
        t.stage_write(r, s, v)


def _apply_model(model: np.ndarray, edits, good) -> None:
    for (r, s, v), ok in zip(edits, good):
        if ok:
            model[r, s : s + len(v)] = v


@pytest.mark.parametrize("bad_value", BAD_VALUES, ids=repr)
def test_single_apply_names_every_bad_edit_and_discard_keeps_the_good(any_tier, bad_value):
    rng = np.random.default_rng(7)
    t = StagedWriteTensor((ROWS, COLS), torch.int32)
    edits = [_good(rng) for _ in range(7)]
    good = [True] * 7
    for i in (1, 4):  # two bad edits among good ones
        r, s, v = edits[i]
        edits[i] = (r, s, [*v[:-1], bad_value] if bad_value is not True else [True] * len(v))
        good[i] = False
    _stage(t, edits)
    before = read_back(t.gpu).copy()
    with pytest.raises(StagedWriteError) as ei:
        t.apply_write()
    err = ei.value
    assert err.edits == (1, 4) and err.tensor is t and err.position == 1
    assert (err.index, err.start) == edits[1][:2]
    np.testing.assert_array_equal(read_back(t.gpu), before)  # nothing written
    assert t.num_staged == 7  # nothing dropped
    t.discard_staged(err.edits)
    assert [(r, s) for r, s, _ in t.pending_writes()] == [e[:2] for e, ok in zip(edits, good) if ok]
    t.apply_write()
    model = np.zeros((ROWS, COLS), np.int32)
    _apply_model(model, edits, good)
    np.testing.assert_array_equal(read_back(t.gpu), model)
    assert t.num_staged == 0


def test_fused_apply_writes_nothing_on_any_tensor_until_the_bad_edits_go(any_tier):
    rng = np.random.default_rng(3)
    a, b, c = (StagedWriteTensor((ROWS, COLS), torch.int32) for _ in range(3))
    ea = [_good(rng) for _ in range(4)]
    eb = [_good(rng) for _ in range(5)]
    ec = [_good(rng) for _ in range(3)]
    gb = [True, False, True, True, False]
    eb[1] = (eb[1][0], eb[1][1], [0.25] * len(eb[1][2]))
    eb[4] = (eb[4][0], eb[4][1], [2**40])
    for t, e in ((a, ea), (b, eb), (c, ec)):
        _stage(t, e)
    w = FusedStagedWriter(max_writes=64)
    with pytest.raises(StagedWriteError, match=r"tensors\[1\]") as ei:
        w.apply([a, b, c])
    assert ei.value.tensor is b and ei.value.edits == (1, 4)
    for t in (a, b, c):
        assert not read_back(t.gpu).any()  # the good edits of a and c were not written either
    assert (a.num_staged, b.num_staged, c.num_staged) == (4, 5, 3)
    ei.value.tensor.discard_staged(ei.value.edits)
    w.apply([a, b, c])
    for t, e, g in ((a, ea, [True] * 4), (b, eb, gb), (c, ec, [True] * 3)):
        model = np.zeros((ROWS, COLS), np.int32)
        _apply_model(model, e, g)
        np.testing.assert_array_equal(read_back(t.gpu), model)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    bad=st.lists(st.lists(st.booleans(), min_size=1, max_size=6), min_size=2, max_size=4),
    value=st.sampled_from(BAD_VALUES[:-1]),
    seed=st.integers(0, 2**16),
)
def test_fused_apply_reports_every_tensors_bad_edits(cpu_tier, bad, value, seed):
    """Bad edits in several tensors: ``by_tensor`` lists each such tensor with exactly its bad positions,
    the message names each, nothing is written; discarding them all, the apply writes the model."""
    rng = np.random.default_rng(seed)
    tensors = [StagedWriteTensor((ROWS, COLS), torch.int32) for _ in bad]
    edits = []
    for t, flags in zip(tensors, bad):
        e = [_good(rng) for _ in flags]
        e = [(r, s, [value] if f else v) for (r, s, v), f in zip(e, flags)]
        _stage(t, e)
        edits.append(e)
    want = [(t, tuple(i for i, f in enumerate(flags) if f)) for t, flags in zip(tensors, bad) if any(flags)]
    w = FusedStagedWriter()
    if not want:
        w.apply(tensors)
    else:
        with pytest.raises(StagedWriteError) as ei:
            w.apply(tensors)
        got = ei.value.by_tensor
        assert [(id(t), e) for t, e in got] == [(id(t), e) for t, e in want]
        for t, _ in want:
            assert f"tensors[{tensors.index(t)}] ({len(dict(want)[t])} bad edit(s))" in str(ei.value)
        for t in tensors:
            assert not read_back(t.gpu).any()
        for t, e in got:
            t.discard_staged(e)
        w.apply(tensors)
    for t, e, flags in zip(tensors, edits, bad):
        model = np.zeros((ROWS, COLS), np.int32)
        _apply_model(model, e, [not f for f in flags])
        np.testing.assert_array_equal(read_back(t.gpu), model)


@pytest.mark.parametrize(
    ("positions", "match"),
    [
        ([5], r"positions holds 5; allowed: ints in \[0, 2\]"),
        ([-1], "positions holds -1"),
        (["a"], "iterable of ints"),
        (3, "iterable of ints"),
        ([1.0], "iterable of ints"),
    ],
)
def test_discard_staged_refuses_what_is_not_a_staged_edit(cpu_tier, positions, match):
    t = StagedWriteTensor((ROWS, COLS), torch.int32)
    for i in range(3):
        t.stage_write(i, 0, [i])
    with pytest.raises(StagebufError, match=match):
        t.discard_staged(positions)
    assert t.num_staged == 3  # nothing dropped


_edit = st.tuples(
    st.integers(0, ROWS - 1),
    st.integers(0, COLS - 1),
    st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=3),
    st.sampled_from([None, 1.5, 2**31, "x", 2**70]),  # None: a good edit
    st.booleans(),  # as a numpy batch (checked when staged) instead of a list
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_edit, min_size=1, max_size=12))
def test_random_streams_discard_then_apply_equals_the_model(cpu_tier, stream):
    t = StagedWriteTensor((ROWS, COLS), torch.int32)
    model = np.zeros((ROWS, COLS), np.int32)
    staged: list[tuple[int, int, list[int], bool]] = []  # what stays staged, in order, and whether good
    for r, s, vals, bad, as_batch in stream:
        vals = vals[: COLS - s]
        if as_batch:
            arr = np.array([vals], np.int64)
            if bad is not None:  # a numpy batch is checked now: refused, nothing staged
                with pytest.raises(StagebufError):
                    t.stage_writes(np.array([r]), np.array([s]), np.array([[bad] * len(vals)], object))
                continue
            t.stage_writes(np.array([r]), np.array([s]), arr)
        else:
            if bad is not None:
                vals = [*vals[:-1], bad]
            t.stage_write(r, s, vals)
        staged.append((r, s, vals, bad is None))
    want_bad = tuple(i for i, e in enumerate(staged) if not e[3])
    if want_bad:
        with pytest.raises(StagedWriteError) as ei:
            t.apply_write()
        assert ei.value.edits == want_bad
        assert not t.gpu.numpy().any()
        t.discard_staged(ei.value.edits)
    t.apply_write()
    for r, s, vals, ok in staged:
        if ok:
            model[r, s : s + len(vals)] = vals
    np.testing.assert_array_equal(t.gpu.numpy(), model)


@pytest.mark.parametrize("values_0_1", [False, True])
def test_an_all_bool_edit_among_many_is_found_and_mixed_or_int_ones_are_not(cpu_tier, values_0_1):
    """A batch past the short-list scan (300 one-value edits and a few longer ones): the edits whose
    values are all bools are refused, by position; ints 0 and 1 and bools mixed with other ints are
    written (numpy reads those as ints), checked against a numpy model."""
    rows = 320
    t = StagedWriteTensor((rows, 4), torch.int32)
    rng = np.random.default_rng(3)
    edits: list[tuple[int, int, list]] = [
        (r, 0, [int(v)]) for r, v in enumerate(rng.integers(0, 2 if values_0_1 else 100, 300))
    ]
    edits += [(300, 0, [True, 7]), (301, 1, [1, 0, 1]), (302, 0, [True, False]), (303, 2, [np.True_])]
    _stage(t, edits)
    with pytest.raises(StagedWriteError) as ei:
        t.apply_write()
    assert ei.value.edits == (302, 303)  # the all-bool ones only
    t.discard_staged(ei.value.edits)
    t.apply_write()
    model = np.zeros((rows, 4), np.int32)
    _apply_model(model, edits, [i not in (302, 303) for i in range(len(edits))])
    np.testing.assert_array_equal(read_back(t.gpu), model)


@pytest.mark.parametrize("width", [1, 2, 3])
def test_an_all_bool_edit_among_many_of_one_length_is_found(cpu_tier, width):
    """As above, with every edit of one length (the check's uniform-width path): 300 edits, two of
    them all bools (Python and numpy bools), one of ints 0 and 1, one of a bool among ints."""
    rows = 300
    t = StagedWriteTensor((rows, 4), torch.int32)
    rng = np.random.default_rng(width)
    edits: list[tuple[int, int, list]] = [
        (r, 0, [int(v) for v in rng.integers(0, 50, width)]) for r in range(rows)
    ]
    edits[17] = (17, 0, [True] * width)
    edits[200] = (200, 1, [np.False_] * width)
    edits[201] = (201, 0, [1, 0, 1][:width])
    edits[202] = (202, 0, [True, 9, 9][:width] if width > 1 else [9])
    _stage(t, edits)
    with pytest.raises(StagedWriteError) as ei:
        t.apply_write()
    assert ei.value.edits == (17, 200)
    t.discard_staged(ei.value.edits)
    t.apply_write()
    model = np.zeros((rows, 4), np.int32)
    _apply_model(model, edits, [i not in (17, 200) for i in range(rows)])
    np.testing.assert_array_equal(read_back(t.gpu), model)
