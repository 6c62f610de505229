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

from contract import CPU_TIERS, CUDA_TIERS, HAS_CUDA, TIERS, check_tier, read
from helpers import force_tier
from stagebuf import StepStager

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
    for tier in tiers:
        check_tier(tier, monkeypatch, device, k)


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
        seen.append((read(t), a.tolist()))
    assert len(ptrs) == 1
    for got, want in seen:
        assert got == want
    with stager.step() as st, pytest.raises(RuntimeError, match="static arena"):
        st.stage(np.zeros(1024, np.int64))
