"""One buffer interface on every tier this machine runs."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from helpers import fake_accelerator
from stagebuf import (
    HostBuffer,
    NonUvaBuffer,
    PinnedAllocationError,
    PinnedBuffer,
    Tier,
    TierUnavailableError,
    UvaBuffer,
    async_copy_to_gpu,
    capabilities,
    make_buffer,
)
from stagebuf._bytes import buffers as buffers_mod
from stagebuf._device import uva as uva_mod


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
    with pytest.raises(TierUnavailableError, match="needs an accelerator.*allowed: pageable, host"):
        cls(4, torch.int32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="device=None is the GPU there")
@pytest.mark.parametrize("forced", [None, "host", "pageable"])
def test_uva_buffer_says_uva_is_not_available_on_cpu(monkeypatch, forced):
    if forced:
        monkeypatch.setenv("STAGEBUF_TIER", forced)
    with pytest.raises(RuntimeError, match=r"^UVA is not available on cpu: UvaBuffer needs an accelerator"):
        UvaBuffer(4, torch.int32)
    with pytest.raises(RuntimeError, match=r"^UVA is not available on cpu"):
        UvaBuffer(4, torch.int32, "cpu")


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


# --- one rule: an explicit request that cannot work raises; run-time failures fall back ---


@pytest.mark.parametrize("tier", ["uva", "pinned", Tier.UVA])
def test_make_buffer_explicit_tier_that_cannot_work_raises_on_cpu(cpu_tier, tier):
    with pytest.raises(TierUnavailableError) as ei:
        make_buffer(4, torch.int32, "cpu", tier=tier)
    e = ei.value
    name = Tier.parse(tier).name.lower()
    assert f"make_buffer(tier={name!r}) needs an accelerator" in str(e)
    assert "allowed: pageable, host" in str(e) and e.setting == "tier" and e.value == name


@pytest.mark.parametrize("tier", ["host", "pageable"])
def test_make_buffer_cpu_tiers_work_on_cpu(cpu_tier, tier):
    buf = make_buffer(3, torch.int64, "cpu", tier=tier)
    assert buf.tier is Tier.parse(tier)
    buf.np[:] = [4, 5, 6]
    assert buf.uva().tolist() == [4, 5, 6]


@pytest.fixture
def fake_gpu(monkeypatch):
    """A 'cuda:0' on a CPU-only machine where the probe finds UVA; allocations are CPU tensors."""
    return fake_accelerator(monkeypatch, allocations=True)


def test_fake_gpu_makes_every_explicit_tier_it_has(fake_gpu):
    for tier in (Tier.UVA, Tier.PINNED, Tier.PAGEABLE):
        assert make_buffer(4, torch.int32, "cuda:0", tier=tier).tier is tier


@pytest.mark.parametrize(
    ("forced", "cls", "asked"),
    [
        ("pinned", UvaBuffer, "uva"),
        ("pageable", UvaBuffer, "uva"),
        ("pageable", PinnedBuffer, "pinned"),
    ],
)
def test_forced_lower_tier_refuses_better_buffers(fake_gpu, forced, cls, asked):
    fake_gpu.setenv("STAGEBUF_TIER", forced)
    caps = capabilities("cuda:0")
    assert caps.uva and caps.tier is Tier.parse(forced)  # UVA works here; the env var caps the tier
    head = "UVA is not available" if asked == "uva" else "tier PINNED is not available"
    with pytest.raises(
        TierUnavailableError,
        match=rf"^{head} on cuda:0: {cls.__name__} was asked for, "
        rf"but STAGEBUF_TIER={forced} forces tier",
    ):
        cls(4, torch.int32, "cuda:0")
    with pytest.raises(TierUnavailableError, match=rf"STAGEBUF_TIER={forced} forces.*allowed: "):
        make_buffer(4, torch.int32, "cuda:0", tier=asked)
    assert make_buffer(4, torch.int32, "cuda:0").tier is caps.tier  # tier=None follows the env var


def test_uva_buffer_refuses_when_the_probe_found_no_uva(fake_gpu):
    def missing():
        raise ImportError("No module named 'cuda'")

    fake_gpu.setattr(uva_mod, "load_cudart", missing)
    assert capabilities("cuda:0").tier is Tier.PINNED
    with pytest.raises(
        TierUnavailableError,
        match=r"^UVA is not available on cuda:0: .*cuda-bindings.*"
        r"allowed: pinned, pageable",
    ):
        UvaBuffer(4, torch.int32, "cuda:0")
    with pytest.raises(TierUnavailableError, match="cuda-bindings"):
        make_buffer(4, torch.int32, "cuda:0", tier="uva")


def test_make_buffer_host_tier_on_an_accelerator_raises(fake_gpu):
    with pytest.raises(TierUnavailableError, match="tier HOST means no accelerator.*allowed: uva, pinned"):
        make_buffer(4, torch.int32, "cuda:0", tier="host")


@pytest.mark.parametrize("tier", [None, "uva"])
def test_runtime_pinned_failure_still_falls_back_once(fake_gpu, caplog, tier):
    def alloc_host(shape, dtype, pinned, tier=None):
        if pinned:
            raise PinnedAllocationError("pinned allocation failed: memlock exhausted")
        return torch.zeros(shape, dtype=dtype)

    fake_gpu.setattr(buffers_mod, "alloc_host", alloc_host)
    caplog.set_level(logging.WARNING, logger="stagebuf")
    assert capabilities("cuda:0").tier is Tier.UVA  # the probe said yes
    bufs = [make_buffer(4, torch.int32, "cuda:0", tier=tier) for _ in range(3)]
    assert [b.tier for b in bufs] == [Tier.PAGEABLE] * 3
    warnings = [
        r.getMessage() for r in caplog.records if r.name == "stagebuf" and "falling back" in r.getMessage()
    ]
    assert len(warnings) == 1 and "memlock exhausted" in warnings[0]


# --- attributes: .np/.cpu assignment copies, everything else is read-only ---


def test_assigning_np_copies_into_the_buffer(any_tier):
    buf = make_buffer((3, 2), torch.int32)
    model = np.arange(6, dtype=np.int64).reshape(3, 2) * 7
    host_np = buf.np
    buf.np = model  # int64 values that fit int32: accepted, copied
    assert buf.np is host_np  # the same view: nothing rebinds
    np.testing.assert_array_equal(buf.uva().cpu().numpy(), model)
    buf.cpu = torch.full((3, 2), -3, dtype=torch.int32)
    np.testing.assert_array_equal(buf.uva().cpu().numpy(), np.full((3, 2), -3))
    buf.np = 9  # one scalar: every element, as buf.np[...] = 9
    np.testing.assert_array_equal(buf.uva().cpu().numpy(), np.full((3, 2), 9))
    buf.np += 1  # in place, then assigned to itself
    np.testing.assert_array_equal(buf.uva().cpu().numpy(), np.full((3, 2), 10))


@pytest.mark.parametrize(
    ("value", "exc", "text"),
    [
        (
            np.zeros((2, 2), np.int32),
            ValueError,
            r"\.np: a value of shape \(2, 2\) was given; expected shape \(3, 2\)",
        ),
        (np.zeros(6, np.int32), ValueError, r"\.np has rank 1 .*allowed ranks: 0, 2"),
        ([[1.5, 0], [0, 0], [0, 0]], ValueError, r"\.np holds fractional values"),
        (np.full((3, 2), 2**40), ValueError, r"\.np holds values in .* outside int32's range"),
        (np.ones((3, 2), bool), TypeError, "bools and numbers are not converted"),
        ("abc", TypeError, r"\.np must be a list"),
    ],
)
def test_bad_np_assignment_raises_and_writes_nothing(cpu_tier, value, exc, text):
    buf = make_buffer((3, 2), torch.int32)
    buf.np[:] = [[1, 2], [3, 4], [5, 6]]
    before = buf.np.copy()
    with pytest.raises(exc, match=text):
        buf.np = value
    np.testing.assert_array_equal(buf.np, before)
    np.testing.assert_array_equal(buf.uva().cpu().numpy(), before)


@pytest.mark.parametrize("attr", ["dev", "device", "shape", "dtype", "tier", "nbytes", "whatever"])
def test_other_buffer_attributes_are_read_only(cpu_tier, attr):
    buf = make_buffer(3, torch.int32)
    before = getattr(buf, attr, None)
    with pytest.raises(AttributeError, match=rf"\.{attr} is read-only: "):
        setattr(buf, attr, torch.zeros(3, dtype=torch.int32))
    assert getattr(buf, attr, None) is before
    with pytest.raises(AttributeError, match="cannot be deleted"):
        delattr(buf, "np")


def test_copy_to_refuses_an_out_that_would_convert(cpu_tier):
    buf = make_buffer((3, 2), torch.int32)
    buf.np[:] = 5
    dev = capabilities().device
    for out in (
        torch.zeros((3, 2), dtype=torch.float32, device=dev),  # dtype
        torch.zeros((2, 2), dtype=torch.int32, device=dev),  # too few rows for n=3
        torch.zeros((3, 3), dtype=torch.int32, device=dev),
    ):  # row shape
        with pytest.raises(ValueError, match=r"out has shape .*expected at least 3 rows of shape \(2,\)"):
            buf.copy_to(out, 3)
        assert not out.any()
    with pytest.raises(TypeError, match="out must be a torch.Tensor"):
        buf.copy_to(np.zeros((3, 2), np.int32), 3)


def test_async_copy_refuses_dtype_that_differs_from_out(cpu_tier):
    out = torch.zeros(2, dtype=torch.int32, device=capabilities().device)
    with pytest.raises(ValueError, match=r"dtype=torch.float32 but out.dtype=torch.int32"):
        async_copy_to_gpu([1.5, 2.5], out=out, dtype=torch.float32)
    assert not out.any()
    assert async_copy_to_gpu([1, 2], out=out, dtype=torch.int32).tolist() == [1, 2]
    with pytest.raises(TypeError, match="out must be a torch.Tensor or None"):
        async_copy_to_gpu([1, 2], out=[0, 0])
