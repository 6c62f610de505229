"""stagebuf in one page: an engine's decoding steps, staged to the device and checked.

    .venv/bin/python examples/demo.py [--steps N] [--device DEVICE]

Runs on any machine: stagebuf picks the best tier that works here (UVA, PINNED, PAGEABLE, or HOST
on a CPU-only machine) and says why. Each step, as an inference engine would:

1. new KV-cache blocks go into a per-request block table, a ``StagedWriteTensor`` (staged edits,
   one ``apply_write()`` per step);
2. the step's request indices and positions go to the device through a ``StepStager`` (one
   transfer for both);
3. the device computes the slot mapping from them (``table[req, pos // B] * B + pos % B``), and
   the demo checks it against numpy.

Uses only the public API (``import stagebuf``). Exit status: 0 when every step's device result
matches numpy's, 1 on a mismatch, 2 when a setting (``STAGEBUF_TIER``, ``--device``) cannot work
here (``stagebuf doctor`` explains it).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

import stagebuf

ROWS = 6
"""Requests in flight (block-table rows); every step runs BATCH of them."""
BATCH = 4
BLOCK = 4
"""Tokens per KV-cache block."""
MAX_BLOCKS = 8
"""Blocks per request: a request that would need more finishes, and a new one takes its row."""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--steps", type=int, default=5, help="decoding steps to stage (default: 5)")
    ap.add_argument(
        "--device", default=None, help="target device (default: the current accelerator, else cpu)"
    )
    args = ap.parse_args()
    if args.steps < 1:
        ap.error(f"--steps {args.steps}: allowed values are integers >= 1")
    try:
        caps = stagebuf.capabilities(args.device)
    except stagebuf.SetupError as e:
        print(f"demo: {e}\n(`python -m stagebuf doctor` explains this machine)")
        return 2
    print(f"tier {caps.tier.name} on {caps.device}: {caps.reasons[-1] if caps.reasons else ''}")

    table = stagebuf.StagedWriteTensor((ROWS, MAX_BLOCKS), torch.int32, device=caps.device)
    stager = stagebuf.StepStager(device=caps.device)
    rng = np.random.default_rng(0)
    model = np.zeros((ROWS, MAX_BLOCKS), np.int32)  # what the block table should hold
    seq = rng.integers(1, 3 * BLOCK, ROWS)  # tokens per request, the one of this step included
    blocks = np.zeros(ROWS, np.int64)  # blocks allotted per request
    next_block = 1
    mismatches = 0
    for s in range(args.steps):
        if s:
            seq += 1
        edits = []
        for r in range(ROWS):
            if seq[r] > MAX_BLOCKS * BLOCK:  # finished: a new request (a short prompt) takes the row
                seq[r], blocks[r] = rng.integers(1, 2 * BLOCK), 0
            need = -(-int(seq[r]) // BLOCK)
            if need > blocks[r]:
                ids = list(range(next_block, next_block + need - int(blocks[r])))
                table.stage_write(r, int(blocks[r]), ids)  # cheap: the edit is only recorded here
                model[r, blocks[r] : need] = ids
                edits.append((r, int(blocks[r]), ids))
                next_block += len(ids)
                blocks[r] = need
        table.apply_write()  # every staged edit: one transfer, one launch

        req = rng.permutation(ROWS)[:BATCH].astype(np.int32)
        pos = (seq[req] - 1).astype(np.int64)
        with stager.step() as step:  # leaving the block publishes both arrays, in one transfer
            d_req = step.stage(req)
            d_pos = step.stage(pos)
        slots = table.gpu[d_req.long(), d_pos // BLOCK] * BLOCK + d_pos % BLOCK  # on the device
        got = slots.tolist()
        want = (model[req, pos // BLOCK].astype(np.int64) * BLOCK + pos % BLOCK).tolist()
        ok = got == want
        mismatches += not ok
        print(
            f"step {s}: block-table edits {edits}; requests {req.tolist()} at positions {pos.tolist()} "
            f"-> slots {got}: {'ok' if ok else f'MISMATCH, numpy says {want}'}"
        )
    st = stager.stats()
    print(
        f"tier {stager.tier.name}: {args.steps} steps staged with {st['transfers']} host-to-device transfers "
        f"({st['bytes']} bytes), {args.steps} block-table applies; guard={stager.guard}, "
        f"guard waits {st['guard_waits']}; "
        + ("every device result matches numpy" if not mismatches else f"{mismatches} steps MISMATCHED")
    )
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
