"""Fault injection: every way the platform can refuse us, one test each.

Each fault must degrade to the next tier (or raise a clear error), give exactly
one warning, keep the data correct and lose nothing staged before it.

The faults are injected where the OS and driver answer (``memory.alloc_host`` /
``alloc_device`` as bound in ``stagebuf._bytes.buffers``, ``probe._alloc_pinned``,
``uva.load_cudart``, ``uva.device_view``), never inside stagebuf's own logic. Two
backends run the same tests:

* ``fake``: a CPU-only machine posing as ``cuda:0`` (CPU memory stands in for the
  device's, a device view is the host tensor itself, as a live UVA alias is). Runs in CI.
* ``cuda``: the real GPU, with the same answers broken one at a time (gpu marker).

Real faults too: pinned allocation on a CPU-only torch really fails, the tiny
memlock limit is a real ``setrlimit`` in a subprocess, and on the GPU the out of
memory comes from the real caching allocator under a memory-fraction cap.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import re
import resource
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import stagebuf
from helpers import force_tier, read_back, use_events
from stagebuf import (
    DeviceAllocationError,
    FusedStagedWriter,
    PinnedAllocationError,
    SlotInFlightError,
    StagedWriteTensor,
    StepStager,
    Tier,
    UvaBackedTensor,
    UvaBufferPool,
    UvaError,
    capabilities,
)
from stagebuf._device import memory as memory_mod
from stagebuf._device import uva as uva_mod
from stagebuf._rings.param_table import DeviceParamTable
from stagebuf._tiers import probe as caps_mod

buffers_mod = importlib.import_module("stagebuf._bytes.buffers")
sw_api = importlib.import_module("stagebuf._rings.staged_write.writers")
sw_plan = importlib.import_module("stagebuf._rings.staged_write.launcher")
pt_mod = importlib.import_module("stagebuf._rings.param_table")

HAS_CUDA = torch.cuda.is_available()
ROOT = Path(__file__).resolve().parents[2]
DEV = "cuda:0"


# --------------------------------------------------------------------------- the driver


class Driver:
    """The OS/driver answers, each switchable to a failure. Counts the faults it injected."""

    def __init__(self, fake: bool):
        self.fake = fake
        self.pinned_fails = False
        self.cudart_missing = False
        self.view_fails = False
        self.stale_view = False
        self.oom_above: int | None = None
        """Device allocations of more bytes than this fail with out of memory."""
        self.injected = 0

    # memory.alloc_host as stagebuf._bytes.buffers calls it
    def alloc_host(
        self, shape: tuple[int, ...], dtype: torch.dtype, pinned: bool, tier: Tier | None = None
    ) -> torch.Tensor:
        if pinned and self.pinned_fails:
            self.injected += 1
            if self.fake:  # the real call really fails on a CPU-only torch: no pinned allocator
                return memory_mod.alloc_host(shape, dtype, pinned=True)
            raise PinnedAllocationError(
                f"pinned allocation of {shape} {dtype} failed: CUDA error: out of memory (injected)"
            )
        if self.fake:
            return torch.zeros(shape, dtype=dtype)  # is_pinned() answers True under the fake
        return memory_mod.alloc_host(shape, dtype, pinned)

    def alloc_pinned(self, nbytes: int) -> torch.Tensor:
        return self.alloc_host((nbytes,), torch.uint8, pinned=True)

    def alloc_device(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, tier: Tier | None = None
    ) -> torch.Tensor:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if self.oom_above is not None and nbytes > self.oom_above:
            self.injected += 1
            raise DeviceAllocationError(
                f"out of device memory allocating {nbytes} bytes ({shape} {dtype}) on {device}: "
                "free device memory or lower the buffer size (injected)"
            )
        if self.fake:
            return torch.zeros(shape, dtype=dtype)  # CPU memory stands in for the device's
        return memory_mod.alloc_device(shape, dtype, device)

    @contextlib.contextmanager
    def oom(self, above: int) -> Iterator[None]:
        """Device allocations of more than ``above`` bytes fail while inside."""
        self.oom_above = above
        try:
            yield
        finally:
            self.oom_above = None

    def load_cudart(self) -> Any:
        if self.cudart_missing:
            self.injected += 1
            raise ImportError("No module named 'cuda' (injected)")
        return object() if self.fake else _REAL_LOAD_CUDART()

    def device_view(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        if self.view_fails:
            self.injected += 1
            raise UvaError("cudaHostGetDevicePointer failed with CUDA error 1 (injected)")
        view = host if self.fake else _REAL_DEVICE_VIEW(host, device)  # fake: a live alias
        if self.stale_view:
            self.injected += 1
            return view.clone()  # a copy taken at creation: later host writes are not seen
        return view


_REAL_LOAD_CUDART = uva_mod.load_cudart
_REAL_DEVICE_VIEW = uva_mod.device_view


def _fake_copy_to(self: Any, out: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """StagingBuffer.copy_to under the fake: ``out`` lives in CPU memory standing in for cuda:0's."""
    assert out.device.type == "cpu" and out.dtype == self.dtype and tuple(out.shape[1:]) == self.shape[1:]
    k = self.shape[0] if n is None else n
    assert 0 <= k <= min(self.shape[0], out.shape[0])
    dst = out[:k]
    dst.copy_(self.cpu[:k])
    return dst


