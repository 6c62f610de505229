"""A host that runs ahead of a slow GPU consumer: the guard's acid test.

Used by the GPU tests (``tests/gpu/test_gpu_stager.py``: guard="wait" must see no torn reads) and by
``scripts/guard_experiment.py`` (guard="off", to count how many it sees). It lives in the bench package
because both import it from the checkout root (``from benchmarks.runahead import run_ahead``).
"""

from __future__ import annotations

import numpy as np
import torch

from stagebuf import StepStager


def run_ahead(stager: StepStager, steps: int, sleep_cycles: int, n: int = 256, seed: int = 0) -> int:
    """Stage ``steps`` steps while a slow consumer reads them; return the torn reads.

    Each step stages a random int32 array of ``n``; the consumer first sleeps on the device (so the host can
    run ahead by more steps than there are slots), then folds the staged data into a per-step weighted
    checksum on the device. A step whose device checksum differs from the one numpy computes on the host is a
    torn read.
    """
    dev = stager.device
    rng = np.random.default_rng(seed)
    sums = torch.zeros(steps, dtype=torch.int64, device=dev)
    weights = torch.arange(1, n + 1, dtype=torch.int64, device=dev)
    w = np.arange(1, n + 1, dtype=np.int64)
    expect = np.empty(steps, dtype=np.int64)
    for s in range(steps):
        a = rng.integers(0, 1 << 20, n).astype(np.int32)
        expect[s] = int((a.astype(np.int64) * w).sum())
        with stager.step() as step:
            t = step.stage(a)
        if dev.type == "cuda":
            torch.cuda._sleep(sleep_cycles)
        sums[s] = (t.to(torch.int64) * weights).sum()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return int((sums.cpu().numpy() != expect).sum())
