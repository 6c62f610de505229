"""The one place that decides the tier: ``capabilities(device)`` probes each device once (pinned memory, a
live device view), records one sentence per decision, and everything else asks it."""

from __future__ import annotations

import platform
import resource
import threading
from collections.abc import Callable

import torch

from .._common.errors import ArgumentTypeError, TierUnavailableError, UnknownDeviceError, UvaError
from .._common.log import logger, warn_once
from .._common.tier import Tier
from .._common.types import DeviceLike
from .._device import uva as _uva
from .._device.memory import alloc_host
from .capabilities import (
    Capabilities,
    cuda_missing_cause,
    device_missing,
    forced_tier,
    stack_versions,
    torch_build,
    usable_devices,
)
from .settings import ENV_TIER, ENV_WSL_PIN, check_mode, env_flag, kernel_on_host, quarantine, write_kernel

_SMALL_MEMLOCK = 64 << 20


def _is_wsl() -> bool:
    release = platform.uname().release.lower()
    if "microsoft" in release or "wsl" in release:
        return True
    try:
        with open("/proc/version") as f:
            return "microsoft" in f.read().lower()
    except OSError:
        return False


def _memlock_limit() -> int | None:
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _alloc_pinned(nbytes: int) -> torch.Tensor:
    """Allocate page-locked host memory (the same call the buffers make)."""
    return alloc_host((nbytes,), torch.uint8, pinned=True)


def _uva_probe(device: torch.device) -> None:
    """Check that a device view of pinned memory is a live alias (ImportError without cuda-bindings)."""
    _uva.load_cudart()
    host = _alloc_pinned(256).view(torch.int32)
    view = _uva.device_view(host, device)
    for seed in (0x5A5A, 0x1234):
        # Write on the host *after* the view exists, read on the device.
        expect = torch.arange(seed, seed + host.numel(), dtype=torch.int32, device="cpu")
        host.copy_(expect)
        if device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize(device)
        got = view.clone().cpu()
        if not torch.equal(got, expect):
            raise UvaError(
                "coherence probe failed: the device view did not see a host write made after "
                "it was created (stale copy; seen under GPU confidential computing)"
            )


_DEVICE_FIX = "pass device=None (the current accelerator, else the CPU) or one of the allowed devices"


def _resolve_device(device: DeviceLike, forced: Tier | None) -> torch.device:
    if device is None:
        if forced is Tier.HOST:
            return torch.device("cpu")
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        acc = getattr(torch, "accelerator", None)
        cur = acc.current_accelerator() if acc is not None and acc.is_available() else None
        return torch.device(cur) if cur is not None else torch.device("cpu")
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise ArgumentTypeError(
            f"device={device!r} must be None, a str, an int or a torch.device; "
            f"allowed here: {', '.join(usable_devices())}"
        )
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError) as e:
        raise UnknownDeviceError(
            f"device={device!r} is not a device torch can use",
            setting="device",
            value=device,
            cause=_short(e),
            allowed=usable_devices(),
            fix=_DEVICE_FIX,
        ) from None
    if dev.type != "cpu":
        why = device_missing(dev)
        if why:
            hint = cuda_missing_cause()[1] if dev.type == "cuda" and not torch.cuda.is_available() else None
            raise TierUnavailableError(
                f"device={device!r} cannot be used",
                setting="device",
                value=device,
                cause=why,
                allowed=usable_devices(),
                fix=_DEVICE_FIX + (f"; or {hint}" if hint else ""),
                hint=hint,
            )
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _cpu_cause(device: DeviceLike, forced: Tier | None) -> tuple[str, str | None]:
    """(why the target is the CPU, what to do to target an accelerator)."""
    if forced is Tier.HOST and device is None:
        return f"{ENV_TIER}=host targets the CPU", f"unset {ENV_TIER} to use an accelerator"
    if device is not None:
        return f"device={device!r} was asked for", None
    if not torch.cuda.is_available():
        return cuda_missing_cause()
    return "no accelerator is available", None


