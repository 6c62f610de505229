"""One visibility and lifetime contract on every tier, and STAGEBUF_CHECK=1 making misuse loud.

The same program (including two misuses: reading a staged tensor inside its
step, and keeping it past its lifetime) runs under every tier this machine has;
every tier must observe exactly what an independent model of the contract says:

* a tensor from ``step.stage()`` shows its data from the step's exit on;
* until then it shows what its slot last published (zeros before the first);
* it keeps its data until the step that reuses its slot begins
  (``max_concurrency`` steps later), then shows that step's data once published.

With ``STAGEBUF_CHECK=1`` a slot is poisoned when a step begins in it, and a
released slot (the step ``max_concurrency`` back) is poisoned and waits
``STAGEBUF_CHECK_QUARANTINE`` (K) more steps before reuse, so both misuses read
poison (all bits set: int -1) on every tier: reading too early, and reading a kept
tensor after a later step was published (until K steps later). The same holds for
a pool's results, ``max_concurrency`` changed calls later.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import force_tier
from stagebuf import StepStager, UvaBufferPool

HAS_CUDA = torch.cuda.is_available()
CPU_TIERS = ["host", "pageable"]  # PAGEABLE here copies into a CPU tensor standing in for the device
CUDA_TIERS = ["uva", "pinned", "pageable"]
TIERS = CPU_TIERS + (["uva", "pinned"] if HAS_CUDA else [])
SLOTS = 2
STEPS = 7


def _read(t: torch.Tensor) -> list[int]:
    return t.detach().cpu().numpy().tolist()


def program(
    tier: str, monkeypatch: pytest.MonkeyPatch, device: str | None = None
) -> list[tuple[str, int, list[int]]]:
    force_tier(monkeypatch, tier)
    stager = StepStager(device=device, capacity=256, max_concurrency=SLOTS)
    out: list[tuple[str, int, list[int]]] = []
    kept = None
    for s in range(STEPS):
        with stager.step() as st:
            t = st.stage(np.arange(4, dtype=np.int32) + 100 * (s + 1))
            st.stage(np.full(3, s, np.int64))
            out.append(("inside", s, _read(t)))  # misuse: not published yet
            if kept is not None:
                out.append(("kept-inside", s, _read(kept)))  # misuse once its slot came round
        out.append(("after", s, _read(t)))
        if s == 0:
            kept = t
        out.append(("kept", s, _read(kept)))
    if HAS_CUDA:
        torch.cuda.synchronize()
    return out


def model(check: bool, k: int = 16) -> list[tuple[str, int, list[int]]]:
    poison = [-1] * 4
    size = SLOTS + (k if check else 0)  # physical slots: the quarantine's K more in check mode
    published = [[0] * 4 for _ in range(size)]  # what each slot's device side shows
    out: list[tuple[str, int, list[int]]] = []
    for s in range(STEPS):
        slot = s % size
        if check:
            published[slot] = poison
            if s >= SLOTS:
                published[(slot - SLOTS) % size] = poison  # released: the step SLOTS back
        data = [100 * (s + 1) + i for i in range(4)]
        out.append(("inside", s, list(published[slot])))
        if s > 0:
            out.append(("kept-inside", s, list(published[0])))
        published[slot] = data
        out.append(("after", s, data))
        out.append(("kept", s, list(published[0])))
    return out


def pool_program(
    tier: str, monkeypatch: pytest.MonkeyPatch, device: str | None
) -> list[tuple[int, list[int]]]:
    """A pool's first result, kept and read after every later call (each with new values)."""
    force_tier(monkeypatch, tier)
    pool = UvaBufferPool(4, torch.int32, max_concurrency=SLOTS, device=device)
    kept = pool.copy_to_uva(np.arange(4, dtype=np.int32) + 100)
    out = []
    for c in range(1, STEPS):
        pool.copy_to_uva(np.arange(4, dtype=np.int32) + 100 * (c + 1))
        out.append((c, _read(kept)))
    return out


def pool_model(check: bool, k: int = 16) -> list[tuple[int, list[int]]]:
    size = SLOTS + (k if check else 0)
    published = [[0] * 4 for _ in range(size)]
    published[0] = [100 + i for i in range(4)]
    out = []
    for c in range(1, STEPS):
        slot = c % size
        if check and c >= SLOTS:
            published[(slot - SLOTS) % size] = [-1] * 4
        published[slot] = [100 * (c + 1) + i for i in range(4)]
        out.append((c, list(published[0])))
    return out


MODES = [
    pytest.param(None, id="plain"),
    pytest.param(16, id="STAGEBUF_CHECK=1"),
    pytest.param(0, id="STAGEBUF_CHECK=1-K=0"),
    pytest.param(1, id="STAGEBUF_CHECK=1-K=1"),
]


@pytest.mark.parametrize("k", MODES)
@pytest.mark.parametrize(
    ("tiers", "device"),
    [
        pytest.param(CPU_TIERS, "cpu", id="cpu"),
        pytest.param(CUDA_TIERS, "cuda", id="cuda", marks=pytest.mark.gpu),
    ],
)
def test_every_tier_observes_the_same_contract(monkeypatch, tiers, device, k):
    if device == "cuda" and not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    check = k is not None
    if check:
        monkeypatch.setenv("STAGEBUF_CHECK", "1")
        if k != 16:
            monkeypatch.setenv("STAGEBUF_CHECK_QUARANTINE", str(k))
    want, want_pool = model(check, k or 0), pool_model(check, k or 0)
    for tier in tiers:
        got = program(tier, monkeypatch, device)
        assert got == want, f"tier {tier} differs from the contract"
        assert pool_program(tier, monkeypatch, device) == want_pool, f"tier {tier}: the pool differs"


@pytest.mark.parametrize("tier", TIERS)
def test_static_stager_keeps_one_address_and_publishes_at_exit(monkeypatch, tier):
    force_tier(monkeypatch, tier)
    stager = StepStager(capacity=256, static=True)
    ptrs, seen = set(), []
    for s in range(5):
        a = np.arange(6, dtype=np.int64) * (s + 2)
        with stager.step() as st:
            t = st.stage(a)
        ptrs.add(t.data_ptr())
        seen.append((_read(t), a.tolist()))
    assert len(ptrs) == 1
    for got, want in seen:
        assert got == want
    with stager.step() as st, pytest.raises(RuntimeError, match="static arena"):
        st.stage(np.zeros(1024, np.int64))
