"""The engine workload through stagebuf's vLLM plugin against the direct substitution (H200 run).

    OUT=dir PYTHONPATH=src:. python3 scripts/plugin_engine.py     # needs vLLM's files in .cache/

Prints each setup's identical-inputs result (against vLLM's own layer) and the median buffer work
and host preparation per step, busy GPU, 2 KV groups; writes $OUT/plugin_engine.json.
"""

from __future__ import annotations

import json
import os

import torch
from benchmarks import engine as E


def main() -> None:
    dev = torch.device("cuda")
    r = E.plugin_vs_dropin(dev, ("uva", "pinned", "pageable"), repeats=3)
    for name, mism in r["checks"].items():
        print(f"identical inputs {name:28s} {'yes' if not mism else mism[:3]}")
    for name, m in sorted(r["medians"].items()):
        print(
            f"{name:28s} prep {m['prep_us']:8.1f} us  buffer {m['buffer_us']:8.1f} us  runs", r["runs"][name]
        )
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "plugin_engine.json"), "w") as fh:
            json.dump(r, fh, indent=1)


if __name__ == "__main__":
    main()
