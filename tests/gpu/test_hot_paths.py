"""On a real GPU: no per-step hot path waits for the device, on UVA, PINNED and PAGEABLE.

One ``Rig`` holds every public per-step object; ``Rig.round`` calls each hot path
once and enqueues a device consumer (a clone) of what it returned. After warm-up
rounds (a first call may synchronize: the Triton pointer table, a device
``output_ptrs`` read once), the rounds run under ``torch.cuda.set_sync_debug_mode
("error")``, where torch raises on a synchronizing call, and behind a ~200 ms
kernel, where a call that waited for the device would take the kernel's time.
Every clone is then checked against the numpy values staged.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import stagebuf
from helpers import UNDER_SANITIZER, force_tier
from stagebuf import (
    DeviceParamTable,
    FusedStagedWriter,
    StagedWriteTensor,
    StepStager,
    TierUnavailableError,
    UvaBackedTensor,
    UvaBufferPool,
)
from stagebuf._rings.staged_write.kernel import triton_usable
from stagebuf._tiers.settings import ENV_KERNEL

pytestmark = pytest.mark.gpu

SLOTS = 4
"""max_concurrency of every object: a round uses each ring at most SLOTS - 1 times."""
WARMUP_ROUNDS = 2 * SLOTS
DEBUG_ROUNDS = 2 * SLOTS + 1  # more than SLOTS: every slot comes round again under the debug mode
SLEEP_S = 0.2
MAX_EDIT = 16  # edits of at most 16 values: one Triton block size, so nothing compiles after warm-up


@pytest.fixture(params=["uva", "pinned", "pageable"])
def tier(request, monkeypatch) -> stagebuf.Tier:
    want = force_tier(monkeypatch, request.param)
    monkeypatch.delenv("STAGEBUF_CHECK", raising=False)  # check mode reads output_ptrs every call
    try:
        got = stagebuf.capabilities().tier
    except TierUnavailableError as e:
        pytest.skip(f"tier {request.param} is not available here: {e}")
    assert got is want
    return want


class Expect:
    """Device copies of what the hot paths returned, and the numpy values each must hold."""

    def __init__(self) -> None:
        self.got: list[tuple[str, torch.Tensor, np.ndarray]] = []

    def read(self, name: str, t: torch.Tensor, want: np.ndarray) -> None:
        self.got.append((name, t.clone(), np.array(want, copy=True)))  # the consumer, enqueued now

    def verify(self) -> None:
        torch.cuda.synchronize()
        for name, got, want in self.got:
            np.testing.assert_array_equal(got.cpu().numpy(), want, err_msg=name)
        self.got.clear()  # frees the clones: the next rounds reuse their cached blocks


class WriteCase:
    """A StagedWriteTensor and its numpy model, edited by all three staging calls per apply."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, uva: bool = False):
        self.name = name
        self.t = StagedWriteTensor(shape, dtype, max_concurrency=SLOTS, uva_instead_of_gpu=uva)
        self.model = np.zeros((self.t.rows, self.t.cols), torch.empty(0, dtype=dtype).numpy().dtype)

    def stage(self, rng: np.random.Generator) -> None:
        """Edits on four distinct rows (no overlap, so the Triton kernel may run)."""
        t, m = self.t, self.model
        rows = [int(r) for r in rng.permutation(t.rows)[:4]]
        n = int(rng.integers(1, min(t.cols, MAX_EDIT) + 1))
        start = int(rng.integers(0, t.cols - n + 1))
        vals = rng.integers(-1000, 1000, n).tolist()
        t.stage_write(rows[0], start, vals)
        m[rows[0], start : start + n] = vals
        v = int(rng.integers(-1000, 1000))
        t.stage_write_elem(rows[1], v)
        m[rows[1], 0] = v
        w = min(t.cols, 4)
        r2 = np.array(rows[2:], np.int64)
        s2 = rng.integers(0, t.cols - w + 1, 2)
        v2 = rng.integers(-1000, 1000, (2, w)).astype(m.dtype)
        t.stage_writes(r2, s2, v2)
        for k in range(2):
            m[r2[k], s2[k] : s2[k] + w] = v2[k]

    def read(self, ex: Expect) -> None:
        ex.read(self.name, self.t.gpu, self.model.reshape(self.t.shape))


