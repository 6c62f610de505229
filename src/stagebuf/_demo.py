"""``stagebuf demo``: stage a few decoding steps and show what moved them."""

from __future__ import annotations

import numpy as np
import torch

from ._probe import capabilities
from ._stager import StepStager
from ._types import DeviceLike


def run(steps: int = 5, batch: int = 8, device: DeviceLike = None) -> int:
    """Stage ``steps`` steps of engine-like inputs; check the device copy. Returns mismatches."""
    caps = capabilities(device)
    stager = StepStager(device=caps.device)
    rng = np.random.default_rng(0)
    mismatches = 0
    for s in range(steps):
        req = rng.permutation(64)[:batch].astype(np.int32)
        pos = rng.integers(0, 4096, batch).astype(np.int64)
        seq = (pos + 1).tolist()
        with stager.step() as step:
            d_req = step.stage(req)
            d_pos = step.stage(pos)
            d_seq = step.stage(seq, dtype=torch.int32)
        # a stand-in consumer: the sums, read back
        got = (int(d_req.sum()), int(d_pos.sum()), int(d_seq.sum()))
        want = (int(req.sum()), int(pos.sum()), int(sum(seq)))
        ok = got == want
        mismatches += not ok
        print(
            f"step {s}: staged 3 arrays of {batch} -> {d_req.device} "
            f"via tier {stager.tier.name}: {'ok' if ok else f'MISMATCH {got} != {want}'}"
        )
    st = stager.stats()
    print(
        f"tier {stager.tier.name}: {st['transfers']} host->device transfers for "
        f"{steps} steps ({st['bytes']} bytes), guard={stager.guard}, "
        f"guard waits {st['guard_waits']}"
    )
    return mismatches
