"""The one place that decides the tier.

``capabilities(device)`` probes once per device what this machine can really do
(it allocates pinned memory, builds a device view and checks it is live) and
records one plain sentence per decision. Everything else in stagebuf asks it and
never re-derives a tier.
"""

from __future__ import annotations

import os
import platform
import resource
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _uva
from ._constants import ENV_TIER, ENV_WSL_PIN, check_mode, quarantine, write_kernel
from ._errors import ArgumentTypeError, SettingValueError, TierUnavailableError, UnknownDeviceError, UvaError
from ._log import logger, warn_once
from ._memory import alloc_host
from ._sealed import Sealed
from ._tier import Tier
from ._types import DeviceLike

_SMALL_MEMLOCK = 64 << 20


def torch_build() -> str:
    """What torch was built for: "CPU build", "CUDA 13.0 build", "ROCm 6.4 build"."""
    if torch.version.cuda:
        return f"CUDA {torch.version.cuda} build"
    hip = getattr(torch.version, "hip", None)
    if hip:
        return f"ROCm {hip} build"
    return "CPU build"


def _cuda_missing_cause() -> tuple[str, str]:
    """(cause, fix) for ``torch.cuda.is_available()`` being False."""
    if torch_build() == "CPU build":
        return (
            f"torch is a CPU build (torch {torch.__version__}) without CUDA support",
            "install a CUDA build of torch to use a GPU",
        )
    kind, ver = ("CUDA", torch.version.cuda) if torch.version.cuda else ("ROCm", torch.version.hip)
    return (
        f"torch is a {kind} build but sees no driver or GPU (torch {torch.__version__}, "
        f"{kind} {ver}; torch.cuda.is_available() is False)",
        "check that the GPU driver is loaded (nvidia-smi) and that CUDA_VISIBLE_DEVICES "
        "does not hide the GPU",
    )


def usable_devices() -> list[str]:
    """The devices this machine can stage to, CPU first (for error messages)."""
    out = ["cpu"]
    if torch.cuda.is_available():
        out += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    else:
        acc = getattr(torch, "accelerator", None)
        cur = acc.current_accelerator() if acc is not None and acc.is_available() else None
        if cur is not None:
            out.append(str(cur))
    return out


