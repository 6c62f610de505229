"""``array.array`` inputs (and subclasses such as vLLM 0.34's ``TokenBuffer``) read as one block, and
``UvaBufferPool.copy_chunks_to_uva`` (vLLM 0.34's call shape), against numpy models."""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import stagebuf
from stagebuf import StagedWriteTensor, UvaBufferPool

CPU = torch.device("cpu")


class Tokens(array):  # type: ignore[type-arg]
    """An ``array('i')`` subclass, shaped as vLLM 0.34's TokenBuffer (which the vLLM tests use itself)."""

    __slots__ = ()

    def __new__(cls, tokens: Any = ()) -> Tokens:
        return super().__new__(cls, "i", tokens)


def test_a_100000_token_buffer_is_staged_and_applied_exactly() -> None:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 152_000, 100_000, dtype=np.int32)
    prompt = Tokens(ids.tolist())
    t = StagedWriteTensor((3, 131_072), torch.int32, device=CPU)
    model = np.zeros((3, 131_072), np.int32)
    t.stage_write(1, 5, prompt)
    model[1, 5 : 5 + len(ids)] = ids
    prompt.append(7)  # the source may grow after staging (stagebuf keeps no view of it) ...
    prompt[0] = -1  # ... and change: the staged values are those of the call
    t.apply_write()
    np.testing.assert_array_equal(t.gpu.numpy(), model)


@pytest.mark.parametrize("code", list("bBhHiIlLqQ"))
def test_every_integer_typecode_reads_its_values(code: str) -> None:
    vals = array(code, [0, 1, 2, 100])
    t = StagedWriteTensor((2, 8), torch.int64, device=CPU)
    t.stage_write(0, 2, vals)
    t.apply_write()
    np.testing.assert_array_equal(t.gpu.numpy()[0], [0, 0, 0, 1, 2, 100, 0, 0])
    pool = UvaBufferPool(4, torch.int32, device=CPU)
    np.testing.assert_array_equal(pool.copy_to_uva(vals).numpy(), [0, 1, 2, 100])


@pytest.mark.parametrize(
    ("vals", "dtype", "error", "words"),
    [
        (array("q", [1, 2**40]), torch.int32, stagebuf.InvalidArgumentError, "outside int32's range"),
        (array("d", [1.0, 2.5]), torch.int32, stagebuf.InvalidArgumentError, "fractional"),
        (array("d", [1.0, float("nan")]), torch.int64, stagebuf.InvalidArgumentError, "NaN"),
        (array("u", "ab"), torch.int32, stagebuf.ArgumentTypeError, "typecode 'u'"),
    ],
)
def test_an_array_that_does_not_fit_is_refused_at_staging_and_nothing_is_lost(
    vals: array[Any], dtype: torch.dtype, error: type[Exception], words: str
) -> None:
    t = StagedWriteTensor((2, 4), dtype, device=CPU)
    t.stage_write(0, 0, [4, 5])
    with pytest.raises(error, match=words):
        t.stage_write(1, 0, vals)
    assert t.pending_writes() == [(0, 0, [4, 5])]
    t.apply_write()
    assert t.gpu.numpy().tolist() == [[4, 5, 0, 0], [0, 0, 0, 0]]


CHUNK = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=6)
KINDS = ("list", "int32", "int64", "array_i", "array_q", "tokens")


def _as(kind: str, vals: list[int]) -> Any:
    return {
        "list": lambda: list(vals),
        "int32": lambda: np.array(vals, np.int32),
        "int64": lambda: np.array(vals, np.int64),
        "array_i": lambda: array("i", vals),
        "array_q": lambda: array("q", vals),
        "tokens": lambda: Tokens(vals),
    }[kind]()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(KINDS), CHUNK), max_size=5), st.integers(0, 3))
def test_copy_chunks_to_uva_equals_the_chunks_joined(chunks: list[tuple[str, list[int]]], slots: int) -> None:
    pool = UvaBufferPool(2, torch.int32, max_concurrency=2 + slots, device=CPU)
    want = np.array([v for _, vals in chunks for v in vals], np.int32)
    got = pool.copy_chunks_to_uva([_as(k, vals) for k, vals in chunks], len(want))
    np.testing.assert_array_equal(got.numpy(), want)


def test_copy_chunks_to_uva_refuses_a_wrong_count_or_value_before_taking_a_slot() -> None:
    pool = UvaBufferPool(4, torch.int32, max_concurrency=2, device=CPU)
    first = pool.copy_to_uva([1, 2])
    with pytest.raises(stagebuf.InvalidArgumentError, match=r"n=4 .* allowed: 3"):
        pool.copy_chunks_to_uva([[1], array("i", [2, 3])], 4)
    with pytest.raises(stagebuf.InvalidArgumentError, match=r"chunks\[1\] .*outside int32"):
        pool.copy_chunks_to_uva([[1], array("q", [2**40])], 2)
    with pytest.raises(stagebuf.ArgumentTypeError, match="chunks must be a list or tuple"):
        pool.copy_chunks_to_uva(np.array([1, 2]), 2)  # type: ignore[arg-type]
    np.testing.assert_array_equal(pool.copy_chunks_to_uva([[7], (8,)], 2).numpy(), [7, 8])
    assert first.numpy().tolist() == [1, 2]  # the refused calls took no slot: the good one took the second