@pytest.fixture(params=["fake", pytest.param("cuda", marks=pytest.mark.gpu)])
def drv(request, monkeypatch) -> Iterator[Driver]:
    """A Driver installed for device cuda:0, on the fake or the real GPU."""
    fake = request.param == "fake"
    if fake and HAS_CUDA:
        pytest.skip("the fake accelerator is for CPU-only machines; the cuda variant runs here")
    if not fake and not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    d = Driver(fake)
    monkeypatch.setattr(caps_mod, "_is_wsl", lambda: False)
    monkeypatch.setattr(caps_mod, "device_missing", lambda dev: None)
    monkeypatch.setattr(caps_mod, "_memlock_limit", lambda: None)
    monkeypatch.setattr(caps_mod, "_alloc_pinned", d.alloc_pinned)
    monkeypatch.setattr(buffers_mod, "alloc_host", d.alloc_host)
    monkeypatch.setattr(buffers_mod, "alloc_device", d.alloc_device)
    monkeypatch.setattr(sw_api, "alloc_device", d.alloc_device)
    monkeypatch.setattr(pt_mod, "alloc_device", d.alloc_device)
    monkeypatch.setattr(uva_mod, "load_cudart", d.load_cudart)
    monkeypatch.setattr(uva_mod, "device_view", d.device_view)
    if fake:
        monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a: True)
        use_events(monkeypatch, lambda device: None)  # no events without a GPU
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        monkeypatch.setattr(sw_plan, "triton_usable", lambda device: False)  # no Triton without a GPU
        # copy_to checks that `out` is on the buffer's device; the fake's device memory is CPU memory
        monkeypatch.setattr(buffers_mod.StagingBuffer, "copy_to", _fake_copy_to)
    yield d
    if not fake:
        torch.cuda.synchronize()


@pytest.fixture
def warnings_seen(caplog) -> Any:
    caplog.set_level(logging.WARNING, logger="stagebuf")

    def seen() -> list[str]:
        return [
            r.getMessage() for r in caplog.records if r.name == "stagebuf" and r.levelno >= logging.WARNING
        ]

    return seen


def _check_pool(pool: UvaBufferPool, rng: np.random.Generator, calls: int = 6, longest: int = 40) -> None:
    """Push ``calls`` inputs through ``pool``; the last max_concurrency results must all be intact."""
    live: list[tuple[torch.Tensor, np.ndarray]] = []
    for _ in range(calls):
        a = rng.integers(-(2**31), 2**31 - 1, int(rng.integers(0, longest + 1))).astype(np.int32)
        live = (live + [(pool.copy_to_uva(a), a)])[-pool.max_concurrency :]
        for t, want in live:
            np.testing.assert_array_equal(read_back(t), want)


