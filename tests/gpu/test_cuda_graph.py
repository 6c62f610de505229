"""Staged inputs feeding a captured CUDA graph: ``StepStager(static=True)`` on every CUDA tier.

The graph is captured once against the stager's tensors and replayed for
hundreds of steps with new inputs each step; every step's output is checked
against numpy. A stager without ``static`` rotates addresses between steps,
which the last test shows a replay would not follow.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stagebuf import StepStager

pytestmark = pytest.mark.gpu
STEPS = 300
B = 64


def _consumer(idx: torch.Tensor, pos: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    # a gather through staged indices and an arithmetic mix, like a slot mapping
    return table[idx.long()] * 1000 + pos


def _inputs(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    return rng.integers(0, 256, B).astype(np.int32), rng.integers(0, 1 << 20, B).astype(np.int64)


def test_graph_replays_staged_inputs_for_hundreds_of_steps(gpu_tier):
    stager = StepStager(capacity=1 << 12, static=True)
    dev = stager.device
    table_np = np.arange(256, dtype=np.int64) * 7 + 3
    table = torch.from_numpy(table_np).to(dev)
    rng = np.random.default_rng(1)
    with stager.step() as s:  # the first step gives the graph its input tensors
        a, b = _inputs(rng)
        d_idx, d_pos = s.stage(a), s.stage(b)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch recommends
        _consumer(d_idx, d_pos, table)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = _consumer(d_idx, d_pos, table)
    results = torch.empty((STEPS, B), dtype=torch.int64, device=dev)
    want = np.empty((STEPS, B), np.int64)
    for i in range(STEPS):
        a, b = _inputs(rng)
        want[i] = table_np[a] * 1000 + b
        with stager.step() as s:
            t_idx, t_pos = s.stage(a), s.stage(b)
        assert t_idx.data_ptr() == d_idx.data_ptr() and t_pos.data_ptr() == d_pos.data_ptr()
        graph.replay()
        results[i].copy_(out)
    np.testing.assert_array_equal(results.cpu().numpy(), want)


def test_static_stager_refuses_to_grow(gpu_tier):
    stager = StepStager(capacity=64, static=True)
    with stager.step() as s, pytest.raises(RuntimeError, match="static arena"):
        s.stage(np.zeros(64, np.int64))


def test_rotating_slots_move_addresses(gpu_tier):
    """Why static mode exists: a plain stager's consecutive steps live at different addresses."""
    stager = StepStager(capacity=1 << 12)
    ptrs = []
    for _ in range(2):
        with stager.step() as s:
            ptrs.append(s.stage(np.zeros(4, np.int32)).data_ptr())
    assert ptrs[0] != ptrs[1]