@dataclass
class Capabilities(Sealed):
    """What one device can do, the tier chosen for it, and why.

    Made by the probe behind :func:`capabilities`; read it, do not build one. Every
    buffer, pool and stager takes its tier from here, so the probe's result is
    read-only: assigning or deleting an attribute raises ReadOnlyAttributeError.

    Attributes
    ----------
    device : torch.device
        The device probed, with its index resolved (``"cuda"`` becomes ``cuda:N``,
        the current device).
    device_type : str
        ``device.type``: ``"cuda"``, ``"cpu"``, ...
    pin_memory : bool
        Whether a pinned (page-locked) host allocation succeeded and came back
        pinned. Always False when the device is the CPU.
    uva : bool
        Whether a device view of pinned memory aliased it and saw a host write made
        after the view existed (the UVA probe passed). The tier can still be worse
        than UVA when ``STAGEBUF_TIER`` forces one.
    tier : Tier
        The tier chosen: the best that works on ``device``, or the one
        ``STAGEBUF_TIER`` forces.
    reasons : list of str
        One plain sentence per decision, in the order they were made (what
        ``stagebuf doctor`` prints).
    forced : str or None
        The tier ``STAGEBUF_TIER`` forces, lower case (``"pinned"``), or None when
        it is unset.
    wsl : bool
        Whether this is WSL, where pinned memory is off unless
        ``STAGEBUF_WSL_PIN_MEMORY=1``.
    memlock_limit : int or None
        The ``RLIMIT_MEMLOCK`` soft limit in bytes; None means unlimited.
    versions : dict of str to str
        ``torch`` and ``python``, and where present ``cuda_runtime``, ``triton``,
        ``cuda_bindings``, ``cuda_driver_api`` and ``device_name``.
    torch_build : str
        What torch was built for: ``"CPU build"``, ``"CUDA 13.0 build"``,
        ``"ROCm 6.4 build"``.
    cpu_cause : str or None
        Why the target device is the CPU; None when it is an accelerator.
    cpu_fix : str or None
        What to do to target an accelerator instead, where there is something to
        do (None otherwise).
    """

    device: torch.device
    device_type: str
    pin_memory: bool
    uva: bool
    tier: Tier
    reasons: list[str] = field(default_factory=list)
    forced: str | None = None
    wsl: bool = False
    memlock_limit: int | None = None
    versions: dict[str, str] = field(default_factory=dict)
    torch_build: str = ""
    cpu_cause: str | None = None
    cpu_fix: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The capabilities as plain values (what ``stagebuf doctor --json`` prints).

        Returns
        -------
        dict of str to Any
            Every attribute, with ``device`` as a string, ``tier`` as its name and
            copies of ``reasons`` and ``versions``.
        """
        return {
            "device": str(self.device),
            "device_type": self.device_type,
            "pin_memory": self.pin_memory,
            "uva": self.uva,
            "tier": self.tier.name,
            "reasons": list(self.reasons),
            "forced": self.forced,
            "wsl": self.wsl,
            "memlock_limit": self.memlock_limit,
            "versions": dict(self.versions),
            "torch_build": self.torch_build,
            "cpu_cause": self.cpu_cause,
            "cpu_fix": self.cpu_fix,
        }


# --- what the OS and drivers answer (tests replace these to fake a machine) ---


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


def _device_missing(dev: torch.device) -> str | None:
    """Why torch cannot use accelerator ``dev`` here, or None when it can."""
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return _cuda_missing_cause()[0]
        n = torch.cuda.device_count()
        return None if dev.index is None or dev.index < n else f"torch sees only {n} CUDA device(s)"
    if dev.type == "meta":
        return "a meta tensor holds no data, so nothing staged there could be read"
    available = getattr(getattr(torch, dev.type, None), "is_available", None)
    if callable(available) and not available():
        return f"torch.{dev.type}.is_available() is False (torch is a {torch_build()})"
    return None


def _device_hint(dev: torch.device) -> str | None:
    """What to do about a missing ``dev``, beyond choosing another device."""
    if dev.type == "cuda" and not torch.cuda.is_available():
        return _cuda_missing_cause()[1]
    return None


def _alloc_pinned(nbytes: int) -> torch.Tensor:
    """Allocate page-locked host memory (the same call the buffers make)."""
    return alloc_host((nbytes,), torch.uint8, pinned=True)


def _uva_probe(device: torch.device) -> None:
    """Build a device view of pinned memory and check it is a live alias.

    Raises ImportError without cuda-bindings and UvaError for anything else.
    """
    _uva.load_cudart()
    host = _alloc_pinned(256).view(torch.int32)
    view = _uva.device_view(host, device)
    for seed in (0x5A5A, 0x1234):
        # Write on the host *after* the view exists, read on the device.
        expect = torch.arange(seed, seed + host.numel(), dtype=torch.int32)
        host.copy_(expect)
        _synchronize(device)
        got = view.clone().cpu()
        if not torch.equal(got, expect):
            raise UvaError(
                "coherence probe failed: the device view did not see a host write made after "
                "it was created (stale copy; seen under GPU confidential computing)"
            )


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(device)


def _versions(device: torch.device) -> dict[str, str]:
    v = {"torch": torch.__version__, "python": platform.python_version()}
    if torch.version.cuda:
        v["cuda_runtime"] = str(torch.version.cuda)
    try:
        import triton

        v["triton"] = triton.__version__
    except Exception:
        pass
    try:
        cudart = _uva.load_cudart()
        from cuda import bindings

        v["cuda_bindings"] = getattr(bindings, "__version__", "?")
        if device.type == "cuda":
            err, drv = cudart.cudaDriverGetVersion()
            if int(err) == 0:
                v["cuda_driver_api"] = f"{drv // 1000}.{drv % 1000 // 10}"
    except Exception:
        pass
    if device.type == "cuda" and torch.cuda.is_available():
        v["device_name"] = torch.cuda.get_device_name(device)
    return v


# --- the decision ---

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
        why = _device_missing(dev)
        if why:
            hint = _device_hint(dev)
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


_TIER_NAMES = tuple(t.name.lower() for t in Tier)


def _forced_tier() -> Tier | None:
    raw = os.environ.get(ENV_TIER, "").strip()
    if not raw:
        return None
    try:
        return Tier.parse(raw, ENV_TIER)
    except ValueError:
        raise SettingValueError(
            f"{ENV_TIER}={raw!r} is not a tier",
            setting=ENV_TIER,
            value=raw,
            allowed=_TIER_NAMES,
            fix=f"unset {ENV_TIER} (stagebuf then picks the best tier that works) or set it to "
            "one of the allowed values",
        ) from None


def usable_tiers(caps: Capabilities) -> list[Tier]:
    """The tiers an explicit request may ask for on ``caps.device``, best first.

    On the CPU: PAGEABLE (a CPU tensor stands in for device memory) and HOST. On
    an accelerator: the chosen tier and every worse copy tier (a forced tier caps
    the process; nothing better than it is used).
    """
    if caps.device_type == "cpu":
        return [Tier.PAGEABLE, Tier.HOST]
    return [t for t in (Tier.UVA, Tier.PINNED, Tier.PAGEABLE) if t >= caps.tier]


def _cpu_cause(device: DeviceLike, forced: Tier | None) -> tuple[str, str | None]:
    """(why the target is the CPU, what to do to target an accelerator)."""
    if forced is Tier.HOST and device is None:
        return f"{ENV_TIER}=host targets the CPU", f"unset {ENV_TIER} to use an accelerator"
    if device is not None:
        return f"device={device!r} was asked for", None
    if not torch.cuda.is_available():
        return _cuda_missing_cause()
    return "no accelerator is available", None


def probe(device: DeviceLike = None) -> Capabilities:
    """Probe ``device`` now, bypassing the cache (``capabilities`` caches this).

    Every setting is checked here, at start-up: ``STAGEBUF_TIER``, ``STAGEBUF_CHECK``,
    ``STAGEBUF_CHECK_QUARANTINE`` and ``STAGEBUF_WRITE_KERNEL`` (a bad value raises
    SettingValueError naming the allowed values).
    """
    check_mode()
    quarantine()
    write_kernel()
    forced = _forced_tier()
    dev = _resolve_device(device, forced)
    reasons: list[str] = []
    memlock = _memlock_limit()
    wsl = _is_wsl()
    caps = Capabilities(
        dev,
        dev.type,
        False,
        False,
        Tier.HOST,
        reasons,
        forced.name.lower() if forced else None,
        wsl,
        memlock,
        torch_build=torch_build(),
    )
    if dev.type == "cpu":
        cause, hint = _cpu_cause(device, forced)
        caps.cpu_cause, caps.cpu_fix = cause, hint
        reasons.append(
            f"The target device is the CPU because {cause}, so there is nothing to "
            "transfer to: pinned memory and UVA are not used." + (f" Fix: {hint}." if hint else "")
        )
        if forced in (Tier.UVA, Tier.PINNED):
            name = forced.name.lower()
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
        caps.versions = _versions(dev)
        caps._freeze()  # shared by every caller from here on: read-only
        return caps

    caps.pin_memory = _decide_pinned(caps)
    caps.uva = caps.pin_memory and _decide_uva(caps)
    best = Tier.UVA if caps.uva else Tier.PINNED if caps.pin_memory else Tier.PAGEABLE
    works = [t.name.lower() for t in (Tier.UVA, Tier.PINNED, Tier.PAGEABLE) if t >= best]
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
            f"{ENV_TIER}={forced.name.lower()} cannot work on {dev}",
            setting=ENV_TIER,
            value=forced.name.lower(),
            cause=" ".join(r for r in reasons if r.startswith("No ")) or " ".join(reasons),
            allowed=works,
            fix=f"unset {ENV_TIER} (stagebuf then picks the best tier, {best.name}) or set it to "
            "one of the allowed tiers",
        )
    caps.tier = forced if forced is not None else best
    if forced is not None:
        reasons.append(
            f"{ENV_TIER}={forced.name.lower()} forces tier {forced.name} (best available: {best.name})."
        )
    else:
        reasons.append(f"Tier {best.name}: the best tier that works on {dev}.")
    if best is not Tier.UVA:
        why = " ".join(r for r in reasons if r.startswith("No "))
        warn_once(("fallback", str(dev), best), f"tier {best.name} on {dev} instead of UVA: {why}")
    caps.versions = _versions(dev)
    caps._freeze()  # shared by every caller from here on: read-only
    return caps


def _decide_pinned(caps: Capabilities) -> bool:
    reasons = caps.reasons
    if caps.memlock_limit is not None and caps.memlock_limit < _SMALL_MEMLOCK:
        reasons.append(
            f"The memlock limit is {caps.memlock_limit} bytes: large pinned allocations may fail "
            "and fall back per buffer. Fix: raise it (ulimit -l unlimited, or docker run "
            "--ulimit memlock=-1)."
        )
    if caps.wsl and os.environ.get(ENV_WSL_PIN) != "1":
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

    The first call for a device probes it: it checks the settings, allocates pinned
    memory and, on CUDA, builds a device view of it and checks that the view is live.
    The result is cached per device; :func:`reset_capabilities` clears the cache.

    Parameters
    ----------
    device : torch.device, str, int or None, optional
        The device to stage to: a ``torch.device``, a name such as ``"cuda:0"`` or
        ``"cpu"``, or a CUDA index. None (the default) is the current accelerator,
        else the CPU (the CPU also under ``STAGEBUF_TIER=host``).

    Returns
    -------
    Capabilities
        The probe's result; later calls for the same device return the same object.

    Raises
    ------
    SetupError
        (a ``ValueError`` too) If a stagebuf environment setting (``STAGEBUF_TIER``,
        ``STAGEBUF_CHECK``, ``STAGEBUF_WRITE_KERNEL`` and the like) holds a value it
        does not take, or if torch does not know ``device``; the message names the
        allowed values.
    TierUnavailableError
        If ``device`` is an accelerator torch cannot use here (no driver, a CPU build
        of torch, an index past the device count, ``meta``), or if ``STAGEBUF_TIER``
        forces a tier that cannot work on the device.
    ArgumentTypeError
        If ``device`` is not None, a ``str``, an ``int`` or a ``torch.device`` (a
        ``bool`` is refused).
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


def reset_capabilities() -> None:
    """Forget every cached probe, so that the next :func:`capabilities` call probes again.

    Call it after changing ``STAGEBUF_TIER`` (say). Buffers, pools and stagers made
    before keep the tier they were made with.
    """
    with _lock:
        _cache.clear()


def is_pin_memory_available(device: DeviceLike = None) -> bool:
    """Whether pinned host memory works for ``device`` (``capabilities(device).pin_memory``).

    Parameters
    ----------
    device : torch.device, str, int or None, optional
        As for :func:`capabilities`; None is the default device.

    Returns
    -------
    bool
        True where a pinned allocation succeeded in the probe; always False for the CPU.

    Raises
    ------
    SetupError
        As :func:`capabilities`: a bad setting or a device torch does not know.
    TierUnavailableError
        As :func:`capabilities`: a device or forced tier that cannot work here.
    ArgumentTypeError
        As :func:`capabilities`: ``device`` of a type that is not accepted.
    """
    return capabilities(device).pin_memory


def is_uva_available(device: DeviceLike = None) -> bool:
    """Whether the tier chosen for ``device`` is UVA (zero-copy device views of pinned memory).

    Parameters
    ----------
    device : torch.device, str, int or None, optional
        As for :func:`capabilities`; None is the default device.

    Returns
    -------
    bool
        ``capabilities(device).tier is Tier.UVA``: False where ``STAGEBUF_TIER`` forces
        a worse tier, even if the UVA probe passed.

    Raises
    ------
    SetupError
        As :func:`capabilities`: a bad setting or a device torch does not know.
    TierUnavailableError
        As :func:`capabilities`: a device or forced tier that cannot work here.
    ArgumentTypeError
        As :func:`capabilities`: ``device`` of a type that is not accepted.
    """
    return capabilities(device).tier is Tier.UVA
