"""The package functions a pool publish and a staged apply call, as DESIGN.md's "Layout" lists them.

    STAGEBUF_TIER=pageable PYTHONPATH=src python3 scripts/path_count.py

Each path runs twice to warm up, then once under ``sys.setprofile``; every function of the
package it enters is listed once, in order of first call (comprehensions and properties too).
CPU device: the tier comes from ``STAGEBUF_TIER`` (``pageable`` exercises the copy path).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import numpy as np
import torch

import stagebuf

PKG = os.path.dirname(stagebuf.__file__) + os.sep
"""The package's own files (wherever the checkout lives: its folder's name may be stagebuf too)."""


def calls(f: Callable[[], Any]) -> list[str]:
    seen: list[str] = []

    def prof(frame: FrameType, event: str, arg: Any) -> None:
        co = frame.f_code
        if event == "call" and co.co_filename.startswith(PKG):
            key = f"{co.co_filename[len(PKG) :]}:{co.co_name}"
            if key not in seen:
                seen.append(key)

    sys.setprofile(prof)
    try:
        f()
    finally:
        sys.setprofile(None)
    return seen


def paths(second: list[int] | None = None) -> dict[str, list[str]]:
    """The package functions each path enters, in order of first call; the apply's second edit is
    ``second`` (default ``[4, 5]``, shorter than the first: edits of mixed lengths)."""
    pool = stagebuf.UvaBufferPool(64, torch.int32, device="cpu")
    x = np.arange(64, dtype=np.int32)
    pool.copy_to_uva(x)
    pool.copy_to_uva(x + 1)
    out = {"pool publish": calls(lambda: pool.copy_to_uva(x + 2))}

    t = stagebuf.StagedWriteTensor((16, 8), torch.int32, device="cpu")

    def stage() -> None:
        t.stage_write(1, 0, [1, 2, 3])
        t.stage_write(2, 1, second or [4, 5])

    for _ in range(2):
        stage()
        t.apply_write()
    stage()
    out["staged apply"] = calls(t.apply_write)
    return out


def modules(seen: list[str]) -> int:
    return len({k.split(":")[0] for k in seen})


def main() -> None:
    for name, seen in paths().items():
        print(f"{name}: {len(seen)} functions in {modules(seen)} modules")
        print("    " + " -> ".join(seen))


if __name__ == "__main__":
    main()
