"""``Capabilities``, the probe's record for one device; what an explicit request may ask for there; and the
machine facts that need no probing (the installed stack, ``STAGEBUF_TIER``)."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from .._common.errors import ArgumentTypeError, InvalidArgumentError, SettingValueError
from .._common.sealed import Sealed, read_only
from .._common.tier import Tier
from .._common.types import DeviceLike
from .._device import uva as _uva
from .settings import ENV_TIER


def torch_build() -> str:
    """What torch was built for: "CPU build", "CUDA 13.0 build", "ROCm 6.4 build"."""
    if torch.version.cuda:
        return f"CUDA {torch.version.cuda} build"
    hip = getattr(torch.version, "hip", None)
    if hip:
        return f"ROCm {hip} build"
    return "CPU build"


def cuda_missing_cause() -> tuple[str, str]:
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


def device_missing(dev: torch.device) -> str | None:
    """Why torch cannot use accelerator ``dev`` here, or None when it can."""
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return cuda_missing_cause()[0]
        n = torch.cuda.device_count()
        return None if dev.index is None or dev.index < n else f"torch sees only {n} CUDA device(s)"
    if dev.type == "meta":
        return "a meta tensor holds no data, so nothing staged there could be read"
    available = getattr(getattr(torch, dev.type, None), "is_available", None)
    if callable(available) and not available():
        return f"torch.{dev.type}.is_available() is False (torch is a {torch_build()})"
    try:  # a device type torch parses but has no backend for here (xla without torch_xla, say)
        torch.empty(0, device=dev)
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0].rstrip(".")[:200]
        return f"torch cannot allocate memory on {dev.type} here (no {dev.type} backend is loaded): {first}"
    return None


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


@read_only(
    {
        "*": "it is the probe's decision, cached per device and shared by every buffer made for it; "
        "set STAGEBUF_TIER (or pass another device) and call reset_capabilities() to probe again"
    }
)
@dataclass
class Capabilities(Sealed):
    """What one device can do, the tier chosen for it, and why (a value: copies and pickles are allowed).

    Made by the probe behind :func:`capabilities`; read it, do not build one. Every buffer, pool and stager
    takes its tier from here, so it is read-only (ReadOnlyAttributeError).

    Attributes
    ----------
    device : torch.device
        The device probed, its index resolved (``"cuda"`` becomes ``cuda:N``, the current device).
    device_type : str
        ``device.type``: ``"cuda"``, ``"cpu"``, ...
    pin_memory : bool
        Whether a pinned host allocation succeeded and came back pinned; always False on the CPU.
    uva : bool
        Whether the UVA probe passed: a device view of pinned memory saw a host write made after it existed.
    tier : Tier
        The tier chosen: the best that works on ``device``, or the one ``STAGEBUF_TIER`` forces.
    reasons : list of str
        One plain sentence per decision, in the order they were made (what ``stagebuf doctor`` prints).
    forced : str or None
        The tier ``STAGEBUF_TIER`` forces, lower case (``"pinned"``); None when it is unset.
    wsl : bool
        Whether this is WSL, where pinned memory is off unless ``STAGEBUF_WSL_PIN_MEMORY=1``.
    memlock_limit : int or None
        The ``RLIMIT_MEMLOCK`` soft limit in bytes; None means unlimited.
    versions : dict of str to str
        ``torch``, ``python`` and where present ``cuda_runtime``, ``triton``, ``cuda_bindings``,
        ``cuda_driver_api``, ``device_name``.
    torch_build : str
        What torch was built for: ``"CPU build"``, ``"CUDA 13.0 build"``, ``"ROCm 6.4 build"``.
    cpu_cause : str or None
        Why the target device is the CPU; None when it is an accelerator.
    cpu_fix : str or None
        What to do to target an accelerator instead, where there is something to do (else None).
    """

    _COPYABLE = True

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
        """Every attribute as a plain value (what ``stagebuf doctor --json`` prints): ``device`` as a string,
        ``tier`` as its name, copies of ``reasons`` and ``versions``."""
        out = {f.name: getattr(self, f.name) for f in fields(self)} | {"versions": dict(self.versions)}
        return out | {"device": str(self.device), "tier": self.tier.name, "reasons": list(self.reasons)}


def stack_versions(device: torch.device) -> dict[str, str]:
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


def forced_tier() -> Tier | None:
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
            allowed=tuple(t.name.lower() for t in Tier),
            fix=f"unset {ENV_TIER} (stagebuf then picks the best tier that works) or set it to "
            "one of the allowed values",
        ) from None


def device_type(device: DeviceLike, who: str) -> str:
    """The type of ``device`` (a str, an int or a torch.device), or raise saying what is allowed."""
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise ArgumentTypeError(
            f"{who}: device={device!r} is a {type(device).__name__}; allowed: None or 'cpu'"
        )
    try:
        return torch.device(device).type
    except (RuntimeError, ValueError, TypeError, OverflowError):
        raise InvalidArgumentError(
            f"{who}: device={device!r} is not a device; allowed: None or 'cpu'"
        ) from None
