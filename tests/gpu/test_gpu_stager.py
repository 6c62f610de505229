"""On a real GPU: a slow consumer, a host that runs ahead, and the slot-reuse guard."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from benchmarks.runahead import run_ahead

from helpers import UNDER_SANITIZER
from stagebuf import SlotInFlightError, StepStager, Tier

pytestmark = pytest.mark.gpu

N = 256
# Under compute-sanitizer (UNDER_SANITIZER) the host cannot run ahead: fewer steps, and no check that
# the guard had to wait.
RUN_AHEAD_STEPS = 200 if UNDER_SANITIZER else 1500


@pytest.mark.parametrize("tier", ["uva", "pinned", "pageable"])
def test_guard_wait_gives_no_torn_reads(monkeypatch, tier):
    monkeypatch.setenv("STAGEBUF_TIER", tier)
    import stagebuf

    stagebuf.reset_capabilities()
    stager = StepStager(device="cuda", capacity=4096, max_concurrency=2, guard="wait")
    assert stager.tier is Tier.parse(tier)
    # ~0.5 ms of device time per step: well above the host's, so the host runs ahead on every tier
    assert run_ahead(stager, steps=RUN_AHEAD_STEPS, sleep_cycles=1_000_000) == 0
    if tier != "pageable" and not UNDER_SANITIZER:
        assert stager.stats()["guard_waits"] > 0  # the host really ran ahead and was held back


def test_guard_raise_on_gpu(monkeypatch):
    monkeypatch.setenv("STAGEBUF_TIER", "uva")
    import stagebuf

    stagebuf.reset_capabilities()
    stager = StepStager(device="cuda", capacity=4096, max_concurrency=2, guard="raise")
    with pytest.raises(SlotInFlightError):
        for _ in range(10):
            with stager.step() as step:
                step.stage(np.arange(N, dtype=np.int32))
            torch.cuda._sleep(50_000_000)
    torch.cuda.synchronize()


@pytest.mark.parametrize("tier", ["uva", "pinned", "pageable"])
def test_one_transfer_per_step_on_gpu(monkeypatch, tier):
    monkeypatch.setenv("STAGEBUF_TIER", tier)
    import stagebuf

    stagebuf.reset_capabilities()
    stager = StepStager(device="cuda", capacity=1 << 16)
    for _ in range(20):
        with stager.step() as step:
            ts = [step.stage(np.full(64, k, np.int32)) for k in range(8)]
        assert [int(t.sum()) for t in ts] == [64 * k for k in range(8)]
    assert stager.stats()["transfers"] == (0 if tier == "uva" else 20)


def test_growth_during_graph_capture_raises(monkeypatch):
    monkeypatch.setenv("STAGEBUF_TIER", "pinned")
    import stagebuf

    stagebuf.reset_capabilities()
    stager = StepStager(device="cuda", capacity=64, guard="off")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with (
        torch.cuda.stream(s),
        pytest.raises(RuntimeError, match="CUDA graph is being captured"),
        torch.cuda.graph(g, stream=s),
        stager.step() as step,
    ):
        step.stage(np.zeros(1000, np.int32))
