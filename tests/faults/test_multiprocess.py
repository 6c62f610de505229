"""Many processes: two torchrun processes each running the decode loop with their own stagers.

``scripts/mp_decode.py`` is the worker. On a machine with two GPUs each process
gets its own (cuda:0, cuda:1); with one GPU both share it; ``--shared-gpu``
forces sharing. The CPU smoke run (HOST and PAGEABLE tiers, gloo) keeps the
worker itself tested in CI. Also here: UVA views and every staging object on a
non-zero device, where two GPUs exist.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import stagebuf
from helpers import force_tier, read_back
from stagebuf import (
    FusedStagedWriter,
    StagedWriteTensor,
    StepStager,
    Tier,
    UvaBackedTensor,
    UvaBuffer,
    UvaBufferPool,
    capabilities,
)
from stagebuf._device import uva as uva_mod
from stagebuf._rings.param_table import DeviceParamTable

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "mp_decode.py"
NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _torchrun(tmp_path: Path, *args: str, timeout: int = 540) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "STAGEBUF_TIER"}
    env["PYTHONPATH"] = str(ROOT / "src")
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this host
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(SCRIPT),
        "--out",
        str(tmp_path),
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    summary_file = tmp_path / "mp_decode_summary.json"
    assert summary_file.exists(), (
        f"no summary; rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    summary = json.loads(summary_file.read_text())
    assert proc.returncode == 0 and summary["ok"], proc.stdout[-6000:] + proc.stderr[-3000:]
    assert summary["world_size"] == 2 and [r["rank"] for r in summary["ranks"]] == [0, 1]
    assert len({r["pid"] for r in summary["ranks"]}) == 2  # two processes
    return summary


def _checked_tiers(rank: dict[str, Any]) -> dict[str, dict[str, Any]]:
    tiers = {t["tier"]: t for t in rank["tiers"]}
    for t in tiers.values():
        if t["status"] == "ok":
            assert t["n_bad_steps"] == 0 and t["slot_mismatches"] == 0 and t["tables_ok"] and t["devices_ok"]
    return tiers


def test_torchrun_two_processes_cpu(tmp_path):
    summary = _torchrun(tmp_path, "--device", "cpu", "--steps", "60")
    for r in summary["ranks"]:
        assert r["device"] == "cpu"
        tiers = _checked_tiers(r)
        assert {n: t["status"] for n, t in tiers.items()} == {"host": "ok", "pageable": "ok"}
        assert tiers["pageable"]["transfers"]["stager"] == 60  # one transfer per step per process


@pytest.mark.gpu
def test_torchrun_two_processes_gpu(tmp_path):
    """One GPU per process where two exist, else both on one GPU."""
    summary = _torchrun(tmp_path, "--steps", "300")
    devices = [r["device"] for r in summary["ranks"]]
    assert devices == (["cuda:0", "cuda:1"] if NGPU >= 2 else ["cuda:0", "cuda:0"])
    for r in summary["ranks"]:
        tiers = _checked_tiers(r)
        assert tiers["pinned"]["status"] == "ok" and tiers["pageable"]["status"] == "ok"
        assert tiers["uva"]["status"] in ("ok", "unavailable")


@pytest.mark.gpu
def test_torchrun_two_processes_sharing_one_gpu(tmp_path):
    summary = _torchrun(tmp_path, "--steps", "300", "--shared-gpu")
    assert [r["device"] for r in summary["ranks"]] == ["cuda:0", "cuda:0"]
    for r in summary["ranks"]:
        assert "sharing one GPU" in r["mode"]
        _checked_tiers(r)


@pytest.mark.gpu
@pytest.mark.skipif(NGPU < 2, reason="needs two GPUs")
@pytest.mark.parametrize("tier", ["uva", "pinned", "pageable"])
def test_every_object_on_a_non_zero_device(monkeypatch, tier):
    force_tier(monkeypatch, tier)
    dev1 = torch.device("cuda", 1)
    torch.cuda.set_device(0)
    try:
        caps = capabilities(dev1)
    except stagebuf.TierUnavailableError as e:
        pytest.skip(str(e))
    assert caps.device == dev1 and caps.tier is Tier.parse(tier)
    rng = np.random.default_rng(0)
    pool = UvaBufferPool(4, torch.int32, device=dev1)
    a = rng.integers(-100, 100, 37).astype(np.int32)
    t = pool.copy_to_uva(a)  # grows too
    assert t.device == dev1
    np.testing.assert_array_equal(read_back(t), a)
    stager = StepStager(device=dev1, capacity=64)
    with stager.step() as s:
        b = rng.standard_normal(100)
        tb = s.stage(b)
    assert tb.device == dev1
    np.testing.assert_array_equal(read_back(tb), b)
    bt = UvaBackedTensor(6, torch.int64, device=dev1)
    bt.np[:] = np.arange(6) * 7
    assert bt.copy_to_uva().device == dev1
    np.testing.assert_array_equal(read_back(bt.gpu), np.arange(6) * 7)
    swt = StagedWriteTensor((4, 8), torch.int32, dev1, uva_instead_of_gpu=True)
    swt.stage_write(2, 1, [5, 6, 7])
    FusedStagedWriter(dev1, 4).apply([swt])
    assert swt.gpu.device == dev1 and swt.in_host_memory == (caps.tier is Tier.UVA)
    want = np.zeros((4, 8), np.int32)
    want[2, 1:4] = [5, 6, 7]
    np.testing.assert_array_equal(read_back(swt.gpu), want)
    table = DeviceParamTable(3, {"temperature": torch.float32}, dev1)
    table["temperature"].np[:] = [0.25, 0.5, 1.0]
    table.sync()
    assert table["temperature"].gpu.device == dev1
    np.testing.assert_array_equal(read_back(table["temperature"].gpu), [0.25, 0.5, 1.0])
    assert torch.cuda.current_device() == 0  # nothing switched the caller's device


@pytest.mark.gpu
@pytest.mark.skipif(NGPU < 2, reason="needs two GPUs")
def test_uva_view_device_index_on_a_non_zero_device():
    dev1 = torch.device("cuda", 1)
    if capabilities(dev1).tier is not Tier.UVA:
        pytest.skip(f"no UVA on {dev1}: {capabilities(dev1).reasons}")
    torch.cuda.set_device(0)
    buf = UvaBuffer(16, torch.int32, dev1)
    assert buf.dev.device == dev1 and buf.uva(5).device == dev1
    assert buf.dev.data_ptr() != 0
    for seed in (1, 2):
        vals = np.arange(16, dtype=np.int32) * seed
        buf.np[:] = vals  # written on the host after the view exists, read by a kernel on cuda:1
        np.testing.assert_array_equal(read_back(buf.dev), vals)
    with torch.cuda.device(1):
        summed = int(buf.dev.sum())
    assert summed == int((np.arange(16) * 2).sum())
    # the same host buffer's view made for cuda:0 is a different device tensor of the same memory
    stagebuf.reset_capabilities()
    if capabilities("cuda:0").tier is Tier.UVA:
        v0 = uva_mod.device_view(buf.cpu, torch.device("cuda", 0))
        assert v0.device == torch.device("cuda", 0)
        np.testing.assert_array_equal(read_back(v0), np.arange(16) * 2)
    assert torch.cuda.current_device() == 0
