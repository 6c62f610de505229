"""The step clock: one event per step for every ring of a device, checked against a model.

Events are faked (``helpers.use_events``): a ``FakeStream`` (helpers.py) hands out events
that complete in record order, only when one is synchronized (a guard wait) or
when the test says the device caught up. Every ring on the CPU then runs its
guard as it would on a GPU. Two models say what must happen:

* the *documented* rule: a ring that stages again in the step it already staged
  in ends the step (one event); an unmarked use is protected by the event that
  ends its step, a marked use (its consumer enqueued at ``mark()``: staged-write
  applies) by the first event recorded after the mark; a reuse waits (or raises)
  exactly when that event is pending;
* the *consumer* rule: a use is safe to overwrite once the first event recorded
  after its consumers completed. Whenever that event is pending the ring must
  wait: checked on every reuse.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stagebuf
from helpers import FakeStream, guard_staged_writes, use_events
from stagebuf import SlotInFlightError, StagedWriteTensor, StepStager, Tier, UvaBufferPool
from stagebuf._bytes.make import make_buffer
from stagebuf._common.errors import StepRuleError
from stagebuf._rings.ring import Ring

CPU = torch.device("cpu")


@pytest.fixture
def stream(monkeypatch) -> FakeStream:
    """Fake events for every ring made in this test (a new factory: a new step clock)."""
    s = FakeStream()
    use_events(monkeypatch, s.event)
    return s


def waits(*objs: Any) -> list[int]:
    return [o.stats()["guard_waits"] for o in objs]


def marked_ring(n: int = 2, mode: str = "wait") -> Ring:
    """The ring a staged write's launcher runs on UVA/PINNED: guarded, its uses marked at apply."""
    return Ring(n, lambda: make_buffer(16, torch.uint8, CPU, Tier.HOST), mode, "write slot")


def use_marked(ring: Ring) -> int:
    slot, _ = ring.acquire()
    ring.publish(slot, marked=True)  # the apply enqueued its kernel: the consumer of this use
    return slot


# --- one event per step ------------------------------------------------------------------


@pytest.mark.parametrize("depth", [2, 3])
def test_eight_pools_one_event_per_step(cpu_tier, stream, depth):
    pools = [UvaBufferPool(4, torch.int32, depth, "cpu", guard="wait") for _ in range(8)]
    assert all(p._ring.active and p._ring.guard.clock is pools[0]._ring.guard.clock for p in pools)
    steps = 40
    for s in range(steps):
        live = []
        for k, p in enumerate(pools):
            a = np.full(3, 100 * s + k, np.int32)
            live.append((p.copy_to_uva(a), a))
            assert stream.records == s  # step s's first stage ended step s - 1: one event, not eight
        for t, a in live:
            np.testing.assert_array_equal(t.cpu().numpy(), a)
    # the device never caught up: the first pool to come round waits for the step `depth` back
    # (and so completes it for every other pool)
    assert waits(*pools) == [steps - depth] + [0] * 7
    assert stream.syncs == steps - depth


def test_no_waits_when_the_device_keeps_up(cpu_tier, stream):
    pools = [UvaBufferPool(4, torch.int32, max_concurrency=2, device="cpu", guard="wait") for _ in range(8)]
    for s in range(20):
        stream.catch_up()  # the last step's work finished
        for p in pools:
            p.copy_to_uva(np.full(2, s, np.int32))
    assert waits(*pools) == [0] * 8 and stream.records == 19 and stream.syncs == 0


def test_pending_step_makes_the_pool_wait_or_raise(cpu_tier, stream):
    waiting = UvaBufferPool(4, torch.int32, max_concurrency=2, device="cpu", guard="wait")
    raising = UvaBufferPool(4, torch.int32, max_concurrency=2, device="cpu", guard="raise")
    results = []
    for s in range(2):
        r = raising.copy_to_uva(np.full(2, s, np.int32))
        results.append([r, waiting.copy_to_uva(np.full(2, s, np.int32))])
    assert stream.records == 1  # step 0 ended
    seq = raising._ring.seq
    with pytest.raises(SlotInFlightError, match="pool slot 0 comes round again for use 2 while use 0"):
        raising.copy_to_uva(np.full(2, 9, np.int32))  # step 0's event is pending
    assert raising._ring.seq == seq and waits(raising) == [0]  # no slot taken
    assert stream.records == 2  # the attempt still ended step 1 (it staged in it)
    for s, (r, w) in enumerate(results):  # nothing overwritten
        assert r.tolist() == [s, s] and w.tolist() == [s, s]
    waiting.copy_to_uva(np.full(2, 2, np.int32))  # same step: its slot 0 needs step 0's event: a wait
    assert waits(waiting) == [1] and stream.done_upto == 0
    t = raising.copy_to_uva(np.full(2, 2, np.int32))  # step 0 is done now: takes the slot refused before
    assert t.data_ptr() == results[0][0].data_ptr() and t.tolist() == [2, 2]
    assert results[1][0].tolist() == [1, 1]


