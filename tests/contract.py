"""The contract program of ``tests/unit/test_contract.py``, shared with the toy tier's test
(``tests/unit/test_toy_tier.py``): a stager's and a pool's program, run under a forced tier,
and an independent model of what every tier must observe (the docstring there says which).
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


def read(t: torch.Tensor) -> list[int]:
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
            out.append(("inside", s, read(t)))  # misuse: not published yet
            if kept is not None:
                out.append(("kept-inside", s, read(kept)))  # misuse once its slot came round
        out.append(("after", s, read(t)))
        if s == 0:
            kept = t
        out.append(("kept", s, read(kept)))
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
        out.append((c, read(kept)))
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


def set_check(monkeypatch: pytest.MonkeyPatch, k: int | None) -> bool:
    """Check mode with quarantine ``k`` (None: plain mode); whether it is on."""
    if k is None:
        return False
    monkeypatch.setenv("STAGEBUF_CHECK", "1")
    if k != 16:
        monkeypatch.setenv("STAGEBUF_CHECK_QUARANTINE", str(k))
    return True


def check_tier(tier: str, monkeypatch: pytest.MonkeyPatch, device: str | None, k: int | None) -> None:
    """Both programs on ``tier`` observe what the models say, in check mode with quarantine ``k`` (None:
    plain mode)."""
    check = set_check(monkeypatch, k)
    want = model(check, k or 0)
    assert program(tier, monkeypatch, device) == want, f"tier {tier} differs from the contract"
    want_pool = pool_model(check, k or 0)
    assert pool_program(tier, monkeypatch, device) == want_pool, f"tier {tier}: the pool differs"