class Writers:
    """The staged-write objects made under one STAGEBUF_WRITE_KERNEL setting."""

    def __init__(self, kernel: str, device: torch.device):
        self.kernel = kernel
        self.singles = [
            WriteCase(f"{kernel} 2-D", (16, 32), torch.int32),
            WriteCase(f"{kernel} 1-D", (64,), torch.int64),
            WriteCase(f"{kernel} 2-D uva", (16, 32), torch.int32, uva=True),
            WriteCase(f"{kernel} 1-D uva", (64,), torch.int64, uva=True),
        ]
        self.fused = FusedStagedWriter(max_writes=64, max_concurrency=SLOTS)
        self.parts = [WriteCase(f"{kernel} fused a", (8, 16), torch.int32)]
        self.parts.append(WriteCase(f"{kernel} fused b", (8, 24), torch.int32))
        ts = [p.t for p in self.parts]
        # vLLM's BlockTables: device tensors of the targets' addresses and row strides, made once
        self.ptrs = torch.tensor([t.gpu.data_ptr() for t in ts], dtype=torch.uint64, device=device)
        self.strides = torch.tensor([t.gpu.stride(0) for t in ts], dtype=torch.int64, device=device)

    def round(self, rng: np.random.Generator, ex: Expect) -> None:
        for case in self.singles:
            case.stage(rng)
            case.t.apply_write()
            case.read(ex)
        ts = [p.t for p in self.parts]
        for args in ((), (self.ptrs, self.strides)):  # both targets staged: one pointer table
            for p in self.parts:
                p.stage(rng)
            self.fused.apply(ts, *args)
            for p in self.parts:
                p.read(ex)

    def check_kernels(self) -> None:
        if self.kernel == "triton":
            assert [c.t.kernel for c in self.singles] == ["triton"] * 4
            assert self.fused.kernel == "triton"