def test_guard_off_and_auto_record_nothing(cpu_tier, stream):
    off = UvaBufferPool(4, torch.int32, device="cpu", guard="off")
    auto = StepStager(device="cpu", capacity=64, guard="auto")  # the device reads no host memory later
    assert not off._ring.active and auto.guard == "off"
    for s in range(6):
        off.copy_to_uva([s])
        with auto.step() as st_:
            st_.stage([s])
    assert stream.records == 0 and waits(off, auto) == [0, 0]


# --- marked rings: staged-write applies ---------------------------------------------------


def test_writes_only_loop_records_one_event_per_apply(stream):
    ring = marked_ring(2)
    for i in range(30):
        use_marked(ring)
        assert stream.records == max(0, i)  # each use after the first covers the one before
    assert ring.waits == 28  # nothing completes by itself: every reuse waits for the apply 2 back


def test_marked_use_is_protected_by_the_first_event_after_its_mark(cpu_tier, stream):
    pool = UvaBufferPool(4, torch.int32, max_concurrency=2, device="cpu", guard="wait")
    w = marked_ring(2)
    pool.copy_to_uva([0])  # step 0
    use_marked(w)  # write 0, marked in step 0: no event yet
    assert stream.records == 0
    pool.copy_to_uva([1])  # step 1: ends step 0, event 0 covers write 0 (recorded after its mark)
    use_marked(w)  # write 1: event 0 was recorded since write 0's mark: no event of its own
    assert stream.records == 1
    use_marked(w)  # write 2 reuses write 0's slot: event 0 pending, so it waits, and records event 1
    assert w.waits == 1 and stream.records == 2 and stream.done_upto == 0
    pool.copy_to_uva([2])  # step 2: ends step 1 (event 2); pool slot 0 (step 0: event 0) is done
    assert waits(pool) == [0] and stream.records == 3
    stream.catch_up(behind=1)  # events 0 and 1 done: write 1 (covered by event 1) may be reused
    use_marked(w)
    assert w.waits == 1 and stream.records == 3  # event 2 came after write 2's mark: nothing new


def test_stepstager_and_staged_write_each_step_one_event(cpu_tier, stream):
    stager = StepStager(device="cpu", capacity=256, max_concurrency=2, guard="wait")
    w = marked_ring(2)
    for s in range(30):
        with stager.step() as st_:
            st_.stage(np.full(4, s, np.int32))
        use_marked(w)  # the staged-write apply after the step's inputs
        assert stream.records == s
        stream.catch_up()  # step s's work is done by the time step s + 2 reuses its slots
    assert waits(stager) == [0] and w.waits == 0


def test_real_staged_write_applies_with_the_guard(monkeypatch, stream):
    """PAGEABLE on the CPU with its stager's guard forced on: applies are marked uses of the clock."""
    monkeypatch.setenv("STAGEBUF_TIER", "pageable")
    stagebuf.reset_capabilities()
    guard_staged_writes(monkeypatch, "wait")
    stager = StepStager(device="cpu", capacity=256, max_concurrency=2, guard="wait")
    t = StagedWriteTensor((4, 8), torch.int64, "cpu", max_concurrency=2)
    want = np.zeros((4, 8), np.int64)
    for s in range(20):
        with stager.step() as st_:
            st_.stage(np.arange(s + 1))
        t.stage_write(s % 4, 0, list(range(s, s + 8)))
        t.stage_writes([(s + 1) % 4], [2], np.array([[-s, -s]]))
        want[s % 4] = range(s, s + 8)
        want[(s + 1) % 4, 2:4] = -s
        t.apply_write()
        assert stream.records == s  # one event per step, for the stager and the write together
    np.testing.assert_array_equal(t.gpu.numpy(), want)
    assert t.stats()["steps"] == 20 and t.stats()["guard_waits"] + waits(stager)[0] == stream.syncs == 18
    for s in range(5):  # writes only: about one event per apply
        t.stage_write_elem(0, s)
        t.apply_write()
    assert stream.records == 19 + 5


# --- random rings and steps against the models ---------------------------------------------


@dataclass
class Use:
    tick: int
    mark: int | None = None  # marked: the clock's serial when it was marked
    consumed_at: int | None = None  # the serial when its consumers were enqueued


