"""What check mode (STAGEBUF_CHECK=1, with its quarantine) costs per step, against plain mode.

Per tier this machine has, host µs per step of two loops, each built once without and once
with check mode, interleaved over rounds (median of rounds):

* ``stager``: a StepStager step staging 8 int32 arrays of 64 values;
* ``pool``: UvaBufferPool.copy_to_uva of 256 changing int64 values.

On a CUDA device a 1 ms sleep kernel per step keeps the device busy (the guard has no
reason to wait with 2 slots plus the quarantine). Run from the checkout:

    PYTHONPATH=src:. python3 scripts/check_cost.py [--steps 400] [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

import stagebuf


def _loops(device: str):
    def stager_loop(steps: int) -> float:
        st = stagebuf.StepStager(device=device, capacity=1 << 14)
        arrays = [np.arange(64, dtype=np.int32) + i for i in range(8)]
        t0 = time.perf_counter()
        for s in range(steps):
            with st.step() as step:
                for a in arrays:
                    step.stage(a)
            if device == "cuda" and s % 8 == 0:
                torch.cuda._sleep(1_000_000)
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / steps * 1e6

    def pool_loop(steps: int) -> float:
        pool = stagebuf.UvaBufferPool(256, torch.int64, device=device)
        xs = [np.arange(256, dtype=np.int64) + i for i in range(4)]
        t0 = time.perf_counter()
        for s in range(steps):
            pool.copy_to_uva(xs[s % 4])
            if device == "cuda" and s % 8 == 0:
                torch.cuda._sleep(1_000_000)
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / steps * 1e6

    return {"stager": stager_loop, "pool": pool_loop}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tiers = ["uva", "pinned", "pageable"] if device == "cuda" else ["host", "pageable"]
    out: dict[str, dict[str, dict[str, float]]] = {}
    for tier in tiers:
        os.environ["STAGEBUF_TIER"] = tier
        stagebuf.reset_capabilities()
        for name, loop in _loops(device).items():
            got: dict[str, list[float]] = {"plain": [], "check": []}
            for _ in range(a.rounds):
                for mode in ("plain", "check"):
                    os.environ["STAGEBUF_CHECK"] = "1" if mode == "check" else "0"
                    got[mode].append(loop(a.steps))
            med = {m: statistics.median(v) for m, v in got.items()}
            out.setdefault(tier, {})[name] = {**med, "ratio": med["check"] / med["plain"]}
            print(
                f"{tier:9s} {name:7s} plain {med['plain']:8.2f} µs/step  check {med['check']:8.2f} µs/step"
                f"  ratio {med['check'] / med['plain']:.2f}"
            )
    os.environ.pop("STAGEBUF_CHECK", None)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": device, "steps": a.steps, "rounds": a.rounds, "results": out}, f, indent=1)


if __name__ == "__main__":
    main()
