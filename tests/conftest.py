"""Shared fixtures: tiers to run on, the gpu marker, a clean probe per test."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import stagebuf
from helpers import force_tier, reset_warnings

HAS_CUDA = torch.cuda.is_available()
CPU_TIERS = ["host", "pageable"]
GPU_TIERS = ["uva", "pinned", "pageable"]


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line for every skip, by reason (``-rs`` lists each one)."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped or "s" in (config.option.reportchars or "").replace("a", "s"):
        return
    counts: dict[str, int] = {}
    for rep in skipped:
        longrepr = rep.longrepr
        reason = str(longrepr[2] if isinstance(longrepr, tuple) else longrepr)
        reason = reason.removeprefix("Skipped: ").split(" (")[0].split(":")[0].strip()
        counts[reason] = counts.get(reason, 0) + 1
    top = sorted(counts.items(), key=lambda kv: -kv[1])
    shown = top if len(top) <= 4 else top[:3]
    parts = [f"{n} {why}" for why, n in shown]
    if len(top) > len(shown):
        parts.append(f"{sum(n for _, n in top[3:])} for {len(top) - 3} other reasons")
    terminalreporter.write_line(f"skipped {len(skipped)}: {'; '.join(parts)} (-rs lists each)")


@pytest.fixture(autouse=True)
def _fresh_probe(monkeypatch):
    """Each test starts with no cached probe, no given warnings and no forced tier."""
    if "STAGEBUF_TIER" in os.environ and not os.environ.get("STAGEBUF_KEEP_TIER"):
        monkeypatch.delenv("STAGEBUF_TIER")
    stagebuf.reset_capabilities()
    reset_warnings()
    yield
    stagebuf.reset_capabilities()
    reset_warnings()


@pytest.fixture(params=CPU_TIERS)
def cpu_tier(request, monkeypatch) -> stagebuf.Tier:
    """Every tier that runs on a CPU-only machine: HOST, and PAGEABLE targeting the CPU."""
    return force_tier(monkeypatch, request.param)


@pytest.fixture(params=GPU_TIERS)
def gpu_tier(request, monkeypatch) -> stagebuf.Tier:
    """UVA, PINNED and PAGEABLE on the CUDA device (skipped without one)."""
    if not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    return force_tier(monkeypatch, request.param)


@pytest.fixture(
    params=[
        "host",
        "pageable",
        pytest.param("uva", marks=pytest.mark.gpu),
        pytest.param("pinned", marks=pytest.mark.gpu),
    ]
)
def any_tier(request, monkeypatch) -> stagebuf.Tier:
    """Every tier this machine can run: the CPU tiers, plus the CUDA tiers where CUDA exists.

    The CUDA tiers carry the ``gpu`` marker, so ``pytest -m gpu`` runs them on a GPU machine.
    """
    if request.param in ("uva", "pinned") and not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    return force_tier(monkeypatch, request.param)


@pytest.fixture
def vllm_interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The newest vLLM release's MRV2 modules loadable (``vllm_mrv2.NEWEST``), their Triton kernels in
    Triton's CPU interpreter.

    Skips, saying why, where vLLM's files cannot be fetched (``benchmarks.vllm_mrv2``) or Triton
    is missing.
    """
    from benchmarks import vllm_mrv2

    why = vllm_mrv2.available()
    if why:
        pytest.skip(f"needs vLLM {vllm_mrv2.NEWEST}'s MRV2 modules: {why}")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _releases() -> list[Any]:
    from benchmarks import vllm_mrv2

    return [pytest.param(r, id=f"v{r}") for r in vllm_mrv2.RELEASES]


@pytest.fixture(params=_releases())
def vllm_release(request: pytest.FixtureRequest) -> str:
    """Each vLLM release the harness knows (``benchmarks.vllm_mrv2.RELEASES``, ids like ``v0.34.0``), its
    files fetched: a test that runs vLLM's MRV2 code takes it to run on every release. Where a release's
    files cannot be had (no network) or Triton is missing, its tests skip, saying why."""
    from benchmarks import vllm_mrv2

    release: str = request.param
    why = vllm_mrv2.available(release)
    if why:
        pytest.skip(f"needs vLLM {release}'s MRV2 modules: {why}")
    return release
