"""vLLM MRV2's call shapes, one default device rule, and no attribute that silently ignores writes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import stagebuf
from stagebuf import (
    DeviceParamTable,
    FusedStagedWriter,
    StagedWriteTensor,
    StepStager,
    UvaBackedTensor,
    UvaBufferPool,
)


@pytest.mark.parametrize("size", [4, (4,), (4, 3), [6, 2]])
def test_pool_size_is_what_was_passed(cpu_tier, size):
    pool = UvaBufferPool(size, torch.int32)
    assert pool.size == size
    assert pool.shape == ((size,) if isinstance(size, int) else tuple(size))


def test_staged_write_num_rows_and_max_concurrency(cpu_tier):
    t = StagedWriteTensor((7, 3), torch.int32, max_concurrency=4)
    assert (t.num_rows, t.max_concurrency) == (7, 4)
    assert StagedWriteTensor(5, torch.int64).num_rows == 5


def test_device_is_optional_everywhere_with_one_rule(cpu_tier):
    """device=None is capabilities(None).device: the current accelerator, else the CPU."""
    want = stagebuf.capabilities().device
    made = [
        UvaBufferPool(4, torch.int32),
        UvaBackedTensor(4, torch.int32),
        StepStager(capacity=64),
        StagedWriteTensor((2, 2), torch.int32),
        FusedStagedWriter(max_writes=4),
        DeviceParamTable(3, {"t": torch.float32}),
    ]
    assert [m.device for m in made] == [want] * len(made)


def _sealed_cases(tier):
    return [
        (UvaBufferPool(4, torch.int32), ["size", "dtype", "max_concurrency", "device"]),
        (StepStager(capacity=64), ["max_concurrency", "device", "static"]),
        (
            StagedWriteTensor((2, 3), torch.int32),
            ["gpu", "num_rows", "dtype", "device", "kernel", "stage_write", "max_concurrency"],
        ),
        (FusedStagedWriter(max_writes=4), ["device", "max_writes", "kernel", "max_concurrency"]),
        (UvaBackedTensor(4, torch.int32), ["gpu", "dtype", "pool"]),
    ]


def test_no_public_attribute_accepts_a_write_it_would_ignore(cpu_tier):
    for obj, names in _sealed_cases(cpu_tier):
        for name in names:
            with pytest.raises(AttributeError, match=f"{type(obj).__name__}.{name} is read-only"):
                setattr(obj, name, getattr(obj, name))
        with pytest.raises(AttributeError, match="is read-only"):
            obj.a_typo = 1  # a misspelt attribute is refused too, not added silently


def test_backed_tensor_np_assignment_copies_and_is_published(cpu_tier):
    t = UvaBackedTensor(4, torch.int32)
    t.np = np.array([1, 2, 3, 4], np.int32)  # copies into the host tensor (not a new binding)
    assert t.cpu.tolist() == [1, 2, 3, 4]
    assert t.copy_to_uva().cpu().tolist() == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="fractional"):
        t.np = np.array([0.5, 1, 2, 3])
    assert t.cpu.tolist() == [1, 2, 3, 4]


def test_fused_apply_accepts_vllm_pointers_and_strides(cpu_tier):
    a, b = StagedWriteTensor((3, 4), torch.int32), StagedWriteTensor((2, 5), torch.int32)
    w = FusedStagedWriter(max_writes=4)
    a.stage_write(1, 0, [7, 8])
    b.stage_write(0, 2, [9])
    ptrs = [a.gpu.data_ptr(), b.gpu.data_ptr()]
    with pytest.raises(ValueError, match="output_strides"):
        w.apply([a, b], ptrs, [4, 4])  # b's rows are 5 long
    assert a.num_staged == 1 and b.num_staged == 1  # refused before anything was written
    w.apply([a, b], torch.tensor(ptrs), torch.tensor([4, 5]))
    assert a.gpu.cpu()[1].tolist() == [7, 8, 0, 0] and b.gpu.cpu()[0].tolist() == [0, 0, 9, 0, 0]


def test_uva_buffer_raises_runtime_error_off_the_uva_tier(cpu_tier):
    with pytest.raises(RuntimeError, match="^UVA is not available"):
        stagebuf.UvaBuffer(4, torch.int32)