def _check_stager(stager: StepStager, rng: np.random.Generator, steps: int = 4) -> None:
    for _ in range(steps):
        arrays = [
            rng.integers(0, 1000, int(rng.integers(1, 200))).astype(np.int64),
            rng.standard_normal((3, int(rng.integers(1, 50)))).astype(np.float32),
        ]
        with stager.step() as s:
            outs = [s.stage(a) for a in arrays]
        for t, a in zip(outs, arrays, strict=True):
            np.testing.assert_array_equal(read_back(t), a)


# --------------------------------------------------------------------------- probe-time faults


@dataclass(frozen=True)
class ProbeFault:
    """A driver answer broken before the probe, and what capabilities() and a pool then give."""

    fault: str  # the Driver switch turned on
    tier: Tier  # the tier the probe falls to
    reason: str  # a regex one of the probe's reasons matches
    warned: tuple[str, ...]  # what the one warning says
    seed: int
    pool: dict[str, Any] = field(default_factory=dict)  # UvaBufferPool's arguments but device


PROBE_FAULTS = {
    "pinned_allocation_gives_pageable": ProbeFault(
        "pinned_fails", Tier.PAGEABLE, r"^No pinned memory(?s:.)*ulimit -l", ("PAGEABLE", "No pinned memory"),
        1, {"size": 8, "dtype": torch.int32, "max_concurrency": 2},
    ),
    "cuda_bindings_missing_gives_pinned": ProbeFault(  # guard events without cuda-bindings
        "cudart_missing", Tier.PINNED, "cuda-bindings is not installed", ("PINNED", "cuda-bindings"),
        2, {"size": 8, "dtype": torch.int32, "max_concurrency": 3},
    ),
    "device_view_failing_gives_pinned": ProbeFault(
        "view_fails", Tier.PINNED, "cudaHostGetDevicePointer failed", (),
        3, {"size": (4,), "dtype": torch.int32},
    ),
    "coherence_probe_failing_gives_pinned": ProbeFault(
        "stale_view", Tier.PINNED, "coherence probe failed", ("coherence probe failed",),
        4, {"size": 8, "dtype": torch.int32},
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(PROBE_FAULTS))
def test_fault_at_probe_falls_to_a_lower_tier(drv, warnings_seen, case):
    """A driver answer broken at probe time: the next tier down, its reason, one warning, the data intact."""
    f = PROBE_FAULTS[case]
    setattr(drv, f.fault, True)
    caps = capabilities(DEV)
    assert caps.tier is f.tier and not caps.uva
    assert caps.pin_memory == (f.tier is Tier.PINNED)
    assert any(re.search(f.reason, r) for r in caps.reasons), caps.reasons
    rng = np.random.default_rng(f.seed)
    pool = UvaBufferPool(**f.pool, device=DEV)
    assert pool.tier is f.tier
    _check_pool(pool, rng)
    _check_stager(StepStager(device=DEV, capacity=256), rng)
    assert drv.injected >= 1
    w = warnings_seen()
    assert len(w) == 1 and all(part in w[0] for part in f.warned), w


# --------------------------------------------------------------------------- run-time faults


def _uva_or_skip() -> None:
    if capabilities(DEV).tier is not Tier.UVA:
        pytest.skip(f"needs UVA on {DEV}; tier is {capabilities(DEV).tier.name}")


def _pool_built_under(
    drv: Driver, fault: str, tier: Tier, seed: int, dtype: torch.dtype, max_concurrency: int
) -> tuple[UvaBufferPool, np.random.Generator]:
    """On a UVA machine: the Driver's ``fault`` turned on, then a pool of 8 built; it is on ``tier``."""
    _uva_or_skip()
    setattr(drv, fault, True)
    rng = np.random.default_rng(seed)
    pool = UvaBufferPool(8, dtype, max_concurrency=max_concurrency, device=DEV)
    assert pool.tier is tier
    return pool, rng


def test_pinned_allocation_failing_at_construction_falls_back_once(drv, warnings_seen):
    pool, rng = _pool_built_under(drv, "pinned_fails", Tier.PAGEABLE, 5, torch.int32, 3)
    _check_pool(pool, rng)
    UvaBufferPool(8, torch.int32, max_concurrency=3, device=DEV)  # the same fault again: no new warning
    assert drv.injected >= 2
    w = warnings_seen()
    # one fault, one warning: not one per tier tried on the way down (UVA, then PINNED)
    assert len(w) == 1, w
    assert "PAGEABLE" in w[0]


def test_pinned_allocation_failing_at_pool_growth(drv, warnings_seen):
    _uva_or_skip()
    rng = np.random.default_rng(6)
    pool = UvaBufferPool(4, torch.int32, max_concurrency=2, device=DEV)
    a = np.arange(4, dtype=np.int32) + 7
    ta = pool.copy_to_uva(a)
    drv.pinned_fails = True
    b = rng.integers(-1000, 1000, 100).astype(np.int32)
    tb = pool.copy_to_uva(b)  # the second slot grows 4 -> 128 while pinned memory is refused
    assert pool.tier is Tier.PAGEABLE and pool.stats()["growths"] == 1
    np.testing.assert_array_equal(read_back(ta), a)  # the other slot is untouched
    np.testing.assert_array_equal(read_back(tb), b)
    _check_pool(pool, rng, calls=8, longest=300)  # the other slot grows too, and falls back
    assert drv.injected >= 2
    assert len(warnings_seen()) == 1, warnings_seen()


def test_pinned_allocation_failing_at_stager_growth(drv, warnings_seen):
    _uva_or_skip()
    rng = np.random.default_rng(7)
    stager = StepStager(device=DEV, capacity=64)
    with stager.step() as s:
        first = np.arange(8, dtype=np.int32)
        t_first = s.stage(first)
    drv.pinned_fails = True
    with stager.step() as s:
        small = np.arange(6, dtype=np.int64) * 3
        t_small = s.stage(small)  # fits the slot
        big = rng.integers(0, 1 << 40, 100)
        t_big = s.stage(big)  # grows the slot: pinned refused, falls back for this slot
    assert stager.tier is Tier.PAGEABLE and stager.stats()["growths"] == 1
    for t, want in ((t_first, first), (t_small, small), (t_big, big)):
        np.testing.assert_array_equal(read_back(t), want)
    _check_stager(stager, rng)
    assert drv.injected >= 1
    assert len(warnings_seen()) == 1, warnings_seen()


def test_device_view_failing_at_construction_falls_back_to_pinned(drv, warnings_seen):
    pool, rng = _pool_built_under(drv, "view_fails", Tier.PINNED, 8, torch.float32, 2)
    a = rng.standard_normal(8).astype(np.float32)
    np.testing.assert_array_equal(read_back(pool.copy_to_uva(a)), a)
    bt = UvaBackedTensor(5, torch.int64, device=DEV)
    assert bt.tier is Tier.PINNED
    bt.np[:] = [5, 4, 3, 2, 1]
    np.testing.assert_array_equal(read_back(bt.copy_to_uva(3)), [5, 4, 3])
    w = warnings_seen()
    assert len(w) == 1 and "UVA" in w[0] and "cudaHostGetDevicePointer" in w[0]


Edit = tuple[int, int, np.ndarray]


def _sw_edits(rng: np.random.Generator, rows: int, cols: int, count: int) -> list[Edit]:
    edits = []
    for _ in range(count):
        start = int(rng.integers(0, cols))
        n = int(rng.integers(1, cols - start + 1))
        vals = rng.integers(-(2**31), 2**31 - 1, n).astype(np.int32)
        edits.append((int(rng.integers(0, rows)), start, vals))
    return edits


def _sw_model(model: np.ndarray, edits: list[Edit]) -> np.ndarray:
    for row, start, vals in edits:
        model[row, start : start + vals.shape[0]] = vals
    return model


def _sw_stage(swt: StagedWriteTensor, edits: list[Edit]) -> list[Edit]:
    for e in edits:
        swt.stage_write(*e)
    return edits


def _sw_target(rng: np.random.Generator) -> tuple[StagedWriteTensor, np.ndarray]:
    """A (64, 256) int32 target with 3 random edits applied, and its model."""
    swt = StagedWriteTensor((64, 256), torch.int32, DEV)
    first = _sw_stage(swt, _sw_edits(rng, 64, 256, 3))
    swt.apply_write()
    return swt, _sw_model(np.zeros((64, 256), np.int32), first)


def test_pinned_allocation_failing_at_staged_write_growth(drv, warnings_seen):
    _uva_or_skip()
    rng = np.random.default_rng(12)
    swt, model = _sw_target(rng)
    drv.pinned_fails = True
    big = _sw_stage(swt, _sw_edits(rng, 64, 256, 200))  # about 100 KiB of contents: the apply's slot grows
    swt.apply_write()
    np.testing.assert_array_equal(read_back(swt.gpu), _sw_model(model, big))
    assert swt.stats()["growths"] >= 1 and drv.injected >= 1
    assert len(warnings_seen()) == 1, warnings_seen()


@pytest.mark.parametrize("tier", ["pinned", "pageable"])
def test_device_oom_at_staged_write_growth_keeps_every_edit(drv, monkeypatch, warnings_seen, tier):
    force_tier(monkeypatch, tier)
    rng = np.random.default_rng(13)
    swt, model = _sw_target(rng)
    big = _sw_stage(swt, _sw_edits(rng, 64, 256, 200))
    staged = swt.num_staged
    drv.oom_above = 1 << 15
    with pytest.raises(DeviceAllocationError, match="out of device memory"):
        swt.apply_write()
    assert swt.num_staged == staged  # nothing staged was lost...
    np.testing.assert_array_equal(read_back(swt.gpu), model)  # ...and nothing half-applied
    drv.oom_above = None
    swt.apply_write()
    np.testing.assert_array_equal(read_back(swt.gpu), _sw_model(model, big))
    assert swt.num_staged == 0 and drv.injected == 1 and warnings_seen() == []


def test_device_oom_at_fused_apply_keeps_every_edit(drv, monkeypatch, warnings_seen):
    force_tier(monkeypatch, "pinned")
    rng = np.random.default_rng(14)
    ts = [StagedWriteTensor((32, 128), torch.int32, DEV) for _ in range(3)]
    models = [np.zeros((32, 128), np.int32) for _ in ts]
    writer = FusedStagedWriter(DEV, 4)
    edits = [_sw_edits(rng, 32, 128, 150) for _ in ts]
    for t, es in zip(ts, edits, strict=True):
        _sw_stage(t, es)
    drv.oom_above = 1 << 14
    with pytest.raises(DeviceAllocationError, match="out of device memory"):
        writer.apply(ts)
    assert [t.num_staged for t in ts] == [150, 150, 150]
    drv.oom_above = None
    writer.apply(ts)
    for t, m, es in zip(ts, models, edits, strict=True):
        np.testing.assert_array_equal(read_back(t.gpu), _sw_model(m, es))
    assert warnings_seen() == []


def test_pinned_allocation_failing_for_a_uva_staged_write_target(drv, warnings_seen):
    _uva_or_skip()
    drv.pinned_fails = True
    swt = StagedWriteTensor((4, 8), torch.int64, DEV, uva_instead_of_gpu=True)
    assert not swt.in_host_memory  # a device tensor instead
    swt.stage_write(2, 3, [1, 2, 3])
    swt.stage_write_elem(0, -5)
    swt.apply_write()
    want = np.zeros((4, 8), np.int64)
    want[2, 3:6] = [1, 2, 3]
    want[0, 0] = -5
    np.testing.assert_array_equal(read_back(swt.gpu), want)
    StagedWriteTensor((4, 8), torch.int64, DEV, uva_instead_of_gpu=True).apply_write()
    w = warnings_seen()
    # the target's storage and the apply's staging slots each fall back, each said once
    assert sum("is a device tensor" in m for m in w) == 1, w
    assert len(w) <= 2, w


def test_pinned_allocation_failing_for_param_table_slots(drv, warnings_seen):
    _uva_or_skip()
    drv.pinned_fails = True
    table = DeviceParamTable(6, {"temperature": torch.float32, "top_k": torch.int32}, DEV)
    assert table.tier is Tier.PAGEABLE
    for i in range(5):
        table["temperature"].np[:] = np.linspace(0, 1, 6, dtype=np.float32) * i
        table["top_k"].np[i] = i + 1
        assert table.sync()
        np.testing.assert_array_equal(read_back(table["temperature"].gpu), table["temperature"].np)
        np.testing.assert_array_equal(read_back(table["top_k"].gpu), table["top_k"].np)
    assert len(warnings_seen()) == 1, warnings_seen()


def test_device_oom_at_param_table_construction(drv, monkeypatch):
    force_tier(monkeypatch, "pinned")
    drv.oom_above = 1 << 20
    with pytest.raises(DeviceAllocationError, match=r"out of device memory allocating \d+ bytes"):
        DeviceParamTable(1 << 20, {"temperature": torch.float32, "seed": torch.int64}, DEV)
    drv.oom_above = None
    table = DeviceParamTable(8, {"temperature": torch.float32}, DEV)  # smaller: works
    table["temperature"].np[:] = 0.5
    assert table.sync()
    np.testing.assert_array_equal(read_back(table["temperature"].gpu), np.full(8, 0.5, np.float32))


def _pool_growth_refused(
    pool: UvaBufferPool, big: np.ndarray, match: str, b: list[int], fault: AbstractContextManager[Any]
) -> None:
    """A pool slot that cannot grow for ``big`` (under ``fault``): the call raises and takes no slot."""
    a = np.array([1, 2, 3, 4], np.int32)
    ta = pool.copy_to_uva(a)
    with fault:
        with pytest.raises(DeviceAllocationError, match=match):
            pool.copy_to_uva(big)
        tb = pool.copy_to_uva(np.array(b, np.int32))  # the failed call took no slot: a is still in the window
        np.testing.assert_array_equal(read_back(ta), a)
        np.testing.assert_array_equal(read_back(tb), b)
        assert pool.stats()["growths"] == 0


def _stager_growth_refused(
    stager: StepStager,
    a: np.ndarray,
    too_big: list[np.ndarray],
    fault: AbstractContextManager[Any],
    seed: int,
) -> None:
    """A step that cannot grow its slot for ``too_big`` (under ``fault``) raises; the step before it keeps
    its values (the abandoned step used the other slot), and the stager goes on."""
    with stager.step() as s:
        ta = s.stage(a)
    with fault, pytest.raises(DeviceAllocationError, match="out of device memory"), stager.step() as s:
        for x in too_big:
            s.stage(x)
    np.testing.assert_array_equal(read_back(ta), a)
    _check_stager(stager, np.random.default_rng(seed))


@pytest.mark.parametrize("tier", ["pinned", "pageable"])
def test_device_oom_at_pool_growth_raises_and_keeps_slots(drv, monkeypatch, warnings_seen, tier):
    force_tier(monkeypatch, tier)
    pool = UvaBufferPool(4, torch.int32, max_concurrency=2, device=DEV)
    big = np.arange(1000, dtype=np.int32)
    _pool_growth_refused(pool, big, r"out of device memory allocating 4096 bytes", [9, 8], drv.oom(1024))
    _check_pool(pool, np.random.default_rng(9))  # and the pool still grows once memory is back
    assert drv.injected == 1
    assert warnings_seen() == []  # an error, not a warning


def test_device_oom_at_stager_growth_raises_and_keeps_steps(drv, monkeypatch, warnings_seen):
    force_tier(monkeypatch, "pinned")
    stager = StepStager(device=DEV, capacity=64, max_concurrency=2)
    too_big = [np.arange(3, dtype=np.int32), np.arange(1000, dtype=np.int64)]
    _stager_growth_refused(stager, np.arange(10, dtype=np.int32), too_big, drv.oom(100), 10)
    assert drv.injected == 1 and warnings_seen() == []


def test_alloc_device_turns_out_of_memory_into_a_clear_error(monkeypatch):
    real_zeros = torch.zeros

    def zeros(*args: Any, **kw: Any) -> torch.Tensor:
        if kw.get("device") is not None and torch.device(kw["device"]).type == "cuda":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB (injected)")
        return real_zeros(*args, **kw)

    monkeypatch.setattr(torch, "zeros", zeros)
    with pytest.raises(DeviceAllocationError, match=r"allocating 4294967296 bytes .* on cuda:0") as ei:
        memory_mod.alloc_device((1 << 30,), torch.float32, torch.device("cuda:0"))
    assert isinstance(ei.value.__cause__, torch.OutOfMemoryError)


@pytest.mark.skipif(HAS_CUDA, reason="pinned memory works on a CUDA machine")
def test_pinned_allocation_really_fails_without_an_accelerator():
    with pytest.raises(
        PinnedAllocationError, match=r"pinned allocation of \(16,\) torch.int32 \(64 bytes, 64 B\) failed"
    ):
        memory_mod.alloc_host((16,), torch.int32, pinned=True)


def test_unpinned_pinned_allocation_is_refused(monkeypatch):
    real_zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, pin_memory=False, **kw: real_zeros(*a, **kw))
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a: False)
    with pytest.raises(PinnedAllocationError, match="came back unpinned"):
        memory_mod.alloc_host((16,), torch.int32, pinned=True)


