"""Messages that say what happened and what to do, where an earlier wording misled."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import stagebuf
from stagebuf import StagedWriteTensor


def test_a_forced_triton_kernel_on_the_cpu_names_the_interpreter(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("STAGEBUF_TIER", "pageable")
    monkeypatch.setenv("STAGEBUF_WRITE_KERNEL", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    w = StagedWriteTensor((4, 4), torch.int32, device="cpu")
    w.stage_write(0, 0, [1])
    with caplog.at_level(logging.WARNING, logger="stagebuf"):
        w.apply_write()
    assert w.kernel == "scatter"
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "TRITON_INTERPRET=1" in text and "unset STAGEBUF_WRITE_KERNEL" in text


@pytest.mark.parametrize(
    "make",
    [
        lambda: stagebuf.UvaBufferPool(4, torch.int32, max_concurrency=1),
        lambda: stagebuf.StepStager(max_concurrency=1),
        lambda: stagebuf.FusedStagedWriter(max_concurrency=1),
    ],
    ids=["pool", "stager", "writer"],
)
def test_max_concurrency_1_is_raised_to_2_and_says_so(
    make: Any, cpu_tier: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="stagebuf"):
        obj = make()
        make()
    assert obj.max_concurrency == 2
    lines = [r.getMessage() for r in caplog.records if "max_concurrency=1" in r.getMessage()]
    assert len(lines) == 1 and "raised to 2" in lines[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="stagebuf"):
        assert stagebuf.UvaBufferPool(4, torch.int32, max_concurrency=3).max_concurrency == 3
    assert not [r for r in caplog.records if "max_concurrency" in r.getMessage()]


def test_a_staged_write_tensor_too_large_for_a_cpu_tier_says_host_memory(cpu_tier: Any) -> None:
    """On HOST (and a CPU stand-in) the target tensor is host memory: the error says so, not "device"."""
    with pytest.raises(stagebuf.HostAllocationError, match="out of host memory") as ei:
        StagedWriteTensor((2**40, 8), dtype=torch.int32)
    assert "device memory" not in str(ei.value)
