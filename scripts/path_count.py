"""The package functions a pool publish and a staged apply call, as DESIGN.md's "Layout" lists them.

    STAGEBUF_TIER=pageable PYTHONPATH=src python3 scripts/path_count.py

Each path runs twice to warm up, then once under ``sys.setprofile``; every function of the
package it enters is listed once, in order of first call (comprehensions and properties too).
CPU device: the tier comes from ``STAGEBUF_TIER`` (``pageable`` exercises the copy path).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import numpy as np
import torch

import stagebuf


def calls(f: Callable[[], Any]) -> list[str]:
    seen: list[str] = []

    def prof(frame: FrameType, event: str, arg: Any) -> None:
        co = frame.f_code
        if event == "call" and "stagebuf" in co.co_filename:
            key = f"{co.co_filename.split('stagebuf/')[-1]}:{co.co_name}"
            if key not in seen:
                seen.append(key)

    sys.setprofile(prof)
    try:
        f()
    finally:
        sys.setprofile(None)
    return seen


def report(name: str, seen: list[str]) -> None:
    modules = {k.split(":")[0] for k in seen}
    print(f"{name}: {len(seen)} functions in {len(modules)} modules")
    print("    " + " -> ".join(seen))


def main() -> None:
    pool = stagebuf.UvaBufferPool(64, torch.int32, device="cpu")
    x = np.arange(64, dtype=np.int32)
    pool.copy_to_uva(x)
    pool.copy_to_uva(x + 1)
    report("pool publish", calls(lambda: pool.copy_to_uva(x + 2)))

    t = stagebuf.StagedWriteTensor((16, 8), torch.int32, device="cpu")

    def stage() -> None:
        t.stage_write(1, 0, [1, 2, 3])
        t.stage_write(2, 1, [4, 5])

    for _ in range(2):
        stage()
        t.apply_write()
    stage()
    report("staged apply", calls(t.apply_write))


if __name__ == "__main__":
    main()
