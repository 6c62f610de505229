"""The engine workload on a GPU: vLLM's MRV2 input path on stagebuf, on every CUDA tier and every release of
``benchmarks.vllm_mrv2.RELEASES`` (the ``vllm_release`` fixture).

Needs each release's files (``benchmarks.vllm_mrv2.fetch``; on a machine without network, carry them:
``scripts/gpu.sh`` says how). Each test skips, saying why, where they or a tier are missing.
"""

from __future__ import annotations

import pytest
import torch
from benchmarks import engine as E

import stagebuf

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
CFG = {"steps": 40}


@pytest.fixture(scope="module", autouse=True)
def ready() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("triton", reason="vLLM's MRV2 kernels are Triton kernels")


def _tier_ok(tier: str) -> None:
    with E.stagebuf_tier(None):
        best = stagebuf.capabilities(CUDA).tier
    if stagebuf.Tier.parse(tier) < best:
        pytest.skip(f"tier {tier} is not available here (best: {best.name})")


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("api", ["dropin", "own"])
@pytest.mark.parametrize("tier", ["uva", "pinned", "pageable"])
def test_identical_inputs(vllm_release: str, tier: str, api: str, groups: int, busy: bool) -> None:
    _tier_ok(tier)
    cfg = E.TraceConfig(block_sizes=E.BLOCK_SIZES[:groups], **CFG)
    cycles = E.sleep_cycles_for(2.0, CUDA) if busy else 0
    r = E.check(E.Setup("stagebuf", tier, api), cfg, CUDA, busy_cycles=cycles, release=vllm_release)
    assert r["mismatches"] == []


@pytest.mark.parametrize("api", ["dropin", "own"])
@pytest.mark.parametrize("tier", ["uva", "pinned", "pageable"])
def test_no_sync_in_the_engine(vllm_release: str, tier: str, api: str) -> None:
    """After warm-up, no stagebuf call of the engine's step synchronises (2 KV groups: the fused apply)."""
    _tier_ok(tier)
    cfg = E.TraceConfig(block_sizes=E.BLOCK_SIZES[:2], steps=50)
    err = E.sync_check(
        E.Setup("stagebuf", tier, api),
        cfg,
        CUDA,
        warmup=20,
        busy_cycles=E.sleep_cycles_for(2.0, CUDA),
        release=vllm_release,
    )
    assert err is None


@pytest.mark.parametrize("tier", ["uva", "pinned", "pageable"])
def test_identical_inputs_through_the_vllm_plugin(vllm_release: str, tier: str) -> None:
    _tier_ok(tier)
    cfg = E.TraceConfig(block_sizes=E.BLOCK_SIZES[:2], **CFG)
    try:
        cycles = E.sleep_cycles_for(2.0, CUDA)
        r = E.check(E.Setup("plugin", tier), cfg, CUDA, busy_cycles=cycles, release=vllm_release)
    finally:
        E.close_plugin_modules()
    assert r["mismatches"] == []


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("tier", ["uva", "pinned", "pageable"])
def test_identical_inputs_in_step_mode(vllm_release: str, tier: str, groups: int, busy: bool) -> None:
    """STAGEBUF_VLLM=step through vLLM's plugin loader: vLLM's own layer's inputs, every step."""
    _tier_ok(tier)
    cfg = E.TraceConfig(block_sizes=E.BLOCK_SIZES[:groups], **CFG)
    cycles = E.sleep_cycles_for(2.0, CUDA) if busy else 0
    try:
        r = E.check(E.Setup("step", tier), cfg, CUDA, busy_cycles=cycles, release=vllm_release)
    finally:
        E.close_plugin_modules()
    assert r["mismatches"] == []


@pytest.mark.parametrize("tier", ["uva", "pinned", "pageable"])
def test_no_sync_in_step_mode(vllm_release: str, tier: str) -> None:
    """After warm-up, no call of a step-mode step synchronises (sync debug mode "error")."""
    _tier_ok(tier)
    cfg = E.TraceConfig(block_sizes=E.BLOCK_SIZES[:2], steps=50)
    try:
        err = E.sync_check(
            E.Setup("step", tier),
            cfg,
            CUDA,
            warmup=20,
            busy_cycles=E.sleep_cycles_for(2.0, CUDA),
            release=vllm_release,
        )
    finally:
        E.close_plugin_modules()
    assert err is None


@pytest.mark.parametrize("tier", ["uva", "pinned", "pageable"])
def test_step_mode_runs_ahead_of_a_busy_gpu(vllm_release: str, tier: str) -> None:
    """Behind a kernel that runs for seconds, every step-mode preparation returns while it still runs:
    nothing in a step waits for the device (a wait would find the long kernel done)."""
    _tier_ok(tier)
    cfg = E.TraceConfig(block_sizes=E.BLOCK_SIZES[:2], steps=40)
    plans = E.make_trace(cfg)
    try:
        with E.stagebuf_tier(tier):
            eng = E.Engine(E.Setup("step", tier), cfg, CUDA, vllm_release)
        for plan in plans[:20]:  # warm-up: slots made, kernels compiled
            eng.prepare(plan)
            eng.finish(plan, 0)
        torch.cuda.synchronize()
        stagebuf.begin_step(CUDA)  # as an engine begins each step: the last one ends before the long kernel
        long = torch.cuda.Event()
        torch.cuda._sleep(E.sleep_cycles_for(3000.0, CUDA))
        long.record()
        for plan in plans[20:22]:  # no more steps than slots: the guard has a free slot each time
            eng.prepare(plan)  # (not the harness's finish: its pageable copy of num_sampled waits)
        still_running = not long.query()
        torch.cuda.synchronize()
    finally:
        E.close_plugin_modules()
    assert still_running