def probe(device: DeviceLike = None) -> Capabilities:
    """Probe ``device`` now, uncached; every ``STAGEBUF_*`` setting but ``STAGEBUF_VLLM`` is checked here."""
    check_mode()
    env_flag(ENV_WSL_PIN, f"set {ENV_WSL_PIN}=1 to try pinned memory on WSL2, or unset it")
    quarantine()
    write_kernel()
    forced = forced_tier()
    dev = _resolve_device(device, forced)
    name = forced.name.lower() if forced is not None else None  # (not a truth test: Tier.UVA is 0)
    caps = Capabilities(dev, dev.type, False, False, Tier.HOST, [], name, _is_wsl(), _memlock_limit())
    caps.torch_build = torch_build()
    reasons = caps.reasons
    if dev.type == "cpu":
        cause, hint = _cpu_cause(device, forced)
        caps.cpu_cause, caps.cpu_fix = cause, hint
        reasons.append(
            f"The target device is the CPU because {cause}, so there is nothing to "
            "transfer to: pinned memory and UVA are not used." + (f" Fix: {hint}." if hint else "")
        )
        if forced in (Tier.UVA, Tier.PINNED):
            raise TierUnavailableError(
                f"{ENV_TIER}={name} needs an accelerator, but the target device is the CPU",
                setting=ENV_TIER,
                value=name,
                cause=cause,
                allowed=("host", "pageable"),
                fix=f"unset {ENV_TIER} (stagebuf then picks the best tier) or set {ENV_TIER}=host "
                "or pageable" + (f"; or {hint}" if hint else ""),
                hint=hint,
            )
        if forced is Tier.PAGEABLE:
            caps.tier = Tier.PAGEABLE
            reasons.append(
                f"{ENV_TIER}=pageable: copying into a separate CPU tensor that stands "
                "in for device memory (this exercises the copy path without a GPU)."
            )
        else:
            caps.tier = Tier.HOST
            reasons.append("Tier HOST: the CPU tensor is the device tensor.")
            if write_kernel() == "triton":  # explained, as a setting that cannot apply here
                reasons.append(kernel_on_host(str(dev)))
                warn_once(("kernel-on-host", str(dev)), reasons[-1])
    else:
        caps.pin_memory = _decide_pinned(caps)
        caps.uva = caps.pin_memory and _decide_uva(caps)
        best = Tier.UVA if caps.uva else Tier.PINNED if caps.pin_memory else Tier.PAGEABLE
        works = [t.name.lower() for t in _usable(dev.type, best)]
        if forced is Tier.HOST:
            raise TierUnavailableError(
                f"{ENV_TIER}=host targets the CPU, but device {dev} was asked for",
                setting=ENV_TIER,
                value="host",
                cause="tier HOST means no accelerator",
                allowed=works,
                fix=f"unset {ENV_TIER}, set it to one of the allowed tiers, or pass device='cpu'",
            )
        if forced is not None and forced < best:
            raise TierUnavailableError(
                f"{ENV_TIER}={name} cannot work on {dev}",
                setting=ENV_TIER,
                value=name,
                cause=" ".join(r for r in reasons if r.startswith("No ")) or " ".join(reasons),
                allowed=works,
                fix=f"unset {ENV_TIER} (stagebuf then picks the best tier, {best.name}) or set it to "
                "one of the allowed tiers",
            )
        caps.tier = forced if forced is not None else best
        if forced is not None:
            reasons.append(f"{ENV_TIER}={name} forces tier {forced.name} (best available: {best.name}).")
        else:
            reasons.append(f"Tier {best.name}: the best tier that works on {dev}.")
        if best is not Tier.UVA:
            why = " ".join(r for r in reasons if r.startswith("No "))
            warn_once(("fallback", str(dev), best), f"tier {best.name} on {dev} instead of UVA: {why}")
    caps.versions = stack_versions(dev)
    caps._freeze()  # shared by every caller from here on: read-only
    return caps


def usable_tiers(caps: Capabilities) -> list[Tier]:
    """The tiers an explicit request may ask for on ``caps.device``, best first: PAGEABLE and HOST on the
    CPU, else the chosen tier and every worse copy tier (a forced tier caps the process)."""
    return _usable(caps.device_type, caps.tier)


def _usable(device_type: str, best: Tier) -> list[Tier]:
    if device_type == "cpu":
        return [Tier.PAGEABLE, Tier.HOST]
    return [t for t in (Tier.UVA, Tier.PINNED, Tier.PAGEABLE) if t >= best]


def unavailable_error(want: Tier, caps: Capabilities, who: str) -> TierUnavailableError:
    """The error for an explicit request of tier ``want`` that cannot work on ``caps.device``."""
    allowed = [t.name.lower() for t in usable_tiers(caps)]
    head = "UVA is not available" if want is Tier.UVA else f"tier {want.name} is not available"
    hint = None
    if caps.device_type == "cpu" and want is not Tier.PAGEABLE:
        cause = f"{who} needs an accelerator, but the target device is the CPU because {caps.cpu_cause}"
        fix = f"pass an accelerator device, or use stagebuf.make_buffer() (tier {caps.tier.name} here)"
        hint = caps.cpu_fix
        if hint:
            fix += f"; or {hint}"
    elif caps.forced is not None and want < caps.tier:
        cause = (
            f"{who} was asked for, but {ENV_TIER}={caps.forced} forces tier {caps.tier.name} "
            "and nothing better is used in this process"
        )
        fix = f"unset {ENV_TIER} or set it to {want.name.lower()}, or ask for an allowed tier"
    elif want is Tier.HOST:
        cause = (
            f"{who} was asked for, but tier HOST means no accelerator and the target device is {caps.device}"
        )
        fix = "pass device='cpu', or ask for an allowed tier"
    else:
        found = " ".join(r for r in caps.reasons if r.startswith("No ")) or " ".join(caps.reasons)
        cause = f"{who} was asked for, but the probe found: {found}"
        fix = f"use stagebuf.make_buffer() (tier {caps.tier.name} here) or ask for an allowed tier"
    return TierUnavailableError(
        f"{head} on {caps.device}",
        setting="tier",
        value=want.name.lower(),
        cause=cause,
        allowed=allowed,
        fix=fix,
        hint=hint,
    )


