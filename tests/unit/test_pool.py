"""UvaBufferPool and UvaBackedTensor against a numpy model, on every tier this machine runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stagebuf import UvaBackedTensor, UvaBufferPool, capabilities, set_default_max_concurrency
from stagebuf._rings import guard as guard_mod


def _as(kind: str, a: np.ndarray):
    return {"list": a.tolist(), "ndarray": a, "tensor": torch.from_numpy(a.copy())}[kind]


@pytest.mark.parametrize("kind", ["list", "ndarray", "tensor"])
@pytest.mark.parametrize("trailing", [(), (3,)])
def test_copy_to_uva_round_robin(any_tier, kind, trailing):
    pool = UvaBufferPool((8, *trailing), torch.int32, max_concurrency=3)
    assert pool.tier is any_tier
    rng = np.random.default_rng(0)
    live: list[tuple[torch.Tensor, np.ndarray]] = []
    for _ in range(7):
        a = rng.integers(-100, 100, (int(rng.integers(0, 9)), *trailing)).astype(np.int32)
        t = pool.copy_to_uva(_as(kind, a))
        assert t.device == capabilities().device and t.dtype == torch.int32
        live = (live + [(t, a)])[-3:]
        for tt, aa in live:  # the last max_concurrency results are all still intact
            np.testing.assert_array_equal(tt.cpu().numpy(), aa)


def test_growth_is_power_of_two_and_keeps_other_slots(any_tier):
    pool = UvaBufferPool((4, 2), torch.float32, max_concurrency=2)
    a = np.arange(8, dtype=np.float32).reshape(4, 2)
    ta = pool.copy_to_uva(a)
    b = np.arange(22, dtype=np.float32).reshape(11, 2) * -1
    tb = pool.copy_to_uva(b)  # second slot grows 4 -> 16
    assert [buf.shape for buf in pool._ring.bufs] == [(4, 2), (16, 2)]
    assert all(buf.dtype == torch.float32 and buf.tier is any_tier for buf in pool._ring.bufs)
    np.testing.assert_array_equal(ta.cpu().numpy(), a)  # the other slot is untouched
    np.testing.assert_array_equal(tb.cpu().numpy(), b)
    assert pool.stats()["growths"] == 1


def test_copy_to_gpu_returns_device_memory(any_tier):
    pool = UvaBufferPool((4, 2), torch.int64)
    a = np.array([[1, 2], [3, 4], [5, 6]])
    g = pool.copy_to_gpu(a)
    pool.copy_to_uva(np.zeros((4, 2), np.int64))
    pool.copy_to_uva(np.zeros((4, 2), np.int64))  # both slots overwritten
    np.testing.assert_array_equal(g.cpu().numpy(), a)
    out = torch.full((3, 2), -1, dtype=torch.int64, device=pool.device)
    assert pool.copy_to_gpu(a * 2, out=out) is not None
    np.testing.assert_array_equal(out.cpu().numpy(), a * 2)


def test_transfers_counted_per_copy(cpu_tier):
    pool = UvaBufferPool(16, torch.int32)
    for i in range(5):
        pool.copy_to_uva(np.arange(10, dtype=np.int32) + i)
    s = pool.stats()
    copies = cpu_tier.name == "PAGEABLE"
    assert s["transfers"] == (5 if copies else 0) and s["bytes"] == (200 if copies else 0)


def test_unchanged_values_reuse_the_slot(cpu_tier):
    """A publish equal to the last one (its first n rows) reuses its slot: no copy, no slot taken."""
    pool = UvaBufferPool(16, torch.int32, max_concurrency=2)
    a = pool.copy_to_uva(np.arange(10, dtype=np.int32))
    again = pool.copy_to_uva(np.arange(10, dtype=np.int32))
    prefix = pool.copy_to_uva(np.arange(4, dtype=np.int32))
    assert again.data_ptr() == a.data_ptr() == prefix.data_ptr()
    b = pool.copy_to_uva(np.arange(10, dtype=np.int32) + 1)  # changed: the other slot
    assert b.data_ptr() != a.data_ptr()
    np.testing.assert_array_equal(a.numpy(), np.arange(10))  # the reused slot still holds its values
    np.testing.assert_array_equal(b.numpy(), np.arange(10) + 1)
    longer = pool.copy_to_uva(np.arange(12, dtype=np.int32) + 1)  # more rows than were published
    assert longer.data_ptr() == a.data_ptr()
    copies = cpu_tier.name == "PAGEABLE"
    assert pool.stats()["transfers"] == (3 if copies else 0)


@pytest.mark.parametrize(
    "x, err, msg",
    [
        (np.zeros((2, 2, 2), np.int32), ValueError, "rank 3"),
        (np.zeros((2, 4), np.int32), ValueError, r"rows of shape \(4,\).*\(3,\)"),
        ([[1, 2, 3], [4, 5]], ValueError, "not a rectangular"),
        ({"a": 1}, TypeError, "must be a list"),
        ("123", TypeError, "must be a list"),
        (np.zeros(3, np.int32), ValueError, "rank 1"),
    ],
)
def test_bad_input_is_refused_and_slots_kept(any_tier, x, err, msg):
    pool = UvaBufferPool((4, 3), torch.int32, max_concurrency=2)
    good = np.ones((2, 3), np.int32)
    t = pool.copy_to_uva(good)
    with pytest.raises(err, match=msg):
        pool.copy_to_uva(x)
    np.testing.assert_array_equal(t.cpu().numpy(), good)
    # Had the bad call taken slot 1, this call would go to slot 0 and overwrite t.
    pool.copy_to_uva(np.full((2, 3), 7, np.int32))
    np.testing.assert_array_equal(t.cpu().numpy(), good)


def test_out_must_match(any_tier):
    pool = UvaBufferPool((4, 3), torch.int32)
    out = torch.zeros((3, 3), dtype=torch.int32, device=pool.device)
    with pytest.raises(ValueError, match=r"expected shape \(2, 3\)"):
        pool.copy_to_gpu(np.ones((2, 3), np.int32), out=out)


def test_default_max_concurrency_has_floor_two(monkeypatch):
    monkeypatch.setattr(guard_mod, "_DEFAULT_MAX_CONCURRENCY", 2)
    set_default_max_concurrency(1)
    assert UvaBufferPool(4, torch.int32).max_concurrency == 2
    set_default_max_concurrency(5)
    assert UvaBufferPool(4, torch.int32).max_concurrency == 5
    with pytest.raises(ValueError, match="n=0"):
        set_default_max_concurrency(0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    depth=st.integers(2, 4),
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=25),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_copy_streams_match_numpy(cpu_tier, depth, lengths, seed):
    rng = np.random.default_rng(seed)
    pool = UvaBufferPool((3, 2), torch.int64, max_concurrency=depth)
    model_cap = [3] * depth  # independent model of slot capacities
    results: list[tuple[torch.Tensor, np.ndarray]] = []
    for i, n in enumerate(lengths):
        a = rng.integers(-(2**40), 2**40, (n, 2))
        if i % 2:
            results.append((pool.copy_to_gpu(a), a))
        else:
            results.append((pool.copy_to_uva(a), a))
        slot = i % depth
        if n > model_cap[slot]:
            model_cap[slot] = 1 << (n - 1).bit_length()
        assert [b.shape[0] for b in pool._ring.bufs] == model_cap
        for t, want in results[-depth:]:
            np.testing.assert_array_equal(t.cpu().numpy(), want)
        for t, want in results[1::2]:  # copy_to_gpu results are never overwritten
            np.testing.assert_array_equal(t.cpu().numpy(), want)


def test_backed_tensor_publishes_rows(any_tier):
    bt = UvaBackedTensor((6, 2), torch.int32, max_concurrency=2)
    assert not bt.gpu.cpu().numpy().any() and bt.gpu.shape == (6, 2)
    bt.np[:] = np.arange(12).reshape(6, 2)
    g = bt.copy_to_uva(4)
    assert g is bt.gpu and g.shape == (4, 2)
    np.testing.assert_array_equal(g.cpu().numpy(), np.arange(8).reshape(4, 2))
    bt.np[0] = 99
    np.testing.assert_array_equal(bt.copy_to_uva().cpu().numpy()[0], [99, 99])
    with pytest.raises(ValueError, match="n=-1"):
        bt.copy_to_uva(-1)