# --------------------------------------------------------------------------- the slot guard refusing


class _Event:
    """A CUDA event stand-in that stays unfinished until released."""

    released = False

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return _Event.released

    def synchronize(self) -> None:
        _Event.released = True


@pytest.fixture
def stuck_events(monkeypatch) -> type[_Event]:
    _Event.released = False
    use_events(monkeypatch, lambda device: _Event())
    return _Event


def test_guard_refusal_takes_no_pool_slot(cpu_tier, stuck_events):
    pool = UvaBufferPool(4, torch.int32, max_concurrency=2, guard="raise")
    a, b, c = (np.full(3, v, np.int32) for v in (1, 2, 3))
    pool.copy_to_uva(a)
    tb = pool.copy_to_uva(b)
    with pytest.raises(SlotInFlightError, match="pool slot 0 comes round again"):
        pool.copy_to_uva(c)
    stuck_events.released = True  # the device caught up
    tc = pool.copy_to_uva(c)  # must take slot 0, the one refused, not overwrite b's slot
    np.testing.assert_array_equal(read_back(tb), b)
    np.testing.assert_array_equal(read_back(tc), c)


def test_guard_refusal_takes_no_stager_slot(cpu_tier, stuck_events):
    stager = StepStager(capacity=64, max_concurrency=2, guard="raise")
    with stager.step() as s:
        s.stage(np.full(3, 1, np.int32))
    with stager.step() as s:
        b = np.full(3, 2, np.int32)
        tb = s.stage(b)
    with pytest.raises(SlotInFlightError, match="step slot 0"):
        stager.step()
    stuck_events.released = True
    with stager.step() as s:
        c = np.full(3, 3, np.int32)
        tc = s.stage(c)
    np.testing.assert_array_equal(read_back(tb), b)
    np.testing.assert_array_equal(read_back(tc), c)


