"""``python -m benchmarks.ab``: the verdict from known medians, the rotation of turns, and the copies of the
package it loads (separate packages that work)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from benchmarks import ab
from benchmarks.harness import stagebuf_tier, turns

import stagebuf

SRC = Path(stagebuf.__file__).resolve().parent.parent


def test_slower_only_when_every_round_is_beyond_the_controls_spread() -> None:
    # (before, after, control) per round: after 10% and 12% above before, control within 2% of after
    moved = ab.verdict([[100.0, 110.0, 111.0], [100.0, 112.0, 110.0]])
    assert moved["slower"] and not moved["faster"]
    assert moved["noise"] == pytest.approx(abs(110 / 112 - 1))
    assert moved["ratio"] == pytest.approx(np.sqrt(1.10 * 1.12))
    # the same after times, but the same code (control) spreads 18%: not beyond noise
    assert not ab.verdict([[100.0, 110.0, 90.0], [100.0, 112.0, 110.0]])["slower"]
    # one round not above: not slower
    assert not ab.verdict([[100.0, 110.0, 110.0], [100.0, 99.0, 99.0]])["slower"]
    assert ab.verdict([[100.0, 80.0, 80.5], [100.0, 85.0, 85.0]])["faster"]


def test_turns_rotate_and_every_side_runs_every_step() -> None:
    calls: list[tuple[int, int]] = []
    steps = [lambda i, s=s: calls.append((i, s)) for s in range(3)]
    got = turns(steps, torch.device("cpu"), n=4, warmup=2)
    assert len(got) == 3 and all(m >= 0 for m in got)
    for i in range(6):
        order = [s for j, s in calls if j == i]
        assert order == [(i + k) % 3 for k in range(3)]


@pytest.mark.parametrize("source", ["dir", "HEAD"])
def test_a_copy_is_its_own_working_package(tmp_path: Path, source: str) -> None:
    if source == "HEAD" and not (SRC.parent / ".git").exists():
        pytest.skip("needs the git checkout")
    name = f"stagebuf_copy_{source.lower()}"
    try:
        pkg = ab.load_copy(str(SRC) if source == "dir" else source, name, tmp_path)
        assert pkg.__name__ == name and pkg.UvaBufferPool is not stagebuf.UvaBufferPool
        with stagebuf_tier("host", pkg):
            pool = pkg.UvaBufferPool(8, torch.int32, device="cpu")
            src = np.arange(8, dtype=np.int32) * 3
            assert pool.copy_to_uva(src).tolist() == src.tolist()
    finally:
        for m in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[m]
        if str(tmp_path) in sys.path:
            sys.path.remove(str(tmp_path))