@dataclass
class RingModel:
    obj: Any
    kind: str  # "pool", "stager" (unmarked) or "write" (a stager whose steps are marked)
    n: int
    mode: str
    cur: int = -1
    last_tick: int = -1
    uses: dict[int, Use] = field(default_factory=dict)

    @property
    def marked(self) -> bool:
        return self.kind == "write"


class ClockModel:
    """The documented rule, independently: when events are recorded, which one a reuse needs."""

    def __init__(self) -> None:
        self.serial = 0
        self.tick = 0
        self.tick_end: dict[int, int] = {}
        self.done = -1

    def record(self) -> int:
        self.serial += 1
        return self.serial - 1

    def before_use(self, r: RingModel) -> tuple[str, int, int | None]:
        """Cover the ring's current use, then check the next slot: (outcome, slot, needed event)."""
        if r.cur >= 0:
            last = r.uses[r.cur]
            if r.marked:
                if last.mark is not None and last.mark >= self.serial:  # no event since its mark
                    self.record()
            elif r.last_tick == self.tick:  # it staged in this step already: the step ends
                self.tick_end[self.tick] = self.record()
                self.tick += 1
        slot = (r.cur + 1) % r.n
        prev = r.uses.get(slot)
        if prev is None:
            return "ok", slot, None
        need = prev.mark if r.marked else self.tick_end.get(prev.tick)
        assert need is not None and need < self.serial, "the documented event was never recorded"
        # the consumer rule: the first event after the consumers; pending means the ring must not go on
        assert prev.consumed_at is not None and prev.consumed_at < self.serial
        must_wait = prev.consumed_at > self.done
        if need <= self.done:
            assert not must_wait, "the documented event is done but the consumers may still read"
            return "ok", slot, need
        return ("raise" if r.mode == "raise" else "wait"), slot, need

    def take(self, r: RingModel, slot: int) -> Use:
        u = Use(self.tick)
        r.cur, r.uses[slot] = slot, u
        if r.marked:
            u.mark = u.consumed_at = self.serial
        else:
            r.last_tick = self.tick
        return u


def _use(r: RingModel, value: int) -> None:
    if r.kind == "pool":
        r.obj.copy_to_uva(np.full(2, value, np.int32))
    else:
        with r.obj.step() as s:
            s.stage(np.full(2, value, np.int64))
        if r.marked:
            r.obj.mark_consumed()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_rings_match_the_models(cpu_tier, monkeypatch, data):
    stream = FakeStream()
    use_events(monkeypatch, stream.event)  # a fresh clock for each example
    rings: list[RingModel] = []
    kinds = data.draw(st.lists(st.sampled_from(["pool", "stager"]), min_size=1, max_size=3))
    kinds += data.draw(st.lists(st.just("write"), max_size=2))
    for kind in kinds:
        depth = data.draw(st.integers(1, 3))
        mode = data.draw(st.sampled_from(["wait", "raise"]))
        obj: Any = (
            UvaBufferPool(4, torch.int32, depth, "cpu", guard=mode)
            if kind == "pool"
            else StepStager("cpu", capacity=64, max_concurrency=depth, guard=mode)
        )
        rings.append(RingModel(obj, kind, max(2, depth), mode))
    unmarked = [i for i, r in enumerate(rings) if not r.marked]
    marked = [i for i, r in enumerate(rings) if r.marked]
    m = ClockModel()
    value = 0
    for _step in range(data.draw(st.integers(1, 12))):
        # the engine order: every unmarked ring stages once, the step's kernels launch (its
        # consumers), applies (marked) anywhere; the device catches up at random moments
        ops: list[tuple[str, int]] = [("u", i) for i in unmarked]
        ops += [("m", i) for i in data.draw(st.lists(st.sampled_from(marked), max_size=2))] if marked else []
        ops += [("p", b) for b in data.draw(st.lists(st.integers(0, 3), max_size=2))]
        ops = data.draw(st.permutations(ops))
        last_u = max(k for k, op in enumerate(ops) if op[0] == "u")
        ops.insert(data.draw(st.integers(last_u + 1, len(ops))), ("launch", 0))
        step_uses: list[Use] = []
        for op, i in ops:
            if op == "p":
                stream.catch_up(i)
                m.done = stream.done_upto
                continue
            if op == "launch":
                for u in step_uses:
                    u.consumed_at = m.serial
                continue
            r = rings[i]
            value += 1
            outcome, slot, need = m.before_use(r)
            before = r.obj.stats()["guard_waits"]
            if outcome == "raise":
                with pytest.raises(SlotInFlightError):
                    _use(r, value)
                assert r.obj._ring.cur == r.cur  # no slot taken
                assert stream.records == m.serial
                # the engine waits for the device, then stages again (same step)
                assert need is not None
                stream.done_upto = m.done = max(m.done, need)
                outcome2, slot2, _ = m.before_use(r)
                assert (outcome2, slot2) == ("ok", slot)
                outcome = "ok"
            _use(r, value)
            assert r.obj._ring.cur == slot
            if outcome == "wait":
                assert need is not None
                m.done = max(m.done, need)
            assert r.obj.stats()["guard_waits"] - before == (outcome == "wait"), (op, i, outcome)
            assert stream.records == m.serial, "events recorded"
            assert stream.done_upto == m.done
            u = m.take(r, slot)
            if not r.marked:
                step_uses.append(u)
    assert stream.records <= value  # never more than one event per use