# --------------------------------------------------------------------------- a tiny memlock limit, for real

MEMLOCK = 64 * 1024

_MEMLOCK_CHILD = textwrap.dedent(
    """
    import json, resource
    import numpy as np, torch, stagebuf
    out = {"rlimit": resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]}
    caps = stagebuf.capabilities()
    out.update(tier=caps.tier.name, memlock=caps.memlock_limit, device=str(caps.device))
    ok = []
    pool = stagebuf.UvaBufferPool(16, torch.int32, max_concurrency=2)
    a = np.arange(1 << 20, dtype=np.int32)  # 4 MiB: 64 times the memlock limit
    t = pool.copy_to_uva(a)
    ok.append(np.array_equal(t.cpu().numpy(), a))
    stager = stagebuf.StepStager(capacity=1 << 12)
    with stager.step() as s:
        d1 = s.stage(a[:300_000])
        d2 = s.stage([1.5, 2.5])
    ok.append(np.array_equal(d1.cpu().numpy(), a[:300_000]) and d2.cpu().tolist() == [1.5, 2.5])
    g = stagebuf.async_copy_to_gpu(a[:1000])
    ok.append(np.array_equal(g.cpu().numpy(), a[:1000]))
    out["ok"] = ok
    out["pool_tier"] = pool.tier.name
    if not torch.cuda.is_available():  # the accelerator path's memlock reason, with the real limit
        import os
        os.environ.pop("STAGEBUF_TIER", None)
        stagebuf.reset_capabilities()
        import importlib
        # only "is there a device" is faked: the memlock limit and the pinned allocation are real
        importlib.import_module("stagebuf._tiers.probe").device_missing = lambda dev: None
        out["accel_reasons"] = stagebuf.capabilities("cuda:0").reasons
    else:
        out["reasons"] = caps.reasons
    print(json.dumps(out))
    """
)


