"""Experiment (not a test): how many torn reads does a run-ahead host cause without the guard?

    PYTHONPATH=src:. python3 scripts/guard_experiment.py [steps]

Run from the checkout root without installing (``PYTHONPATH=src:.`` makes ``stagebuf`` and the bench
package ``benchmarks`` importable). JSON on stdout and in $OUT/guard_experiment.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from benchmarks.runahead import run_ahead  # the run-ahead consumer the GPU tests use

import stagebuf
from stagebuf import StepStager

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
result = {"steps": steps, "sleep_cycles": 200_000, "max_concurrency": 2, "torn_reads": {}}
for tier in ("uva", "pinned", "pageable"):
    os.environ["STAGEBUF_TIER"] = tier
    stagebuf.reset_capabilities()
    for guard in ("off", "wait"):
        st = StepStager(device="cuda", capacity=4096, max_concurrency=2, guard=guard)
        torn = run_ahead(st, steps=steps, sleep_cycles=200_000, seed=1)
        result["torn_reads"][f"{tier}/{guard}"] = {"torn": torn, "guard_waits": st.stats()["guard_waits"]}
        print(tier, guard, torn, st.stats(), flush=True)
result["device"] = torch.cuda.get_device_name()
result["torch"] = torch.__version__
print(json.dumps(result, indent=1))
if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "guard_experiment.json"), "w") as f:
        json.dump(result, f, indent=1)