def _decide_pinned(caps: Capabilities) -> bool:
    reasons = caps.reasons
    if caps.memlock_limit is not None and caps.memlock_limit < _SMALL_MEMLOCK:
        reasons.append(
            f"The memlock limit is {caps.memlock_limit} bytes: large pinned allocations may fail "
            "and fall back per buffer. Fix: raise it (ulimit -l unlimited, or docker run "
            "--ulimit memlock=-1)."
        )
    if caps.wsl and not env_flag(ENV_WSL_PIN, ""):
        reasons.append(
            "No pinned memory: this is WSL, where pinned memory is off by default and fails "
            f"or is capped. Fix: if your WSL setup supports it, set {ENV_WSL_PIN}=1."
        )
        return False
    try:
        t = _alloc_pinned(4096)
        pinned = bool(t.is_pinned())
    except Exception as e:  # driver, memlock, or allocator refusal
        reasons.append(
            f"No pinned memory: allocating 4 KiB of pinned host memory failed ({_short(e)}). "
            "Fix: raise the memlock limit (ulimit -l unlimited) or enable pinned memory "
            "for this platform."
        )
        return False
    if not pinned:
        reasons.append(
            "No pinned memory: a pin_memory=True allocation came back unpinned. "
            "Fix: enable pinned memory for this platform."
        )
        return False
    reasons.append("Pinned memory: a 4 KiB pinned allocation succeeded.")
    return True


def _decide_uva(caps: Capabilities) -> bool:
    reasons = caps.reasons
    if caps.device_type != "cuda":
        reasons.append(
            f"No UVA: device views of host memory need CUDA; {caps.device_type} "
            "has none here, so data is copied (tier PINNED)."
        )
        return False
    try:
        _uva_probe(caps.device)
    except ImportError:
        reasons.append(
            "No UVA: cuda-bindings is not installed, so no device pointer can be "
            "taken for pinned memory. Fix: pip install 'stagebuf[cuda]'."
        )
        return False
    except Exception as e:
        reasons.append(
            f"No UVA: {_short(e)}. Data is copied instead (tier PINNED). "
            "Fix: none needed for correctness; report it if you expected UVA here."
        )
        return False
    reasons.append("UVA: a device view of pinned memory aliases it and saw a later host write.")
    return True


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text[:200]


_cache: dict[str | None, Capabilities] = {}
_lock = threading.Lock()


def capabilities(device: DeviceLike = None) -> Capabilities:
    """The capabilities of ``device``, and the tier chosen for it.

    The first call for a device probes it (the settings, a pinned allocation and, on CUDA, a live device view
    of it); later calls return the same object, until :func:`reset_capabilities`.

    Parameters
    ----------
    device : torch.device, str, int or None, optional
        A ``torch.device``, a name such as ``"cuda:0"`` or ``"cpu"``, or a CUDA index. None (the default) is
        the current accelerator, else the CPU (the CPU also under ``STAGEBUF_TIER=host``).

    Raises
    ------
    SetupError
        (a ``ValueError`` too) If a ``STAGEBUF_*`` setting holds a value it does not take, or torch does not
        know ``device``; the message names the allowed values.
    TierUnavailableError
        If ``device`` is an accelerator torch cannot use here (no driver, a CPU build of torch, an index past
        the device count, ``meta``), or ``STAGEBUF_TIER`` forces a tier that cannot work on it.
    ArgumentTypeError
        If ``device`` is not None, a ``str``, an ``int`` or a ``torch.device`` (a ``bool`` is refused).
    """
    key = None if device is None else str(device)
    caps = _cache.get(key)
    if caps is not None:
        return caps
    new = False
    with _lock:
        caps = _cache.get(key)
        if caps is None:
            caps = probe(device)
            _cache[key] = caps
            _cache[str(caps.device)] = caps
            logger.debug("%s -> tier %s", caps.device, caps.tier.name)
            new = True
    if new:
        for hook in list(on_decision):
            hook(caps)
    return caps


on_decision: list[Callable[[Capabilities], None]] = []
"""Called with each new probe result (the vLLM plugin logs its tier line from here)."""


def decided() -> list[Capabilities]:
    """The tiers decided so far in this process, one per device (probed, not reset since)."""
    return list({id(c): c for c in _cache.values()}.values())


def reset_capabilities() -> None:
    """Forget every cached probe, so that the next :func:`capabilities` call probes again (after changing
    ``STAGEBUF_TIER``, say); buffers, pools and stagers made before keep their tier."""
    with _lock:
        _cache.clear()


def is_pin_memory_available(device: DeviceLike = None) -> bool:
    """Whether pinned host memory works for ``device`` (False on the CPU); raises as :func:`capabilities`."""
    return capabilities(device).pin_memory


def is_uva_available(device: DeviceLike = None) -> bool:
    """Whether ``capabilities(device).tier is Tier.UVA`` (False where ``STAGEBUF_TIER`` forces a worse tier);
    raises as :func:`capabilities`."""
    return capabilities(device).tier is Tier.UVA
