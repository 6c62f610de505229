"""On a real GPU: the device sees exactly the host data, on UVA, PINNED and PAGEABLE."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import stagebuf
from stagebuf import Tier, UvaBufferPool, capabilities, make_buffer
from stagebuf._device import uva as uva_mod
from stagebuf._tiers import probe as caps_mod

pytestmark = pytest.mark.gpu


def _consume(t: torch.Tensor) -> torch.Tensor:
    """A consumer kernel reading the staged data on the device."""
    return t.to(torch.int64) * 3 + 1


def test_h200_probe_picks_uva_and_the_coherence_probe_passes():
    caps = caps_mod.probe("cuda")
    assert caps.tier is Tier.UVA and caps.uva and caps.pin_memory
    assert any(r.startswith("UVA:") and "later host write" in r for r in caps.reasons)


def test_coherence_probe_fails_when_the_view_is_a_copy(monkeypatch):
    monkeypatch.setattr(uva_mod, "device_view", lambda host, dev: host.to(dev))  # a stale copy
    caps = caps_mod.probe("cuda")
    assert caps.tier is Tier.PINNED and not caps.uva
    assert any("coherence probe failed" in r for r in caps.reasons)


def test_uva_view_is_a_live_alias():
    buf = stagebuf.UvaBuffer(1024, torch.int32, "cuda")
    view = buf.uva()
    assert view.is_cuda and view.data_ptr() == buf.dev.data_ptr()
    for k in range(3):
        buf.np[:] = np.arange(1024) * (k + 2)
        torch.cuda.synchronize()
        np.testing.assert_array_equal(_consume(view).cpu().numpy(), np.arange(1024) * (k + 2) * 3 + 1)


@pytest.mark.parametrize("trailing", [(), (4,)])
def test_device_sees_host_data_over_random_steps(gpu_tier, trailing):
    pool = UvaBufferPool((64, *trailing), torch.int32, max_concurrency=3)
    assert pool.tier is gpu_tier
    rng = np.random.default_rng(7)
    for _ in range(500):
        a = rng.integers(-(2**30), 2**30, (int(rng.integers(0, 200)), *trailing)).astype(np.int32)
        got = _consume(pool.copy_to_uva(a)).cpu().numpy()  # .cpu() synchronises
        np.testing.assert_array_equal(got, a.astype(np.int64) * 3 + 1)
    g = pool.copy_to_gpu(np.ones((5, *trailing), np.int32))
    assert g.is_cuda and g.sum().item() == g.numel()


def test_uva_slot_address_is_fixed_across_steps(monkeypatch):
    monkeypatch.setenv("STAGEBUF_TIER", "uva")
    stagebuf.reset_capabilities()
    pool = UvaBufferPool(256, torch.int64, max_concurrency=2)
    ptrs = [pool.copy_to_uva(np.arange(100) + i).data_ptr() for i in range(10)]
    assert len(set(ptrs[0::2])) == 1 and len(set(ptrs[1::2])) == 1 and ptrs[0] != ptrs[1]
    assert pool.stats()["transfers"] == 0


def test_buffers_on_each_gpu_tier(gpu_tier):
    buf = make_buffer((16, 2), torch.float32)
    assert buf.tier is gpu_tier and buf.device.type == "cuda"
    buf.np[:] = np.arange(32, dtype=np.float32).reshape(16, 2)
    np.testing.assert_array_equal(buf.uva(9).cpu().numpy(), buf.np[:9])


def test_async_copy_on_each_gpu_tier(gpu_tier):
    a = np.arange(1000, dtype=np.int64)
    out = stagebuf.async_copy_to_gpu(a)
    a[:] = 0
    assert out.is_cuda and out.sum().item() == sum(range(1000))
    assert stagebuf.is_pin_memory_available() is (gpu_tier is not Tier.PAGEABLE or capabilities().pin_memory)


def test_zero_row_uva_pool_stays_uva(monkeypatch):
    """Regression (GPU fuzzing): an empty UVA buffer fell back to PINNED (empty tensors are 'unpinned')."""
    monkeypatch.setenv("STAGEBUF_TIER", "uva")
    stagebuf.reset_capabilities()
    pool = UvaBufferPool(0, torch.int32, max_concurrency=2)
    assert pool.tier is Tier.UVA
    t = pool.copy_to_uva(np.arange(5, dtype=np.int32))  # grows from 0 rows
    assert pool.tier is Tier.UVA and t.tolist() == list(range(5))


def test_direct_launches_write_as_the_dispatcher_and_a_launch_hook_sends_them_back_to_it():
    """kernel.launch_at: the first launch compiles through Triton's dispatcher, later ones call the
    compiled kernel directly; both write what the numpy model says, and a launch hook set later
    sees the launches (they go through the dispatcher again)."""
    import triton

    from stagebuf._rings.staged_write import kernel

    dev = torch.device("cuda", torch.cuda.current_device())
    assert kernel._triton_available()
    out = torch.zeros(64, dtype=torch.int32, device=dev)
    model = np.zeros(64, np.int32)
    meta = torch.tensor(
        [[out.data_ptr(), 0, 8, 0], [out.data_ptr(), 32, 8, 8]], dtype=torch.int64, device=dev
    )
    for k in range(3):
        vals = torch.arange(16, dtype=torch.int32, device=dev) + 100 * k
        kernel.launch_at(
            dev, meta.data_ptr(), vals.data_ptr(), torch.int32, 2, 1024, lambda v=vals: (meta, v)
        )
        model[0:8], model[32:40] = np.arange(8) + 100 * k, np.arange(8, 16) + 100 * k
        np.testing.assert_array_equal(out.cpu().numpy(), model)
    assert any(key[0] == dev.index and key[2] is torch.int32 for key in kernel._compiled)
    seen: list[object] = []
    rt = triton.knobs.runtime
    old = rt.launch_enter_hook
    hook = lambda *a, **k: seen.append(a)  # noqa: E731
    if hasattr(old, "add"):
        old.add(hook)
    else:
        rt.launch_enter_hook = hook
    try:
        vals = torch.arange(16, dtype=torch.int32, device=dev) - 7
        kernel.launch_at(dev, meta.data_ptr(), vals.data_ptr(), torch.int32, 2, 1024, lambda: (meta, vals))
    finally:
        if hasattr(old, "remove"):
            old.remove(hook)
        else:
            rt.launch_enter_hook = old
    model[0:8], model[32:40] = np.arange(8) - 7, np.arange(8, 16) - 7
    np.testing.assert_array_equal(out.cpu().numpy(), model)
    assert seen, "a launch hook did not see the launch: launch_at bypassed it"
