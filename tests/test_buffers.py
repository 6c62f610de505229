"""One buffer interface on every tier this machine runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stagebuf import (
    HostBuffer,
    NonUvaBuffer,
    PinnedBuffer,
    Tier,
    TierUnavailableError,
    UvaBuffer,
    capabilities,
    make_buffer,
)


@pytest.mark.parametrize("size", [7, (5, 3)])
def test_make_buffer_follows_the_tier(any_tier, size):
    buf = make_buffer(size, torch.int32)
    assert buf.tier is any_tier
    assert buf.device == capabilities().device
    shape = (size,) if isinstance(size, int) else size
    assert tuple(buf.cpu.shape) == shape and buf.cpu.device.type == "cpu"
    assert not buf.np.any() and not buf.uva().cpu().numpy().any()  # zero-filled, both sides
    assert np.shares_memory(buf.np, buf.cpu.numpy())


def test_uva_publishes_first_n_rows(any_tier):
    buf = make_buffer((6, 2), torch.float32)
    rng = np.random.default_rng(1)
    for n in [0, 1, 4, 6, None]:
        data = rng.standard_normal((6, 2)).astype(np.float32)
        buf.np[:] = data
        out = buf.uva(n)
        k = 6 if n is None else n
        assert out.shape == (k, 2) and out.device == buf.device
        np.testing.assert_array_equal(out.cpu().numpy(), data[:k])


def test_copy_tiers_hold_a_separate_device_copy(cpu_tier):
    buf = make_buffer(4, torch.int64)
    buf.np[:] = [1, 2, 3, 4]
    dev = buf.uva()
    buf.np[:] = 9
    if cpu_tier is Tier.PAGEABLE:
        assert dev.tolist() == [1, 2, 3, 4]  # the copy was taken at uva()
        assert buf.uva(2).tolist() == [9, 9]
    else:
        assert dev.tolist() == [9, 9, 9, 9]  # HOST: the CPU tensor is the device tensor


def test_copy_to_moves_rows_into_another_tensor(any_tier):
    buf = make_buffer((3, 2), torch.int32)
    buf.np[:] = [[1, 2], [3, 4], [5, 6]]
    out = torch.full((3, 2), -1, dtype=torch.int32, device=buf.device)
    buf.copy_to(out, 2)
    assert out.cpu().tolist() == [[1, 2], [3, 4], [-1, -1]]


def test_non_uva_buffer_accepts_cpu_on_any_machine():
    buf = NonUvaBuffer(3, torch.float32, device="cpu")
    assert buf.tier is Tier.PAGEABLE and buf.dev.data_ptr() != buf.cpu.data_ptr()
    buf.np[:] = [1.5, 2.5, 3.5]
    assert buf.uva().tolist() == [1.5, 2.5, 3.5]


@pytest.mark.skipif(torch.cuda.is_available(), reason="these tiers work on a GPU machine")
@pytest.mark.parametrize("cls", [UvaBuffer, PinnedBuffer])
def test_accelerator_buffers_refuse_clearly_without_one(cls):
    with pytest.raises(TierUnavailableError, match="needs an accelerator"):
        cls(4, torch.int32)


def test_host_buffer_rejects_a_device():
    with pytest.raises(ValueError, match="device='cuda'"):
        HostBuffer(4, torch.int32, device="cuda")


@pytest.mark.parametrize("n", [-1, 5, 1.5, True])
def test_bad_row_count(any_tier, n):
    buf = make_buffer(4, torch.int32)
    with pytest.raises(ValueError, match=r"n=.* must be an int in \[0, 4\]"):
        buf.uva(n)


@pytest.mark.parametrize("size", [-1, (), (2, -3), 2.5, (True,)])
def test_bad_size(size):
    with pytest.raises(ValueError, match="size="):
        make_buffer(size, torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.complex64, "object", None])
def test_bad_dtype(dtype):
    with pytest.raises(TypeError, match="allowed: bool, uint8"):
        make_buffer(4, dtype)


def test_make_buffer_falls_back_on_cpu_instead_of_raising(cpu_tier):
    buf = make_buffer(4, torch.int32, tier="uva")
    assert buf.tier is cpu_tier
