"""stagebuf.nanovllm on the GPU (UVA, PINNED, PAGEABLE), against nano-vllm-fork 20260210's own path.

Needs nano-vllm's wheel (``benchmarks.nanovllm_pkg.fetch``; on a machine without network, carry
``.cache/nanovllm-20260210``). The graphs are real CUDA graphs of a stand-in model, captured by
nano-vllm's own ``capture_cudagraph``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from benchmarks import nanovllm_engine as NE
from benchmarks import nanovllm_pkg as P
from benchmarks.e2e import refuse_pinning
from benchmarks.engine import sleep_cycles_for, stagebuf_tier

import stagebuf.nanovllm as sn
from helpers import nano_or_skip

pytestmark = pytest.mark.gpu

TIERS = ["stagebuf_uva", "stagebuf_pinned", "stagebuf_pageable"]
SMALL = NE.TraceConfig(max_num_seqs=64, running=64, max_num_batched_tokens=4096, steps=80)
TRACES = {
    "busy": NE.TraceConfig(steps=150),
    "cfg": dataclasses.replace(SMALL, cfg=True, running=32),
    "preempt": dataclasses.replace(SMALL, num_kvcache_blocks=20, arrivals_per_step=4, seed=1, steps=300),
}


@pytest.fixture(scope="module")
def nano() -> P.Nano:
    return nano_or_skip(cuda=True)


@pytest.mark.parametrize("setup", TIERS)
@pytest.mark.parametrize("trace", [*TRACES, "graphs"])
def test_identical_inputs(nano: P.Nano, tmp_path: Path, setup: str, trace: str) -> None:
    cfg = TRACES.get(trace, TRACES["busy"])
    r = NE.check(setup, cfg, tmp_path, graphs=trace in ("graphs", "cfg"))
    assert r["mismatches"] == [], r
    assert r["steps"] == cfg.steps and r["prefix_hits"] > 0 and r["finished"] > 0


@pytest.mark.parametrize("setup", TIERS)
def test_identical_inputs_with_steps_in_flight(nano: P.Nano, tmp_path: Path, setup: str) -> None:
    """A busy device (about 3 ms per step) and two steps in flight: every input read late is right."""
    cycles = sleep_cycles_for(3.0, torch.device("cuda"))
    r = NE.check_in_flight(setup, dataclasses.replace(TRACES["busy"], steps=100), tmp_path, cycles)
    assert r["mismatches"] == [] and r["steps"] == 100, r


@pytest.mark.parametrize("setup", TIERS)
def test_no_device_to_device_copy_into_the_graph_inputs(nano: P.Nano, tmp_path: Path, setup: str) -> None:
    own = NE.graph_writes("own", SMALL, tmp_path)
    mine = NE.graph_writes(setup, SMALL, tmp_path)
    assert own["real_graphs"] and own["decode_steps"] > 10
    assert (own["d2d_copies_per_step"], own["fills_per_step"]) == (5.0, 3.0), own
    assert mine["decode_steps"] == own["decode_steps"]
    assert (mine["d2d_copies_per_step"], mine["fills_per_step"]) == (0.0, 0.0), mine


@pytest.mark.parametrize("setup", TIERS)
@pytest.mark.parametrize("graphs", [False, True])
def test_no_sync_on_the_hot_path(nano: P.Nano, tmp_path: Path, setup: str, graphs: bool) -> None:
    """prepare_prefill/decode, prepare_sample and run_model under torch.cuda.set_sync_debug_mode("error")."""
    trace = NE.Trace(dataclasses.replace(SMALL, steps=60), tmp_path)
    r = NE.make_runner(trace, setup, graphs=graphs)
    with stagebuf_tier(setup.split("_", 1)[1]):
        for i in range(60):
            step = trace.next()
            assert step is not None
            seqs, pre = step
            if i >= 10:
                torch.cuda.set_sync_debug_mode("error")
            try:
                p = NE.prepare(r, seqs, pre)
                r.run_model(p[0], p[1], pre)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            trace.nano.context.reset_context()
            trace.post(seqs)
    torch.cuda.synchronize()


def test_own_path_fails_without_pinned_memory_and_stagebuf_pageable_gives_its_inputs(
    nano: P.Nano, tmp_path: Path
) -> None:
    mr = nano.model_runner.ModelRunner
    trace = NE.Trace(dataclasses.replace(SMALL, steps=60), tmp_path)
    ref = P.runner(trace.config)
    P.own_buffers(ref)  # pinned: nano-vllm's own path where pinning works
    sn.attach(mr)
    try:
        with stagebuf_tier("pageable"):
            with refuse_pinning():
                bare = P.runner(trace.config)
                with pytest.raises(RuntimeError, match="pinned"):
                    vars(mr)["_stagebuf_own"]["_allocate_sample_buffers"](bare)
                r = P.runner(trace.config)
                r._allocate_sample_buffers()  # logged, not raised
            for i in range(60):
                step = trace.next()
                assert step is not None
                seqs, pre = step
                a = NE.snapshot(nano, NE.prepare(ref, seqs, pre))
                with refuse_pinning():
                    b = NE.snapshot(nano, NE.prepare(r, seqs, pre))
                assert NE.differences(a, b) == [], f"step {i}"
                trace.post(seqs)
            assert sn.stats(r)["tier"] == "PAGEABLE"
    finally:
        sn.detach(mr)
