"""What every workload shares: a forced stagebuf tier, the clocks, the busy-GPU stand-in, a case's form.

Steps are timed on the host, taking turns in a rotating order (:func:`turns`; engines: :class:`Lockstep`, the
GPU idle or busy). The micro and writes workloads are :class:`Strategy` lists, each building a :class:`Case`
(a step to time, then a check), warmed up by :func:`prepare` and timed by :func:`time_repeat`.
"""

from __future__ import annotations

import gc
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import stagebuf
from stagebuf import Tier


@contextmanager
def env_var(name: str, value: str | None) -> Iterator[None]:
    """The environment variable ``name`` set to ``value`` (None: unset) for the block, then restored."""
    old = os.environ.get(name)
    _set(name, value)
    try:
        yield
    finally:
        _set(name, old)


def _set(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


@contextmanager
def stagebuf_tier(tier: str | None, *others: Any) -> Iterator[None]:
    """``STAGEBUF_TIER=tier`` (None: unset) for the block, the probe (also ``others``') forgotten."""
    forget = lambda: [p.reset_capabilities() for p in (stagebuf, *others)]
    with env_var("STAGEBUF_TIER", tier):
        forget()
        try:
            yield
        finally:
            forget()


def tiers(device: torch.device) -> list[str]:
    """The stagebuf tiers this device has, best first, HOST only on a CPU (there: host and pageable)."""
    if device.type != "cuda":
        return ["host", "pageable"]
    best = stagebuf.capabilities(device).tier
    return [t.name.lower() for t in Tier if best <= t < Tier.HOST]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


BUSY_MS = 3.0  # The forward stand-in of a step on a busy GPU, ms.


def medians(runs: dict[str, list[dict[str, Any]]], keys: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Per key of ``runs``, the median over its runs of each of ``keys`` (None left out; none: NaN)."""
    med = lambda xs: float(np.median(xs)) if xs else float("nan")
    return {k: {m: med([r[m] for r in v if r[m] is not None]) for m in keys} for k, v in runs.items()}


def sleep_cycles_for(ms: float, device: torch.device) -> int:
    """``torch.cuda._sleep`` cycles for about ``ms`` milliseconds on ``device`` (measured once)."""
    probe = 1_000_000
    torch.cuda._sleep(probe)  # warm
    torch.cuda.synchronize(device)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(probe)
    b.record()
    b.synchronize()
    return int(probe / max(a.elapsed_time(b), 1e-3) * ms)


def wait(ev: Any) -> None:
    """Wait for a CUDA event by polling, the same way before every timed step."""
    while not ev.query():
        time.sleep(50e-6)


def turns(
    steps: list[Callable[[int], object]],
    device: torch.device,
    n: int,
    warmup: int,
    prep: list[Callable[[int], object]] | None = None,
) -> list[float]:
    """The median host µs of each of ``steps``, in turns, each after ``prep`` on an idle device."""
    times: list[list[float]] = [[] for _ in steps]
    k, clock = len(steps), time.perf_counter
    for i in range(warmup + n):
        for j in range(k):
            s = (i + j) % k
            if prep is not None:
                prep[s](i)
            sync(device)
            t0 = clock()
            steps[s](i)
            t1 = clock()
            sync(device)
            if i >= warmup:
                times[s].append((t1 - t0) * 1e6)
    return [float(np.median(t)) for t in times]


class Lockstep:
    """Engines taking turns on one trace; on a busy GPU each waits for its previous step (two in flight)."""

    def __init__(self, engines: int, device: torch.device, busy_cycles: int):
        self.n, self.cuda, self.busy = engines, device.type == "cuda", busy_cycles
        self.prev: list[Any] = [None] * engines

    def order(self, i: int) -> list[int]:
        return [(i + j) % self.n for j in range(self.n)]

    def before(self) -> None:
        if self.cuda and not self.busy:
            done = torch.cuda.Event()
            done.record()
            wait(done)

    def after(self, e: int) -> None:
        """After engine ``e``'s step and forward stand-in: on a busy GPU, wait for its previous step."""
        if self.cuda and self.busy:
            ev = torch.cuda.Event()
            ev.record()
            if self.prev[e] is not None:
                wait(self.prev[e])
            self.prev[e] = ev


def ints(ctx: Any, param: Any, value: str | None) -> tuple[int, ...] | None:
    """A click callback: comma-separated integers >= 1 as a tuple."""
    import click

    if value is None:
        return None
    try:
        out = tuple(int(v) for v in value.replace(" ", "").split(",") if v)
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected comma-separated integers") from None
    if not out or any(v < 1 for v in out):
        raise click.BadParameter(f"{value!r}: expected integers >= 1")
    return out


def commit() -> str | None:
    """``$STAGEBUF_BENCH_COMMIT`` (a copied tree's .git may not be what was copied), else git's HEAD."""
    return os.environ.get("STAGEBUF_BENCH_COMMIT") or git("rev-parse", "HEAD")


def git(*args: str) -> str | None:
    try:
        here = Path(__file__).parent
        r = subprocess.run(["git", *args], capture_output=True, text=True, timeout=5, cwd=here)
    except Exception:
        return None
    return r.stdout.strip() if r.returncode == 0 else None


# --- the micro and writes workloads' form -----------------------------------------------------------


@dataclass
class Env:
    """What a strategy is built for: the device, what it offers, and micro's arrays per step."""

    device: torch.device
    cuda: bool
    pin_memory: bool
    uva: bool
    k: int = 8
    seed: int = 0


@dataclass
class Case:
    """One step to time, and a check (plus extra facts) to run after timing."""

    step: Callable[[], object]
    finish: Callable[[], dict[str, Any]] = field(default=lambda: {})


@dataclass(frozen=True)
class Strategy:
    name: str
    label: str
    kind: str  # 'baseline', 'stagebuf' or 'floor'
    build: Callable[[Env, Any], Case]  # (env, size): micro's N, or a ``writes.WriteCell``
    tier: Tier | None = None  # the forced stagebuf tier (None: built with STAGEBUF_TIER unset)
    needs: tuple[str, ...] = ()  # of the machine: 'cuda', 'pinned', 'uva', 'triton', 'vllm' (its files)


class BenchCheckError(RuntimeError):
    """A strategy's device result differs from the host model: the run fails."""


def prepare(step: Callable[[], object], sync: Callable[[], None], max_iters: int, target_s: float) -> int:
    """Warm ``step`` up; the steps per repeat (2 .. ``max_iters``) that last about ``target_s``."""
    for _ in range(3):
        step()
    sync()
    n, t0 = 0, time.perf_counter()
    while n < 2 or (n < max_iters // 4 + 2 and time.perf_counter() - t0 < 0.2 * target_s):
        step()
        n += 1
    sync()
    per = (time.perf_counter() - t0) / n
    return max(2, min(max_iters, int(target_s / max(per, 1e-9))))


def time_repeat(step: Callable[[], object], sync: Callable[[], None], iters: int) -> tuple[float, float]:
    """One repeat of ``iters`` steps, the garbage collector off: (host µs a step, synchronised µs a step)."""
    sync()
    was = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
    finally:
        if was:
            gc.enable()
    return (t1 - t0) / iters * 1e6, (t2 - t0) / iters * 1e6


def summarise(hs: list[float], es: list[float], iters: int) -> dict[str, Any]:
    """A case's row of the report: the medians of its repeats, and each repeat's time."""
    row: dict[str, Any] = {"iters": iters, "repeats": len(hs)}
    for k, xs in (("host", hs), ("e2e", es)):
        row |= {f"{k}_us": round(statistics.median(xs), 3), f"{k}_samples_us": [round(x, 3) for x in xs]}
    return row
