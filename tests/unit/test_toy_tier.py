"""A tier is one place: a toy buffer class, installed through ``register_tier_class`` (the extension
point the four real classes use), runs the README contract and round trips with no other change.

Two toys replace PAGEABLE's class for a test (the real one is put back after):

* ``BounceBuffer`` copies into a device tensor of its own, as PAGEABLE does, but publishes through
  a bounce tensor holding only the rows asked, and poisons its own way; both count their calls, so a
  ring that published or poisoned a slot itself (not through ``uva()``/``poison()``) fails here.
* ``ReadsHostBuffer`` is registered as PAGEABLE's class yet states UVA's behaviour: the device reads
  the host memory itself (no copy), after the host call returned. A ring that asked the tier instead
  of the buffer would write a step into the slot the device reads, count transfers, and turn the
  guard off: each fails a check below.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from typing import ClassVar

import numpy as np
import pytest
import torch

from contract import STEPS, check_tier
from helpers import FakeStream, force_tier, use_events
from stagebuf import DeviceParamTable, StepStager, Tier, UvaBufferPool
from stagebuf._bytes.buffers import NonUvaBuffer, StagingBuffer, register_tier_class, tier_class
from stagebuf._bytes.checked import host_view
from stagebuf._common.convert import check_rows
from stagebuf._common.types import DeviceLike, DTypeLike
from stagebuf._device.memory import alloc_device, alloc_host
from stagebuf._rings.ring import Ring
from stagebuf._tiers.probe import capabilities
from stagebuf._tiers.settings import POISON

CPU = torch.device("cpu")


class _Toy(StagingBuffer):
    """A toy tier's storage: plain host memory, and the device side ``device_side()`` makes."""

    def __init__(self, size: int | Sequence[int], dtype: DTypeLike, device: DeviceLike = None):
        super().__init__(size, dtype)
        self.device = capabilities(device).device
        self.cpu = alloc_host(self.shape, self.dtype, pinned=False)
        self.np = host_view(self.cpu, f"{type(self).__name__}.np")
        self.dev = self.device_side()
        self._freeze()

    def device_side(self) -> torch.Tensor:
        raise NotImplementedError


class BounceBuffer(_Toy):
    """PAGEABLE-like (its flags are its tier's: it states none): plain host memory and a device tensor of
    its own; ``uva(n)`` copies the first ``n`` rows into a fresh bounce tensor, then into ``dev``."""

    tier = Tier.PAGEABLE
    calls: ClassVar[Counter[str]] = Counter()

    def device_side(self) -> torch.Tensor:
        return alloc_device(self.shape, self.dtype, self.device)

    def uva(self, n: int | None = None) -> torch.Tensor:
        k = check_rows(n, self.shape[0])
        bounce = self.cpu[:k].clone()  # only the rows asked
        out = self.dev[:k]
        out.copy_(bounce)
        self.calls["publish"] += 1
        self.calls["rows"] += k
        return out

    def poison(self) -> None:
        self.dev.view(torch.uint8).fill_(POISON)
        self.calls["poison"] += 1


class ReadsHostBuffer(_Toy):
    """Registered as PAGEABLE's class, stating the opposite of PAGEABLE's flags: ``dev`` is a view of the
    host memory (another tensor object: the device is not the host), read after the host call returned."""

    tier = Tier.PAGEABLE
    copies = False
    async_host_reads = True
    calls: ClassVar[Counter[str]] = Counter()

    def device_side(self) -> torch.Tensor:
        return self.cpu.view(self.shape)

    def uva(self, n: int | None = None) -> torch.Tensor:
        self.calls["publish"] += 1
        return self.rows(n)[0]

    def poison(self) -> None:
        self.cpu.view(torch.uint8).fill_(POISON)
        self.calls["poison"] += 1


def _install(cls: type[StagingBuffer]) -> Iterator[type[StagingBuffer]]:
    real = tier_class(Tier.PAGEABLE)
    cls.calls.clear()  # type: ignore[attr-defined]
    register_tier_class(cls)
    try:
        yield cls
    finally:
        register_tier_class(real)


@pytest.fixture
def bounce() -> Iterator[type[StagingBuffer]]:
    yield from _install(BounceBuffer)
    assert tier_class(Tier.PAGEABLE) is NonUvaBuffer  # the real class is back


@pytest.fixture
def reads_host() -> Iterator[type[StagingBuffer]]:
    yield from _install(ReadsHostBuffer)
    assert tier_class(Tier.PAGEABLE) is NonUvaBuffer


MODES = [None, 16, 0, 1]  # plain mode; check mode with quarantine 16, 0 and 1 (test_contract.py's)


@pytest.mark.parametrize("k", MODES)
def test_the_contract_holds_on_a_bounce_tier(bounce, monkeypatch, k):
    check_tier("pageable", monkeypatch, "cpu", k)
    # every publish went through the toy's uva(): the stager's STEPS flushes, the pool's STEPS calls
    assert BounceBuffer.calls["publish"] == 2 * STEPS
    # check mode: every step poisons its slot and (from the third on) the released one; the pool its
    # released slot from its third call on; all through the toy's poison()
    released = STEPS - 2
    assert BounceBuffer.calls["poison"] == (0 if k is None else STEPS + released + released)


@pytest.mark.parametrize("k", MODES)
def test_the_contract_holds_on_a_tier_whose_device_reads_host_memory(reads_host, monkeypatch, k):
    check_tier("pageable", monkeypatch, "cpu", k)
    assert ReadsHostBuffer.calls["publish"] == STEPS  # the pool's calls; a step publishes by a host copy
    released = STEPS - 2
    assert ReadsHostBuffer.calls["poison"] == (0 if k is None else STEPS + 2 * released)


