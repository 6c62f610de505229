"""Constants shared by more than one module: alignment, environment variables, check-mode poison."""

from __future__ import annotations

import os
from typing import Literal

from .._common.errors import SettingValueError

ALIGN = 16
"""Byte alignment of every array packed into a staging arena."""

ENV_TIER = "STAGEBUF_TIER"
"""Forces a tier (``uva``, ``pinned``, ``pageable``, ``host``); one that cannot work here raises."""
ENV_WSL_PIN = "STAGEBUF_WSL_PIN_MEMORY"
"""``1`` lets the probe try pinned memory on WSL2 (off by default: pinning there is capped)."""
ENV_CHECK = "STAGEBUF_CHECK"
"""``1`` turns on check mode: poison for unpublished and released slots, and the per-ring step verifier."""
ENV_VLLM = "STAGEBUF_VLLM"
"""``1`` makes stagebuf vLLM's MRV2 buffer layer through the vLLM plugin; unset or ``0``: vLLM's own."""
ENV_KERNEL = "STAGEBUF_WRITE_KERNEL"
"""Forces the staged-write apply kernel (``scatter`` or ``triton``); ``auto`` (default) picks per batch."""

POISON = 0xFF
"""Check mode fills memory that must not be read with this byte (int -1, float NaN)."""

DEFAULT_MAX_CONCURRENCY = 2
"""Slots per ring unless ``max_concurrency`` or ``set_default_max_concurrency`` says otherwise."""


def env_flag(name: str, fix: str) -> bool:
    """The on/off setting ``name``: unset, empty or ``0`` is off, ``1`` on; anything else (``false``, say)
    raises SettingValueError naming the allowed values and ``fix``."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() in ("", "0"):
        return False
    if raw.strip() == "1":
        return True
    raise SettingValueError(
        f"{name}={raw!r} is not a valid setting", setting=name, value=raw, allowed=("0", "1"), fix=fix
    )


def check_mode() -> bool:
    """Whether ``STAGEBUF_CHECK=1``: poison what a step has not published and what it released."""
    return env_flag(ENV_CHECK, f"set {ENV_CHECK}=1 for check mode, or 0 (or unset it) for none")


WriteKernelSetting = Literal["auto", "scatter", "triton"]
WRITE_KERNELS: tuple[WriteKernelSetting, ...] = ("auto", "scatter", "triton")
Kernel = Literal["host", "scatter", "triton"]
"""The kernel an apply ran (``host``: one numpy assignment on the HOST tier)."""


def write_kernel() -> WriteKernelSetting:
    """``STAGEBUF_WRITE_KERNEL`` (default ``auto``); a value not in WRITE_KERNELS raises SettingValueError."""
    raw = os.environ.get(ENV_KERNEL)
    value = (raw or "auto").strip().lower() or "auto"
    for k in WRITE_KERNELS:
        if value == k:
            return k
    raise SettingValueError(
        f"{ENV_KERNEL}={raw!r} is not a staged-write kernel",
        setting=ENV_KERNEL,
        value=str(raw),
        allowed=WRITE_KERNELS,
        fix=f"unset {ENV_KERNEL} (auto: the cheaper kernel per apply) or set it to scatter or triton",
    )


def kernel_on_host(device: str) -> str:
    """Why ``STAGEBUF_WRITE_KERNEL=triton`` does not apply on tier HOST (the probe logs it once)."""
    return (
        f"{ENV_KERNEL}=triton does not apply on {device}: on tier HOST a staged write is one numpy "
        f"assignment, no kernel. Fix: unset {ENV_KERNEL} (or target an accelerator)."
    )


ENV_QUARANTINE = "STAGEBUF_CHECK_QUARANTINE"
"""Check mode: how many steps (or changed pool calls) a released slot stays poisoned before reuse."""
DEFAULT_QUARANTINE = 16
MAX_QUARANTINE = 1024
"""The largest ``STAGEBUF_CHECK_QUARANTINE``: each ring keeps that many extra slots in check mode."""


def quarantine_cost(k: int) -> str:
    """What a quarantine of ``k`` costs, in words (doctor and the setting's error say it)."""
    return (
        f"each pool, backed tensor and stager keeps {k} extra slots in check mode, {k} times its "
        f"slot size: {k} MiB more for a 1 MiB StepStager"
    )


def quarantine() -> int:
    """``STAGEBUF_CHECK_QUARANTINE`` (default 16): an int in [0, MAX_QUARANTINE], else SettingValueError."""
    raw = os.environ.get(ENV_QUARANTINE)
    if raw is None or not raw.strip():
        return DEFAULT_QUARANTINE
    v = raw.strip()
    if v.isascii() and v.isdigit() and int(v) <= MAX_QUARANTINE:
        return int(v)
    raise SettingValueError(
        f"{ENV_QUARANTINE}={raw!r} is not a slot count in [0, {MAX_QUARANTINE}]",
        setting=ENV_QUARANTINE,
        value=raw,
        cause=f"it is how many more uses a released slot stays poisoned in check mode (default "
        f"{DEFAULT_QUARANTINE}); at the limit, {quarantine_cost(MAX_QUARANTINE)}",
        allowed=(f"an int in [0, {MAX_QUARANTINE}]",),
        fix=f"unset {ENV_QUARANTINE} (default {DEFAULT_QUARANTINE}) or set it to an int such as 16",
    )
