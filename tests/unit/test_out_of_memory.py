"""Host memory running out: a HostAllocationError (a StagebufError and a MemoryError) naming the bytes and the
tier, with nothing staged before it lost.

The sizes are past what any machine's address space holds (2**47 bytes and more), so the allocation fails at
once, whatever the kernel's overcommit policy, and nothing is touched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import stagebuf
from helpers import read_back
from stagebuf import HostAllocationError, StagebufError

HUGE = 10**15
"""Elements: 8 * 10**15 bytes of int64, past every address space."""

MAKERS: dict[str, Callable[[], Any]] = {
    "UvaBufferPool": lambda: stagebuf.UvaBufferPool(HUGE, torch.int64),
    "StepStager": lambda: stagebuf.StepStager(capacity=2**62),
    "DeviceParamTable": lambda: stagebuf.DeviceParamTable(HUGE, {"a": torch.int64}),
    "UvaBackedTensor": lambda: stagebuf.UvaBackedTensor(HUGE, torch.int64),
    "make_buffer": lambda: stagebuf.make_buffer(HUGE, torch.int64),
}


def _check(e: BaseException, tier: stagebuf.Tier) -> None:
    assert isinstance(e, HostAllocationError) and isinstance(e, StagebufError) and isinstance(e, MemoryError)
    assert isinstance(e, RuntimeError)  # what torch raised before: an except RuntimeError still catches it
    assert "bytes" in str(e) and f"tier {tier.name}" in str(e), str(e)


@pytest.mark.parametrize("what", list(MAKERS))
def test_constructing_past_host_memory_raises_host_allocation_error(
    cpu_tier: stagebuf.Tier, what: str
) -> None:
    with pytest.raises(MemoryError) as ei:
        MAKERS[what]()
    _check(ei.value, cpu_tier)


def test_staging_past_host_memory_keeps_what_was_staged(cpu_tier: stagebuf.Tier) -> None:
    stager = stagebuf.StepStager()
    pool = stagebuf.UvaBufferPool(4, torch.int64)
    kept = pool.copy_to_uva([7, 8, 9])
    with stager.step() as step:
        a = step.stage(np.arange(3, dtype=np.int64))
        with pytest.raises(MemoryError) as ei:
            step.stage(np.broadcast_to(np.int64(1), (HUGE,)))  # a view: no memory of its own
        _check(ei.value, cpu_tier)
        with pytest.raises(MemoryError) as ei:
            pool.copy_to_uva(np.broadcast_to(np.int64(1), (HUGE,)))
        _check(ei.value, cpu_tier)
    assert read_back(a).tolist() == [0, 1, 2]
    assert read_back(kept).tolist() == [7, 8, 9]
    with stager.step() as step:  # the stager still works
        b = step.stage([4, 5])
    assert read_back(b).tolist() == [4, 5]
