"""Allocation, with failures turned into errors that say what to do."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

import torch

from .._common.errors import (
    DeviceAllocationError,
    HostAllocationError,
    InvalidArgumentError,
    PinnedAllocationError,
)

if TYPE_CHECKING:
    from .._common.tier import Tier

MAX_BYTES = 2**63 - 1  # the most bytes one tensor can hold: torch counts sizes and bytes in int64

HOST_CHECK_MIN = 64 << 20
"""Host allocations from this many bytes on are checked against what the host can still give
(:func:`ensure_host_room`); smaller ones (every per-step input) never read /proc."""

_UNLIMITED = 1 << 62
"""A cgroup limit at or past this is no limit (v1 writes 2**63 - 4096 for none)."""


def nbytes_of(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """The bytes of ``shape``, refused past int64 (where torch raises its own TypeError or RuntimeError)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > MAX_BYTES or any(n > MAX_BYTES for n in shape):
        raise InvalidArgumentError(
            f"a tensor of shape {shape} and dtype {dtype} would hold {nbytes} bytes; "
            f"allowed: at most {MAX_BYTES} bytes (2**63 - 1: torch counts bytes in int64)"
        )
    return nbytes


def _human(nbytes: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes} B"


def _for(tier: Tier | None) -> str:
    return f" for tier {tier.name}" if tier is not None else ""


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # v2 writes "max" for no limit


def _stat_field(path: str, field: str) -> int:
    """A field of a cgroup ``memory.stat`` (0 if absent or unreadable)."""
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == field:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_dirs() -> list[tuple[str, str, str, str]]:
    """This process's memory cgroup and its ancestors, innermost first, as (directory, limit file, usage
    file, reclaimable field of memory.stat), for cgroup v2 and v1; empty where there is none."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found: list[tuple[str, str, str, str]] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            root, files = "/sys/fs/cgroup", ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            root, files = "/sys/fs/cgroup/memory", (
                "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file",
            )  # fmt: skip
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for k in range(len(parts), -1, -1):  # (in a cgroup namespace the path is "/": the root only)
            d = os.path.join(root, *parts[:k])
            if os.path.exists(os.path.join(d, files[0])):
                found.append((d, *files))
    return found


def available_host_bytes() -> int | None:
    """The bytes of host memory this process can still allocate without swapping or being killed, as far
    as the host says: Linux's ``MemAvailable`` (/proc/meminfo), lowered to what a cgroup memory limit leaves
    (its limit less its usage, page cache it can reclaim not counted as used), for this process's cgroup
    and every ancestor. None where the host says nothing (not Linux): then nothing is checked.

    It reads a few small files: call it only for large allocations (:func:`ensure_host_room` does so)."""
    avail: int | None = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024  # in kB
                    break
    except (OSError, ValueError, IndexError):
        return None
    for d, limit_file, usage_file, reclaimable in _cgroup_dirs():
        limit = _read_int(os.path.join(d, limit_file))
        usage = _read_int(os.path.join(d, usage_file))
        if limit is None or usage is None or limit >= _UNLIMITED:
            continue
        room = max(limit - usage + _stat_field(os.path.join(d, "memory.stat"), reclaimable), 0)
        avail = room if avail is None else min(avail, room)
    return avail


def ensure_host_room(nbytes: int, what: str, tier: Tier | None = None, fix: str | None = None) -> None:
    """Raise HostAllocationError, before anything is allocated, if ``nbytes`` of host memory are more than
    :func:`available_host_bytes`; ``what`` (what needs them, e.g. ``"staging 2**28 edits"``) and ``fix``
    (what to do) go into the message. Below ``HOST_CHECK_MIN`` bytes it returns at once, reading nothing."""
    if nbytes < HOST_CHECK_MIN:
        return
    avail = available_host_bytes()
    if avail is None or nbytes <= avail:
        return
    raise HostAllocationError(
        f"out of host memory: {what}{_for(tier)} needs {nbytes} bytes ({_human(nbytes)}) of host memory, "
        f"and {avail} bytes ({_human(avail)}) are available (MemAvailable in /proc/meminfo, or what a cgroup "
        f"memory limit leaves); nothing was allocated. {fix or 'Free host memory or ask for a smaller size'}"
    )


def alloc_host(
    shape: tuple[int, ...], dtype: torch.dtype, pinned: bool, tier: Tier | None = None
) -> torch.Tensor:
    """A zero-filled host tensor, page-locked (verified) when ``pinned``; raises InvalidArgumentError past
    2**63 - 1 bytes, HostAllocationError or PinnedAllocationError, naming ``tier`` where given."""
    n = nbytes_of(shape, dtype)
    ensure_host_room(n, f"allocating {shape} {dtype}", tier)
    if not pinned:
        try:
            return torch.zeros(shape, dtype=dtype, device="cpu")
        except (RuntimeError, MemoryError) as e:  # torch's CPU allocator raises RuntimeError
            raise HostAllocationError(
                f"out of host memory: allocating {n} bytes ({_human(n)}, {shape} {dtype}){_for(tier)} "
                f"failed ({str(e).strip().splitlines()[0][:160]}); free host memory or ask for a smaller size"
            ) from e
    try:
        t = torch.zeros(shape, dtype=dtype, device="cpu", pin_memory=True)
    except Exception as e:
        raise PinnedAllocationError(
            f"pinned allocation of {shape} {dtype} ({n} bytes, {_human(n)}{_for(tier)}) failed: "
            f"{str(e).strip()[:200]}"
        ) from e
    if t.numel() and not t.is_pinned():
        raise PinnedAllocationError(f"pinned allocation of {shape} {dtype} came back unpinned")
    return t


def alloc_device(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, tier: Tier | None = None
) -> torch.Tensor:
    """A zero-filled tensor on ``device``; raises InvalidArgumentError past 2**63 - 1 bytes and
    DeviceAllocationError out of memory, naming ``tier`` if given; on a CPU device (tier HOST, or a CPU
    stand-in) the memory is host memory: HostAllocationError, as ``alloc_host``."""
    if device.type == "cpu":
        return alloc_host(shape, dtype, pinned=False, tier=tier)
    n = nbytes_of(shape, dtype)
    try:
        return torch.zeros(shape, dtype=dtype, device=device)
    except (torch.OutOfMemoryError, MemoryError) as e:
        oom: BaseException = e
    raise DeviceAllocationError(
        f"out of device memory: allocating {n} bytes ({_human(n)}, {shape} {dtype}) on {device}"
        f"{_for(tier)} failed; free device memory or ask for a smaller size"
    ) from oom