class Rig:
    """Every public per-step object of stagebuf on the forced tier, and one round of its hot paths."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tier: stagebuf.Tier):
        self.stager = StepStager(capacity=1 << 12, max_concurrency=SLOTS)
        self.static = StepStager(capacity=1 << 12, max_concurrency=SLOTS, static=True)
        self.pool = UvaBufferPool((64, 2), torch.int32, max_concurrency=SLOTS)
        dev = self.pool.device
        self.pool_out = torch.empty((48, 2), dtype=torch.int32, device=dev)
        self.backed = UvaBackedTensor((32, 4), torch.int64, max_concurrency=SLOTS)
        self.async_out = torch.empty(100, dtype=torch.int64, device=dev)
        self.table = DeviceParamTable(
            16, {"top_k": torch.int32, "temperature": torch.float32}, max_concurrency=SLOTS
        )
        self.writers = []
        for kernel in ("auto", "triton"):  # the kernel is read when a writer is made
            if kernel == "triton" and not triton_usable(dev):
                continue
            monkeypatch.setenv(ENV_KERNEL, kernel)
            self.writers.append(Writers(kernel, dev))
        for obj in (self.stager, self.static, self.pool, self.backed, self.table):
            assert obj.tier is tier, obj
        self.rounds = 0

    def round(self, rng: np.random.Generator, ex: Expect) -> None:
        self.rounds += 1
        stagebuf.begin_step()
        for name, stager in (("stager", self.stager), ("static stager", self.static)):
            a = rng.integers(-(2**31), 2**31, 37).astype(np.int32)
            b = rng.integers(-(2**40), 2**40, (5, 3))
            with stager.step() as step:
                ta, tb = step.stage(a), step.stage(b)
            ex.read(f"{name} a", ta, a)
            ex.read(f"{name} b", tb, b)

        x, y, z = (rng.integers(-1000, 1000, (48, 2)).astype(np.int32) for _ in range(3))
        ex.read("pool.copy_to_uva", self.pool.copy_to_uva(x), x)
        ex.read("pool.copy_to_gpu", self.pool.copy_to_gpu(y), y)
        ex.read("pool.copy_to_gpu(out)", self.pool.copy_to_gpu(z, out=self.pool_out), z)

        self.backed.np[...] = rng.integers(-1000, 1000, (32, 4))
        ex.read("backed.copy_to_uva()", self.backed.copy_to_uva(), self.backed.np)
        self.backed.np[:10] = rng.integers(-1000, 1000, (10, 4))
        ex.read("backed.copy_to_uva(10)", self.backed.copy_to_uva(10), self.backed.np[:10])

        c, d = rng.integers(-1000, 1000, 100), rng.integers(-1000, 1000, 100)
        ex.read("async_copy_to_gpu", stagebuf.async_copy_to_gpu(c), c)
        ex.read("async_copy_to_gpu(out)", stagebuf.async_copy_to_gpu(d, out=self.async_out), d)

        for w in self.writers:
            w.round(rng, ex)

        top_k = rng.integers(1, 100, 16).astype(np.int32)
        temp = (self.rounds + rng.random(16)).astype(np.float32)  # a new value every round
        self.table["top_k"].np[:] = top_k
        self.table["temperature"].np = temp  # the checked field write
        assert self.table.sync()
        ex.read("table top_k", self.table["top_k"].gpu, top_k)
        ex.read("table temperature", self.table["temperature"].gpu, temp)

    def check_kernels(self) -> None:
        for w in self.writers:
            w.check_kernels()


def _warm_rig(monkeypatch, tier) -> tuple[Rig, np.random.Generator, Expect]:
    rig = Rig(monkeypatch, tier)
    rng = np.random.default_rng(0)
    ex = Expect()
    for _ in range(WARMUP_ROUNDS):  # outside the checks: a first call may synchronize
        rig.round(rng, ex)
    ex.verify()
    return rig, rng, ex


def test_no_sync_under_sync_debug_mode(tier, monkeypatch):
    rig, rng, ex = _warm_rig(monkeypatch, tier)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(DEBUG_ROUNDS):
            rig.round(rng, ex)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ex.verify()
    rig.check_kernels()


def _sleep_cycles(seconds: float) -> int:
    """``torch.cuda._sleep`` cycles that keep the device busy for about ``seconds`` (timed here)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    probe = 20_000_000
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe * seconds * 1000 / start.elapsed_time(end))


def test_long_kernel_in_flight_delays_nothing(tier, monkeypatch):
    rig, rng, ex = _warm_rig(monkeypatch, tier)
    cycles = _sleep_cycles(SLEEP_S)
    start, busy = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    stagebuf.begin_step()  # the warm-up's last step ends here: its slots are released at the synchronize
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(cycles)
    busy.record()
    t0 = time.perf_counter()
    rig.round(rng, ex)  # each ring at most SLOTS - 1 times: no slot still in use comes round
    host_s = time.perf_counter() - t0
    still_busy = not busy.query()
    ex.verify()
    kernel_s = start.elapsed_time(busy) / 1000
    rig.check_kernels()
    assert still_busy, (
        f"the {kernel_s * 1e3:.0f} ms kernel ended before the round did ({host_s * 1e3:.1f} ms)"
    )
    if not UNDER_SANITIZER:  # (the sanitizer's instrumentation is most of a round's host time there)
        assert host_s < 0.25 * kernel_s, (
            f"one round took {host_s * 1e3:.1f} ms behind a {kernel_s * 1e3:.0f} ms kernel"
        )