# --- a ring that skips a step: begin_step() protects it, STAGEBUF_CHECK=1 catches the misuse --------


def _skipping_ring_program(stream, begin: bool) -> tuple[UvaBufferPool, list[int]]:
    """Steps 0-3 of a pool ``a`` used every step and a pool ``x`` that skips step 1.

    Without ``begin_step()``, x's first staging in step 2 is counted in step 1, whose event is
    recorded when ``a`` stages again, before step 2's kernels are enqueued.
    """
    a = UvaBufferPool(4, torch.int32, max_concurrency=2, device="cpu", guard="wait")  # every step
    x = UvaBufferPool(4, torch.int32, max_concurrency=2, device="cpu", guard="raise")  # not in step 1
    launches: list[int] = []  # per step: the serial when its kernels were enqueued

    def step(k: int, pools: list[UvaBufferPool]) -> None:
        if begin:
            stagebuf.begin_step("cpu")
        for p in pools:
            p.copy_to_uva([k])
        launches.append(stream.records)  # the step's kernels

    step(0, [a, x])
    step(1, [a])
    step(2, [x, a])
    stream.catch_up()  # the device is done with every event so far, not with step 2's kernels
    assert launches[2] == stream.records  # step 2's kernels come after every recorded event
    step(3, [a, x])  # x's slot 0: step 0's use, long done
    return x, launches


def test_begin_step_protects_a_ring_that_skips_a_step(cpu_tier, stream):
    x, _ = _skipping_ring_program(stream, begin=True)
    with pytest.raises(SlotInFlightError):  # x's slot 1 still feeds step 2's kernels
        x.copy_to_uva([4])  # step 4


def test_check_mode_catches_a_skipping_ring_without_begin_step(cpu_tier, stream, monkeypatch):
    monkeypatch.setenv("STAGEBUF_CHECK", "1")
    x, _ = _skipping_ring_program(stream, begin=False)
    with pytest.raises(StepRuleError, match="begin_step"):
        x.copy_to_uva([4])  # the clock would release x's slot 1, which step 2's kernels still read


# --- a slot whose last use is older than the clock's event ring -----------------------------------


@pytest.mark.parametrize("caught_up", [True, False])
def test_a_slot_unused_for_more_steps_than_the_clock_keeps_events_is_checked_against_its_own(
    cpu_tier, stream, caught_up
):
    """A pool whose values stay the same reuses its slot step after step; when they change, the other
    slot comes round, last used about 65 steps back, its event object recorded again since. If the
    device finished that use long ago (and only the last step is pending) nothing waits; if it did not,
    the pool waits, as for any pending use."""
    from stagebuf._rings.guard import _CLOCK_EVENTS

    pool = UvaBufferPool(4, torch.int32, max_concurrency=2, device="cpu", guard="wait")
    first = pool.copy_to_uva([1, 1])  # slot 0
    stagebuf.begin_step("cpu")
    pool.copy_to_uva([2, 2])  # slot 1, reused below
    for _ in range(_CLOCK_EVENTS - 1):  # slot 0's step comes round in the clock's table as the last one
        stagebuf.begin_step("cpu")
        if caught_up:
            stream.catch_up(behind=1)  # the device keeps up with all but the step just ended
        pool.copy_to_uva([2, 2])  # unchanged: the same slot
    assert waits(pool) == [0]
    stagebuf.begin_step("cpu")
    if caught_up:
        stream.catch_up(behind=1)
    t = pool.copy_to_uva([3, 3])  # slot 0 again
    assert t.data_ptr() == first.data_ptr() and t.tolist() == [3, 3]
    assert waits(pool) == [0 if caught_up else 1]
    if not caught_up:
        assert stream.done_upto >= 0  # the wait completed slot 0's use
