"""Helpers shared by the tests: forcing a tier, reading a device tensor back, faked machines and events.

Fixtures live in ``conftest.py``; plain functions and classes here (``import helpers``: pytest puts
``tests/`` on ``sys.path`` for test modules without an ``__init__.py``).
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import stagebuf
from stagebuf._bytes import buffers as buffers_mod
from stagebuf._device import uva as uva_mod
from stagebuf._rings import guard as guard_mod
from stagebuf._rings.staged_write import launcher as sw_launcher
from stagebuf._tiers import probe as caps_mod

# compute-sanitizer slows every CUDA call on the host more than the work on the device, so host timings
# mean nothing under it. scripts/gpu_reliability.sh and sanitize_lanes.sh set STAGEBUF_UNDER_SANITIZER; the
# sanitizer's own injection variable is a second sign.
UNDER_SANITIZER = bool(os.environ.get("STAGEBUF_UNDER_SANITIZER") or os.environ.get("CUDA_INJECTION64_PATH"))


def force_tier(monkeypatch: pytest.MonkeyPatch, tier: str) -> stagebuf.Tier:
    """Force ``tier`` through STAGEBUF_TIER and drop the cached probe."""
    monkeypatch.setenv("STAGEBUF_TIER", tier)
    stagebuf.reset_capabilities()
    return stagebuf.Tier.parse(tier)


def read_back(t: torch.Tensor) -> np.ndarray:
    """What the device holds: on CUDA a kernel reads it (through the view on UVA) first."""
    if t.device.type == "cuda":
        t = t.clone()
        torch.cuda.synchronize(t.device)
    return t.cpu().numpy()


# --- faked machines ----------------------------------------------------------------------


def fake_accelerator(monkeypatch: pytest.MonkeyPatch, allocations: bool = False) -> pytest.MonkeyPatch:
    """Probe 'cuda:0' on a CPU-only machine with the OS/driver answers faked (skips where CUDA exists).

    Everything works: pinned memory, cuda-bindings, a live device view. With ``allocations``
    buffers' host and device allocations are plain CPU tensors too.
    """
    if torch.cuda.is_available():
        pytest.skip("fakes an accelerator on a CPU-only machine")
    monkeypatch.setattr(caps_mod, "_is_wsl", lambda: False)
    monkeypatch.setattr(caps_mod, "device_missing", lambda dev: None)
    monkeypatch.setattr(caps_mod, "_memlock_limit", lambda: None)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a: True)
    monkeypatch.setattr(caps_mod, "_alloc_pinned", lambda n: torch.zeros(n, dtype=torch.uint8))
    monkeypatch.setattr(uva_mod, "load_cudart", lambda: object())
    monkeypatch.setattr(uva_mod, "device_view", lambda host, dev: host)  # a live alias
    if allocations:
        monkeypatch.setattr(
            buffers_mod, "alloc_host", lambda shape, dt, pinned, tier=None: torch.zeros(shape, dtype=dt)
        )
        monkeypatch.setattr(
            buffers_mod, "alloc_device", lambda shape, dt, d, tier=None: torch.zeros(shape, dtype=dt)
        )
    return monkeypatch


def no_accelerator(monkeypatch: pytest.MonkeyPatch, cuda_version: str | None) -> None:
    """This machine as one without an accelerator, torch built for ``cuda_version`` (None: CPU)."""
    monkeypatch.setattr(torch.version, "cuda", cuda_version)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    acc = getattr(torch, "accelerator", None)
    if acc is not None:
        monkeypatch.setattr(acc, "is_available", lambda: False)


# --- fake device events (``use_events(monkeypatch, FakeStream().event)``) ------------------


def use_events(monkeypatch: pytest.MonkeyPatch, make: Callable[[torch.device], Any]) -> None:
    """Rings made from now on take their events from ``make`` (None: no events), on fresh step clocks.

    Replaces ``guard.make_event`` and empties the clocks (each keeps the factory it was made with);
    ``monkeypatch`` puts both back.
    """
    monkeypatch.setattr(guard_mod, "make_event", make)
    monkeypatch.setattr(guard_mod, "_clocks", {})


def guard_staged_writes(monkeypatch: pytest.MonkeyPatch, mode: str = "wait") -> None:
    """Staged writes whose slots are made from now on guard them with ``mode``.

    Their guard is ``auto`` (``off`` on the CPU tiers); this wraps the launcher's ``Ring`` so that
    the CPU tests exercise the guard; ``monkeypatch`` puts it back.
    """
    ring = sw_launcher.Ring
    monkeypatch.setattr(sw_launcher, "Ring", lambda n, make, _auto, what: ring(n, make, mode, what))


class FakeStream:
    """A device stream of fake events: recorded in order, complete in order."""

    def __init__(self) -> None:
        self.records = 0
        self.done_upto = -1  # every event up to this serial has completed
        self.syncs = 0

    def event(self, device: torch.device) -> FakeEvent:
        return FakeEvent(self)

    def catch_up(self, behind: int = 0) -> None:
        """The device finishes every event recorded so far but the last ``behind``."""
        self.done_upto = max(self.done_upto, self.records - 1 - behind)


class FakeEvent:
    """Pending from ``record()`` until synchronized (or the stream caught up); counts records."""

    def __init__(self, stream: FakeStream) -> None:
        self.stream = stream
        self.serial: int | None = None
        self.recorded = 0

    def record(self) -> None:
        self.serial = self.stream.records
        self.stream.records += 1
        self.recorded += 1

    def query(self) -> bool:
        return self.serial is None or self.serial <= self.stream.done_upto

    def synchronize(self) -> None:
        self.stream.syncs += 1
        if self.serial is not None:
            self.stream.done_upto = max(self.stream.done_upto, self.serial)


# --- the command line --------------------------------------------------------------------


class CliResult:
    """What one command-line run printed and returned (``output`` is stdout and stderr together)."""

    def __init__(self, exit_code: int, stdout: str, stderr: str, exception: BaseException | None):
        self.exit_code = exit_code
        self.stdout = stdout
        self.stderr = stderr
        self.output = stdout + stderr
        self.exception = exception


def invoke(main: Callable[[list[str]], int], args: list[str], env: dict[str, str] | None = None) -> CliResult:
    """Run ``main(args)`` in this process with ``env`` set, capturing its output and exit status."""
    out, err = io.StringIO(), io.StringIO()
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    stagebuf.reset_capabilities()
    exc: BaseException | None = None
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(args)
            except SystemExit as e:
                exc = e
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Exception as e:  # a traceback: the tests assert there is none
                exc = e
                code = -1
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        stagebuf.reset_capabilities()
    return CliResult(code, out.getvalue(), err.getvalue(), exc)


def reset_warnings() -> None:
    """Forget which once-per-process warnings stagebuf gave (to observe "once" in a test)."""
    from stagebuf._common import log

    with log._lock:
        log._seen.clear()


def nano_or_skip(cuda: bool = False) -> Any:
    """nano-vllm's modules (``benchmarks.nanovllm_pkg.load``), or a skip saying why (``cuda``: and CUDA)."""
    from benchmarks import nanovllm_pkg as P

    if cuda and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    why = P.available()
    if why:
        pytest.skip(
            f"needs {P.DIST} {P.VERSION}'s wheel (pip download --no-deps; without network, carry "
            f".cache/nanovllm-{P.VERSION}): {why}"
        )
    return P.load()
