"""StepStager: one transfer per step, contents, alignment, growth and the slot-reuse guard."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stagebuf
from helpers import force_tier, use_events
from stagebuf import SlotInFlightError, StepStager, Tier

DTYPES = [np.int8, np.int32, np.int64, np.float16, np.float32, np.float64, np.bool_]


def test_one_transfer_per_step_on_pageable_none_on_host(cpu_tier):
    stager = StepStager(capacity=1 << 12)
    for s in range(6):
        with stager.step() as step:
            for k in range(8):
                step.stage(np.full(64, s * 10 + k, np.int32))
    st_ = stager.stats()
    assert st_["steps"] == 6
    if cpu_tier is Tier.PAGEABLE:
        assert st_["transfers"] == 6 and st_["bytes"] == 6 * 8 * 256
    else:
        assert st_["transfers"] == 0 and st_["bytes"] == 0


def test_staged_tensors_hold_the_inputs_and_are_aligned(any_tier):
    stager = StepStager(capacity=4096)
    with stager.step() as step:
        a = step.stage([1, 2, 3], dtype=torch.int32)
        b = step.stage(np.arange(6, dtype=np.float64).reshape(2, 3))
        c = step.stage(torch.tensor([True, False, True]))
        d = step.stage(np.array([7], np.int8))
        e = step.stage([5, 6])  # dtype from the input: int64
    for t in (a, b, c, d, e):
        assert t.device == stager.device and t.data_ptr() % 16 == 0
    assert a.dtype == torch.int32 and a.tolist() == [1, 2, 3]
    assert b.shape == (2, 3) and b.cpu().numpy().tolist() == [[0, 1, 2], [3, 4, 5]]
    assert c.tolist() == [True, False, True] and d.tolist() == [7]
    assert e.dtype == torch.int64 and e.tolist() == [5, 6]


def test_growth_keeps_earlier_tensors_valid(any_tier):
    stager = StepStager(capacity=64, max_concurrency=2)
    with stager.step() as step:
        first = step.stage(np.arange(10, dtype=np.int32))  # 40 bytes: fits
        big = step.stage(np.arange(100, dtype=np.int64))  # 800 bytes: the slot grows
        last = step.stage(np.full(3, 9, np.int16))
    assert stager.stats()["growths"] == 1
    assert first.tolist() == list(range(10)) and big.tolist() == list(range(100))
    assert last.tolist() == [9, 9, 9]
    if any_tier is Tier.PAGEABLE:
        assert stager.stats()["transfers"] == 1  # the growth's extra copy is not a transfer
    # the grown slot fits the whole step next time round: no further growth
    for _ in range(4):
        with stager.step() as step:
            step.stage(np.arange(10, dtype=np.int32))
            step.stage(np.arange(100, dtype=np.int64))
    assert stager.stats()["growths"] == 2  # the other slot grew once too


def test_a_capacity_of_any_byte_count_stages_every_dtype(any_tier):
    """A slot of 100 bytes (not a multiple of 8) stages int64 and float64 arrays too."""
    stager = StepStager(capacity=100, max_concurrency=2)
    for s in range(3):
        with stager.step() as step:
            got = [(step.stage(np.arange(4, dtype=dt) + s), np.arange(4, dtype=dt) + s) for dt in DTYPES[:-1]]
        for t, want in got:
            np.testing.assert_array_equal(t.cpu().numpy(), want)


def _read(arena: torch.Tensor, off: int, n: int) -> np.ndarray:
    return arena[off : off + n].cpu().numpy()


def test_reserve_is_published_with_the_step_and_never_overlaps_a_replayed_stage(any_tier):
    """reserve(): bytes the caller writes, published with the step's stage() calls, on every tier;
    a later step that replays the stage() calls before it keeps both intact, also through growth."""
    stager = StepStager(capacity=256, max_concurrency=2)
    for s, n in enumerate([8, 24, 40, 72, 300, 40]):  # each slot reserves more than before; 300 grows
        a = np.arange(8, dtype=np.int32) + s
        with stager.step() as step:
            first = step.stage(a)
            host, arena, off = step.reserve(n)
            assert off % 16 == 0 and host.shape == (n,) and host.dtype == np.uint8
            host[:] = np.arange(n, dtype=np.int64) % 251 ^ s
            last = step.stage(a * 2)
        np.testing.assert_array_equal(first.cpu().numpy(), a)
        np.testing.assert_array_equal(_read(arena, off, n), np.arange(n) % 251 ^ s)
        np.testing.assert_array_equal(last.cpu().numpy(), a * 2)
    with pytest.raises(stagebuf.UsageError, match="already flushed"):
        step.reserve(8)


def test_typed_views_the_reserved_arena(any_tier):
    """typed(dtype): the arena reserve() returned, as that dtype; a slice at off // itemsize reads
    what the host wrote there once the step is published, through growth too."""
    stager = StepStager(capacity=64, max_concurrency=2)
    for s, n in enumerate([3, 5, 40, 7]):  # 40 float32 + 40 int64 outgrow the 64-byte slot
        f = np.linspace(0, 1, n, dtype=np.float32) + s
        i = np.arange(n, dtype=np.int64) - s
        with stager.step() as step:
            host, _, off = step.reserve(4 * n + 4 + 8 * n)
            o64 = (4 * n + 7) & -8
            host[: 4 * n].view(np.float32)[:] = f
            host[o64 : o64 + 8 * n].view(np.int64)[:] = i
            tf = step.typed(np.dtype(np.float32))[off // 4 : off // 4 + n]
            ti = step.typed(np.dtype(np.int64))[(off + o64) // 8 : (off + o64) // 8 + n]
        np.testing.assert_array_equal(tf.cpu().numpy(), f)
        np.testing.assert_array_equal(ti.cpu().numpy(), i)
    with pytest.raises(stagebuf.ArgumentTypeError, match="allowed: a numpy dtype"):
        step.typed(torch.float32)  # type: ignore[arg-type]


@pytest.mark.parametrize("check", [False, True])
def test_in_place_publishes_the_same_and_only_skips_the_scratch(any_tier, monkeypatch, check):
    """in_place=True: every step's tensors hold what a scratch-staging stager's hold once published;
    before the flush, where the device reads the slot's own memory (UVA, HOST), they already show the
    writes, except in check mode, which keeps the scratch arena (an early reader reads poison)."""
    if check:
        monkeypatch.setenv("STAGEBUF_CHECK", "1")
    rng = np.random.default_rng(7)
    plain, direct = StepStager(capacity=128), StepStager(capacity=128, in_place=True)
    assert direct.in_place is not check and not plain.in_place
    for s in range(6):
        arrays = [rng.integers(-50, 50, int(rng.integers(1, 40))).astype(np.int32) for _ in range(3)]
        early = {}
        for stager in (plain, direct):
            with stager.step() as step:
                ts = [step.stage(a) for a in arrays]
                host, arena, off = step.reserve(16)
                host[:] = s
                early[stager is direct] = ts[0].cpu().numpy().copy()  # before the flush
            for t, a in zip(ts, arrays):
                np.testing.assert_array_equal(t.cpu().numpy(), a)
            np.testing.assert_array_equal(_read(arena, off, 16), np.full(16, s))
        if any_tier.copies:
            continue  # PINNED, PAGEABLE: the device sees the step only through its copy
        if check:  # both read the poisoned slot (0xFF bytes: int32 -1)
            assert (early[True] == -1).all() and (early[False] == -1).all()
        else:
            np.testing.assert_array_equal(early[True], arrays[0])
            assert not np.array_equal(early[False], arrays[0])  # the slot's old contents
    with pytest.raises(stagebuf.ArgumentTypeError, match="in_place=1; allowed: True or False"):
        StepStager(in_place=1)  # type: ignore[arg-type]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    steps=st.lists(
        st.lists(
            st.tuples(
                st.sampled_from(DTYPES),
                st.integers(0, 40),
                st.sampled_from([0, 1, 3]),
                st.sampled_from(["ndarray", "list", "tensor"]),
            ),
            min_size=0,
            max_size=6,
        ),
        min_size=1,
        max_size=8,
    ),
    depth=st.integers(2, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_steps_match_inputs(cpu_tier, steps, depth, seed):
    rng = np.random.default_rng(seed)
    stager = StepStager(capacity=128, max_concurrency=depth)
    history: list[list[tuple[torch.Tensor, np.ndarray]]] = []
    for arrays in steps:
        staged = []
        with stager.step() as step:
            for dt, n, cols, kind in arrays:
                shape = (n,) if cols == 0 else (n, cols)
                a = (rng.standard_normal(shape) * 50).round().astype(dt)
                x = {"ndarray": a, "list": a.tolist(), "tensor": torch.from_numpy(a.copy())}[kind]
                t = step.stage(x, dtype=torch.from_numpy(a[:0]).dtype)
                staged.append((t, a if kind != "list" or a.size else a.reshape(0)))
        history.append(staged)
        for done in history[-depth:]:  # the last `depth` steps are all intact
            for t, a in done:
                assert t.data_ptr() % 16 == 0 and tuple(t.shape) == a.shape
                np.testing.assert_array_equal(t.cpu().numpy(), a)
    n_steps = len(steps)
    used = sum(1 for arrays in steps if any(np.dtype(d).itemsize * n * max(c, 1) for d, n, c, _ in arrays))
    assert stager.stats()["transfers"] == (used if cpu_tier is Tier.PAGEABLE else 0)
    assert stager.stats()["steps"] == n_steps


class FakeEvent:
    """A device event that stays unfinished until someone waits for it."""

    def __init__(self):
        self.pending = False
        self.waited = 0

    def record(self):
        self.pending = True

    def query(self):
        return not self.pending

    def synchronize(self):
        self.waited += 1
        self.pending = False


@pytest.fixture
def fake_events(monkeypatch):
    made: list[FakeEvent] = []

    def make(device):
        made.append(FakeEvent())
        return made[-1]

    use_events(monkeypatch, make)
    return made


def test_guard_raise_names_the_step_in_flight(cpu_tier, fake_events):
    stager = StepStager(capacity=256, max_concurrency=2, guard="raise")
    with stager.step() as s0:
        t0 = s0.stage(np.arange(4, dtype=np.int32))
    with stager.step() as s1:
        s1.stage(np.arange(4, dtype=np.int32))
    with pytest.raises(SlotInFlightError, match="use 0 may still be read"):
        stager.step()  # slot 0 comes round while step 0's event is unfinished
    assert t0.tolist() == [0, 1, 2, 3]  # nothing was overwritten


def test_guard_wait_counts_waits(cpu_tier, fake_events):
    stager = StepStager(capacity=256, max_concurrency=2, guard="wait")
    for s in range(6):
        with stager.step() as step:
            t = step.stage(np.full(4, s, np.int32))
        assert t.tolist() == [s] * 4
    # steps 2..5 each found their slot's previous step unfinished and waited for it
    assert stager.stats()["guard_waits"] == 4


def test_guard_mark_consumed_and_finished_events_do_not_wait(cpu_tier, fake_events):
    stager = StepStager(capacity=256, max_concurrency=2, guard="wait")
    for s in range(5):
        with stager.step() as step:
            step.stage(np.full(4, s, np.int32))
        stager.mark_consumed()
        for ev in fake_events:
            ev.pending = False  # the device finished
    assert stager.stats()["guard_waits"] == 0


def test_guard_auto_is_off_where_the_device_does_not_read_host_memory(cpu_tier):
    assert StepStager(capacity=64).guard == "off"
    assert StepStager(capacity=64, guard="wait").guard == "wait"
    with pytest.raises(ValueError, match="guard='sometimes'; allowed: auto, wait, raise, off"):
        StepStager(capacity=64, guard="sometimes")


def test_misuse_is_refused(cpu_tier):
    stager = StepStager(capacity=64)
    step = stager.step()
    with pytest.raises(RuntimeError, match="still open"):
        stager.step()
    with pytest.raises(ValueError, match="rank 3"):
        step.stage(np.zeros((1, 1, 1), np.int32))
    with pytest.raises(TypeError, match="must be a list"):
        step.stage(None)
    good = step.stage([1, 2])
    step.flush()
    with pytest.raises(RuntimeError, match="already flushed"):
        step.stage([3])
    assert good.tolist() == [1, 2]
    with pytest.raises(ValueError, match="capacity=0"):
        StepStager(capacity=0)


def test_empty_arrays_publish_nothing(cpu_tier):
    """A step of empty arrays transfers nothing (found by the GPU fuzz: capacity 16, one slot)."""
    stager = StepStager(capacity=16, max_concurrency=1)
    with stager.step() as st:
        a = st.stage(np.zeros(0, np.bool_))
        b = st.stage(np.zeros(0, np.bool_))
    assert a.numel() == b.numel() == 0
    assert stager.stats()["transfers"] == 0 and stager.stats()["bytes"] == 0


@pytest.mark.parametrize("tier", ["pageable", Tier.PAGEABLE, "host", None])
def test_a_tier_cap_gives_slots_of_that_tier_and_the_same_values(tier: Tier | str | None) -> None:
    s = StepStager("cpu", capacity=64, tier=tier)
    want = {None: Tier.HOST}.get(tier, Tier.PAGEABLE if str(tier).lower().endswith("pageable") else Tier.HOST)
    assert s.tier is want
    with s.step() as st:
        a = st.stage(np.array([3, 1, 2], np.int32))
        b = st.stage([0.5, 1.5])
    np.testing.assert_array_equal(a.numpy(), [3, 1, 2])
    np.testing.assert_array_equal(b.numpy(), [0.5, 1.5])


@pytest.mark.parametrize("tier", ["uva", "pinned", "bogus", 3])
def test_a_tier_that_cannot_work_or_names_none_is_refused_naming_the_allowed(tier: object) -> None:
    with pytest.raises(stagebuf.StagebufError, match="pageable|PAGEABLE") as e:
        StepStager("cpu", capacity=64, tier=tier)  # type: ignore[arg-type]
    assert "tier" in str(e.value).lower()


def test_an_empty_array_past_the_arena_does_not_grow_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the H200 fuzz: a zero-byte stage whose aligned offset passes the capacity grew the arena, and
    the step's one transfer (on a copy tier) went uncounted; an empty array fits anywhere."""
    force_tier(monkeypatch, "pageable")
    stager = StepStager("cpu", capacity=200)
    parts = [np.arange(80, dtype=np.int16).reshape(20, 4), np.arange(7, dtype=np.int32), np.ones(1, bool)]
    with stager.step() as s:
        got = [s.stage(a) for a in parts]
        empty = s.stage(np.ones(0, bool))
    assert [g.numpy().tolist() for g in got] == [a.tolist() for a in parts] and empty.shape == (0,)
    assert stager.stats()["growths"] == 0 and stager.stats()["transfers"] == 1