def _lower_memlock() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    lim = MEMLOCK if hard == resource.RLIM_INFINITY else min(MEMLOCK, hard)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (lim, lim))


def _run_memlock_child(tier: str | None) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("STAGEBUF_TIER", None)
    if tier:
        env["STAGEBUF_TIER"] = tier
    proc = subprocess.run(
        [sys.executable, "-c", _MEMLOCK_CHILD],
        capture_output=True,
        text=True,
        env=env,
        preexec_fn=_lower_memlock,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(HAS_CUDA, reason="the CPU variant; test_tiny_memlock_gpu runs on CUDA machines")
@pytest.mark.parametrize("tier", ["host", "pageable"])
def test_tiny_memlock_cpu(tier):
    out = _run_memlock_child(tier)
    assert out["rlimit"] == MEMLOCK and out["memlock"] == MEMLOCK  # reported, not unlimited
    assert out["tier"] == tier.upper() and out["ok"] == [True, True, True]
    # probing an accelerator under this limit names the limit and the fix, and still picks a tier
    assert any(f"memlock limit is {MEMLOCK} bytes" in r and "ulimit -l" in r for r in out["accel_reasons"])


@pytest.mark.gpu
@pytest.mark.parametrize("tier", [None, "pinned", "pageable"])
def test_tiny_memlock_gpu(tier):
    out = _run_memlock_child(tier)
    assert out["rlimit"] == MEMLOCK and out["memlock"] == MEMLOCK
    assert out["device"].startswith("cuda") and out["tier"] in ("UVA", "PINNED", "PAGEABLE")
    assert out["ok"] == [True, True, True], out
    assert any(f"memlock limit is {MEMLOCK} bytes" in r for r in out["reasons"])


# --------------------------------------------------------------------------- GPU-only faults


@pytest.mark.gpu
def test_async_copy_pinning_failing_at_run_time(monkeypatch, warnings_seen):
    if not capabilities().pin_memory:
        pytest.skip("needs pinned memory")

    def refuse(self: torch.Tensor, *a: Any, **kw: Any) -> torch.Tensor:
        raise RuntimeError("CUDA error: out of memory (injected)")

    monkeypatch.setattr(torch.Tensor, "pin_memory", refuse)
    for i in range(3):
        a = np.arange(1000, dtype=np.int64) * (i + 1)
        np.testing.assert_array_equal(read_back(stagebuf.async_copy_to_gpu(a)), a)
    w = warnings_seen()
    assert len(w) == 1 and "pageable" in w[0]


@pytest.fixture
def device_memory_cap() -> Iterator[int]:
    """Cap this process's device memory at what it holds now plus 64 MiB; yields the headroom."""
    if not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    headroom = 64 << 20
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved(0) + headroom) / total, 0)
    try:
        yield headroom
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["pinned", "pageable"])
def test_real_device_oom_at_pool_growth(monkeypatch, device_memory_cap, tier):
    force_tier(monkeypatch, tier)
    pool = UvaBufferPool(4, torch.int32, max_concurrency=2)
    big = np.zeros(64 << 20, np.int32)  # 256 MiB of device memory asked for, 64 MiB allowed
    match = "out of device memory:? allocating 268435456 bytes"
    _pool_growth_refused(pool, big, match, [5, 6], contextlib.nullcontext())


@pytest.mark.gpu
def test_real_device_oom_at_stager_growth(monkeypatch, device_memory_cap):
    force_tier(monkeypatch, "pinned")
    stager = StepStager(capacity=1 << 12, max_concurrency=2)
    too_big = [np.zeros(64 << 20, np.int32)]
    _stager_growth_refused(stager, np.arange(100, dtype=np.int64), too_big, contextlib.nullcontext(), 11)