def test_a_reads_host_tier_counts_no_transfer(reads_host, monkeypatch):
    force_tier(monkeypatch, "pageable")
    pool = UvaBufferPool(4, torch.int32, device="cpu")
    stager = StepStager(device="cpu", capacity=64)
    for s in range(3):
        pool.copy_to_uva(np.full(3, s, np.int32))
        with stager.step() as st:
            t = st.stage(np.full(2, s + 1, np.int64))
            old = s - 1 if s >= 2 else 0  # the slot's old contents (step s - 2's), not the new
            assert t.tolist() == [old, old]
        assert t.tolist() == [s + 1, s + 1]
    assert pool.stats()["transfers"] == 0 and stager.stats()["transfers"] == 0
    g = pool.copy_to_gpu(np.arange(4, dtype=np.int32))  # into device memory of its own: a transfer
    assert g.tolist() == [0, 1, 2, 3] and pool.stats()["transfers"] == 1


def _pool_and_stager(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeStream, UvaBufferPool, StepStager]:
    stream = FakeStream()
    use_events(monkeypatch, stream.event)  # the CPU "device" gets events: a guard can be kept
    force_tier(monkeypatch, "pageable")
    return stream, UvaBufferPool(4, torch.int32, 2, "cpu"), StepStager(device="cpu", capacity=64)


def test_auto_guard_follows_the_buffer_not_its_tier(reads_host, monkeypatch):
    stream, pool, stager = _pool_and_stager(monkeypatch)
    assert stager.guard == "wait"
    kept = [pool.copy_to_uva(np.full(2, s, np.int32)) for s in range(3)]
    # the third call comes round to slot 0, whose step's event is pending: the guard waits for it
    assert pool.stats()["guard_waits"] == 1 and stream.syncs == 1
    assert [t.tolist() for t in kept[1:]] == [[1, 1], [2, 2]]


def test_auto_guard_is_off_on_the_real_pageable_class(monkeypatch):
    stream, pool, stager = _pool_and_stager(monkeypatch)
    assert tier_class(Tier.PAGEABLE) is NonUvaBuffer and stager.guard == "off"
    for s in range(3):
        pool.copy_to_uva(np.full(2, s, np.int32))
    assert pool.stats()["guard_waits"] == 0 and stream.records == 0


def test_a_class_that_states_no_flag_has_its_tiers_and_any_async_slot_keeps_the_guard(monkeypatch):
    use_events(monkeypatch, FakeStream().event)

    class LatePinned(BounceBuffer):  # a PINNED class that states no flag
        tier = Tier.PINNED

    assert LatePinned.async_host_reads and LatePinned.copies
    ring = Ring(2, lambda: LatePinned(4, torch.uint8, CPU), "auto", "toy slot")
    assert ring.mode == "wait" and ring.active
    made = iter([BounceBuffer, LatePinned, BounceBuffer])  # a ring split by a fallback: one slot reads late
    mixed = Ring(3, lambda: next(made)(4, torch.uint8, CPU), "auto", "toy slot")
    assert mixed.mode == "wait" and mixed.active
    plain = Ring(2, lambda: BounceBuffer(4, torch.uint8, CPU), "auto", "toy slot")
    assert plain.mode == "off" and not plain.active


def test_pool_stager_and_param_table_round_trip_on_a_bounce_tier(bounce, monkeypatch):
    force_tier(monkeypatch, "pageable")
    rng = np.random.default_rng(7)
    pool = UvaBufferPool((4, 2), torch.int64, max_concurrency=3, device="cpu")
    live: list[tuple[torch.Tensor, np.ndarray] | None] = []  # the last max_concurrency uses (None: a copy)
    for c in range(12):
        a = rng.integers(-50, 50, (int(rng.integers(1, 11)), 2)) + 1000 * c  # new values: no reuse
        live = (live + [(pool.copy_to_uva(a), a)])[-3:]
        for use in live:  # the results of the last max_concurrency uses hold their values
            if use is not None:
                np.testing.assert_array_equal(use[0].numpy(), use[1])
        if c % 4 == 3:
            b = rng.integers(-9, 9, (3, 2))
            np.testing.assert_array_equal(pool.copy_to_gpu(b).numpy(), b)  # a copy_rows, no uva()
            live = (live + [None])[-3:]  # it took a slot too
    uses = 12 + 3
    assert pool.stats()["growths"] > 0 and pool.stats()["transfers"] == uses

    stager = StepStager(device="cpu", capacity=1 << 12)
    for _ in range(6):
        arrays = [rng.standard_normal(int(rng.integers(1, 9))), rng.integers(0, 99, (2, 3)).astype(np.int32)]
        with stager.step() as st:
            ts = [st.stage(a) for a in arrays]
        for t, a in zip(ts, arrays):
            np.testing.assert_array_equal(t.numpy(), a)
    assert stager.stats()["transfers"] == 6 and stager.stats()["growths"] == 0
    assert BounceBuffer.calls["publish"] == 12 + 6  # the pool's copy_to_uva calls and the steps

    table = DeviceParamTable(5, {"t": torch.float32, "k": torch.int32}, device="cpu")
    want = {"t": np.zeros(5, np.float32), "k": np.zeros(5, np.int32)}
    for r in range(4):
        row = int(rng.integers(0, 5))
        want["t"][row] = table["t"].np[row] = r + 0.5
        want["k"][row] = table["k"].np[row] = r * 7
        assert table.sync()
        for name, w in want.items():
            np.testing.assert_array_equal(table[name].gpu.numpy(), w)
    assert not table.sync() and table.stats()["transfers"] == 4
