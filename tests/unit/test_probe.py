"""The probe's decisions, with the OS and driver answers faked where this machine lacks them."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch

import stagebuf
from helpers import fake_accelerator, no_accelerator, reset_warnings
from stagebuf import Tier, TierUnavailableError, capabilities
from stagebuf._device import uva as uva_mod
from stagebuf._tiers import capabilities as capabilities_mod
from stagebuf._tiers import probe as caps_mod


def test_import_does_not_initialise_cuda():
    code = "import stagebuf, torch, sys; print(torch.cuda.is_initialized(), 'cuda.bindings' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_cpu_machine_defaults_to_host():
    caps = capabilities("cpu")
    assert caps.tier is Tier.HOST and caps.device == torch.device("cpu")
    assert not caps.pin_memory and not caps.uva
    assert json.loads(json.dumps(caps.as_dict()))["tier"] == "HOST"


@pytest.mark.skipif(torch.cuda.is_available(), reason="default device is the GPU there")
def test_helpers_on_cpu_only_machine():
    assert stagebuf.capabilities().tier is Tier.HOST
    assert stagebuf.is_pin_memory_available() is False
    assert stagebuf.is_uva_available() is False
    assert stagebuf.PIN_MEMORY is False


def test_capabilities_are_cached_and_reset(monkeypatch):
    a = capabilities("cpu")
    assert capabilities("cpu") is a
    stagebuf.reset_capabilities()
    assert capabilities("cpu") is not a


def test_forced_pageable_targets_cpu(monkeypatch):
    monkeypatch.setenv("STAGEBUF_TIER", "pageable")
    caps = capabilities("cpu")
    assert caps.tier is Tier.PAGEABLE and caps.device.type == "cpu" and caps.forced == "pageable"
    assert any("stands in for device memory" in r for r in caps.reasons)


@pytest.mark.parametrize("tier", ["uva", "pinned"])
def test_forced_accelerator_tier_on_cpu_raises(monkeypatch, tier):
    monkeypatch.setenv("STAGEBUF_TIER", tier)
    with pytest.raises(TierUnavailableError, match="needs an accelerator"):
        capabilities("cpu")


def test_unknown_forced_tier_names_allowed_values(monkeypatch):
    monkeypatch.setenv("STAGEBUF_TIER", "fast")
    with pytest.raises(ValueError, match="STAGEBUF_TIER='fast'.*uva, pinned, pageable, host"):
        capabilities("cpu")


# --- a fake accelerator: every OS/driver answer below is faked ---


@pytest.fixture
def fake_gpu(monkeypatch):
    """Probe 'cuda:0' on a CPU-only machine with the OS/driver answers faked.

    By default everything works (pinned memory, cuda-bindings, a live device view);
    each test breaks one answer.
    """
    return fake_accelerator(monkeypatch)


def _probe():
    return capabilities("cuda:0")


def test_fake_all_working_gives_uva(fake_gpu):
    caps = _probe()
    assert caps.tier is Tier.UVA and caps.pin_memory and caps.uva
    assert any(r.startswith("UVA:") for r in caps.reasons)


def test_wsl_disables_pinned_memory(fake_gpu):
    fake_gpu.setattr(caps_mod, "_is_wsl", lambda: True)
    caps = _probe()
    assert caps.tier is Tier.PAGEABLE and caps.wsl and not caps.pin_memory
    assert any("WSL" in r and "STAGEBUF_WSL_PIN_MEMORY=1" in r for r in caps.reasons)


def test_wsl_opt_in_allows_pinned_memory(fake_gpu):
    fake_gpu.setattr(caps_mod, "_is_wsl", lambda: True)
    fake_gpu.setenv("STAGEBUF_WSL_PIN_MEMORY", "1")
    assert _probe().tier is Tier.UVA


def test_tiny_memlock_is_reported(fake_gpu):
    fake_gpu.setattr(caps_mod, "_memlock_limit", lambda: 65536)
    caps = _probe()
    assert caps.memlock_limit == 65536
    assert any("memlock limit is 65536" in r and "ulimit -l" in r for r in caps.reasons)


def test_pinned_allocation_failing_gives_pageable(fake_gpu):
    def refuse(n):
        raise RuntimeError("CUDA error: OS call failed or operation not supported on this OS")

    fake_gpu.setattr(caps_mod, "_alloc_pinned", refuse)
    caps = _probe()
    assert caps.tier is Tier.PAGEABLE and not caps.pin_memory and not caps.uva
    assert any("pinned host memory failed" in r and "OS call failed" in r for r in caps.reasons)


def test_silently_unpinned_allocation_gives_pageable(fake_gpu):
    fake_gpu.setattr(torch.Tensor, "is_pinned", lambda self, *a: False)
    caps = _probe()
    assert caps.tier is Tier.PAGEABLE
    assert any("came back unpinned" in r for r in caps.reasons)


def test_cuda_bindings_missing_gives_pinned(fake_gpu):
    def missing():
        raise ImportError("No module named 'cuda'")

    fake_gpu.setattr(uva_mod, "load_cudart", missing)
    caps = _probe()
    assert caps.tier is Tier.PINNED and caps.pin_memory and not caps.uva
    assert any("cuda-bindings is not installed" in r and "stagebuf[cuda]" in r for r in caps.reasons)


def test_device_view_failing_gives_pinned(fake_gpu):
    def broken(host, dev):
        raise uva_mod.UvaError("cudaHostGetDevicePointer failed with CUDA error 1")

    fake_gpu.setattr(uva_mod, "device_view", broken)
    caps = _probe()
    assert caps.tier is Tier.PINNED
    assert any("cudaHostGetDevicePointer failed" in r for r in caps.reasons)


def test_stale_view_fails_coherence_probe(fake_gpu):
    fake_gpu.setattr(uva_mod, "device_view", lambda host, dev: host.clone())  # a copy, not an alias
    caps = _probe()
    assert caps.tier is Tier.PINNED and not caps.uva
    assert any("coherence probe failed" in r for r in caps.reasons)


def test_fallback_warns_once_per_process(fake_gpu, caplog):
    fake_gpu.setattr(caps_mod, "_is_wsl", lambda: True)
    caplog.set_level(logging.WARNING, logger="stagebuf")
    _probe()
    stagebuf.reset_capabilities()
    _probe()
    warnings = [r for r in caplog.records if r.name == "stagebuf" and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "PAGEABLE" in warnings[0].getMessage() and "WSL" in warnings[0].getMessage()
    reset_warnings()


def test_forced_tier_better_than_available_raises_with_reason(fake_gpu):
    fake_gpu.setattr(uva_mod, "load_cudart", lambda: (_ for _ in ()).throw(ImportError("x")))
    fake_gpu.setenv("STAGEBUF_TIER", "uva")
    with pytest.raises(TierUnavailableError, match="cuda-bindings"):
        _probe()


def test_forced_worse_tier_is_honoured(fake_gpu):
    fake_gpu.setenv("STAGEBUF_TIER", "pageable")
    caps = _probe()
    assert caps.tier is Tier.PAGEABLE and caps.uva  # capability kept, choice forced
    assert any("forces tier PAGEABLE" in r for r in caps.reasons)


@pytest.mark.parametrize("tier", ["uva", "pinned", "pageable"])
def test_a_forced_tier_is_recorded_uva_included(fake_gpu, tier):
    # Tier.UVA is 0: a truth test of the forced tier once recorded STAGEBUF_TIER=uva as not forced
    fake_gpu.setenv("STAGEBUF_TIER", tier)
    caps = _probe()
    assert caps.forced == tier and caps.tier.name.lower() == tier


def test_forced_host_on_accelerator_raises(fake_gpu):
    fake_gpu.setenv("STAGEBUF_TIER", "host")
    with pytest.raises(TierUnavailableError, match="host targets the CPU.*allowed: uva, pinned, pageable"):
        _probe()


def test_non_cuda_accelerator_without_uva_gets_pinned(fake_gpu):
    caps = capabilities("xpu:0")
    assert caps.tier is Tier.PINNED
    assert any("need CUDA" in r for r in caps.reasons)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_asking_for_cuda_without_it_is_a_clear_error(device):
    with pytest.raises(
        TierUnavailableError, match=r"device='cuda.*' cannot be used: torch is a .*device=None"
    ):
        capabilities(device)
    with pytest.raises(TierUnavailableError, match="cannot be used: torch is a"):
        stagebuf.StepStager(device=device)


# --- naming the cause: a CPU build of torch, or a CUDA build that sees no GPU ---

CAUSES = [
    (None, "torch is a CPU build", "install a CUDA build of torch"),
    ("13.0", "torch is a CUDA build but sees no driver or GPU", "nvidia-smi"),
]


@pytest.mark.parametrize(("cuda", "cause", "fix"), CAUSES)
def test_device_missing_names_the_build(monkeypatch, cuda, cause, fix):
    no_accelerator(monkeypatch, cuda)
    assert capabilities_mod.torch_build() == ("CPU build" if cuda is None else "CUDA 13.0 build")
    with pytest.raises(TierUnavailableError) as ei:
        capabilities("cuda")
    e = ei.value
    assert cause in str(e) and fix in str(e) and "allowed: cpu" in str(e)
    assert e.setting == "device" and e.value == "cuda" and e.allowed == ("cpu",) and cause in e.cause
    if cuda is not None:
        assert "CUDA 13.0" in e.cause  # the build's version, for the report


@pytest.mark.parametrize(("cuda", "cause", "fix"), CAUSES)
def test_cpu_target_reason_names_the_build(monkeypatch, cuda, cause, fix):
    no_accelerator(monkeypatch, cuda)
    caps = capabilities()
    assert caps.device == torch.device("cpu") and caps.tier is Tier.HOST
    assert cause in caps.cpu_cause and fix in caps.cpu_fix
    assert cause in caps.reasons[0] and fix in caps.reasons[0]
    d = caps.as_dict()
    assert d["torch_build"] == ("CPU build" if cuda is None else "CUDA 13.0 build")
    assert cause in d["cpu_cause"]


def test_explicit_cpu_is_named_as_the_reason():
    caps = capabilities("cpu")
    assert caps.cpu_cause == "device='cpu' was asked for" and caps.cpu_fix is None
    assert "device='cpu' was asked for" in caps.reasons[0]


@pytest.mark.parametrize(("cuda", "cause", "fix"), CAUSES)
@pytest.mark.parametrize("tier", ["uva", "pinned"])
def test_forced_accelerator_tier_without_one_names_cause_and_fix(monkeypatch, cuda, cause, fix, tier):
    no_accelerator(monkeypatch, cuda)
    monkeypatch.setenv("STAGEBUF_TIER", tier)
    with pytest.raises(TierUnavailableError) as ei:
        capabilities()
    msg = str(ei.value)
    assert msg.startswith(f"STAGEBUF_TIER={tier} needs an accelerator")
    assert cause in msg and fix in msg and "allowed: host, pageable" in msg
    assert ei.value.setting == "STAGEBUF_TIER" and ei.value.allowed == ("host", "pageable")


def test_unknown_forced_tier_carries_the_facts(monkeypatch):
    monkeypatch.setenv("STAGEBUF_TIER", "garbage")
    with pytest.raises(ValueError) as ei:
        capabilities("cpu")
    e = ei.value
    assert isinstance(e, stagebuf.SetupError) and e.setting == "STAGEBUF_TIER" and e.value == "garbage"
    assert e.allowed == ("uva", "pinned", "pageable", "host") and "unset STAGEBUF_TIER" in str(e)


@pytest.mark.parametrize("device", ["banana", "gpu9", "cuda:x", ""])  # "" is not the default device
def test_unknown_device_is_a_value_error_naming_it(device):
    with pytest.raises(ValueError) as ei:
        capabilities(device)
    e = ei.value
    assert isinstance(e, RuntimeError)  # what torch.device raises: callers catching that still do
    assert str(e).startswith(f"device={device!r} is not a device torch can use")
    assert "allowed: cpu" in str(e) and "device=None" in str(e)


@pytest.mark.parametrize("device", [1.5, True, ["cpu"]])
def test_device_of_the_wrong_type(device):
    with pytest.raises(TypeError, match=r"device=.* must be None, a str, an int or a torch.device"):
        capabilities(device)


def test_meta_device_is_refused():
    with pytest.raises(TierUnavailableError, match="device='meta' cannot be used: a meta tensor holds"):
        capabilities("meta")


def test_usable_tiers_on_the_cpu(cpu_tier):
    assert caps_mod.usable_tiers(capabilities("cpu")) == [Tier.PAGEABLE, Tier.HOST]


def test_usable_tiers_follow_the_forced_tier(fake_gpu):
    assert caps_mod.usable_tiers(_probe()) == [Tier.UVA, Tier.PINNED, Tier.PAGEABLE]
    fake_gpu.setenv("STAGEBUF_TIER", "pinned")
    stagebuf.reset_capabilities()
    assert caps_mod.usable_tiers(_probe()) == [Tier.PINNED, Tier.PAGEABLE]


def test_forced_better_tier_error_lists_what_works(fake_gpu):
    fake_gpu.setattr(caps_mod, "_is_wsl", lambda: True)  # no pinned memory: PAGEABLE only
    fake_gpu.setenv("STAGEBUF_TIER", "pinned")
    with pytest.raises(TierUnavailableError) as ei:
        _probe()
    assert ei.value.allowed == ("pageable",) and "WSL" in str(ei.value)
    assert "allowed: pageable" in str(ei.value)
