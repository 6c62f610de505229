#!/usr/bin/env python3
"""A decode-loop workload per process, for many-process runs under torchrun.

Each process stages an inference engine's per-step inputs with its own stagebuf
objects on its own device, lets the device consume them asynchronously (the
host runs ahead, so the slot guards are exercised), and checks every step's
result against a numpy model at the end. Rank 0 gathers every rank's results
(over gloo: works for two processes sharing one GPU, where NCCL would not) and
writes a JSON summary.

    torchrun --standalone --nproc-per-node 2 scripts/mp_decode.py --out DIR
    torchrun ... scripts/mp_decode.py --shared-gpu      # both processes on cuda:0
    torchrun ... scripts/mp_decode.py --device cpu      # CPU tiers (HOST, PAGEABLE)

Run from the checkout root with ``PYTHONPATH=src:.`` (stagebuf from the tree, without installing;
``scripts/gpu_reliability.sh`` and ``tests/faults/test_multiprocess.py`` set it), or with stagebuf
installed.

Devices: one GPU per process (cuda:LOCAL_RANK) where there are at least as many
GPUs as processes on the node, else every process on cuda:0 (``--shared-gpu``
forces that). Per tier it runs: a StepStager (four arrays per step), a
UvaBufferPool (a prompt chunk of varying length, crossing growth), a
UvaBackedTensor (sequence lengths), a FusedStagedWriter over two
StagedWriteTensors (the block table and a per-request counter) and a
DeviceParamTable (sampling parameters). Exit status 0 only when every rank of
every tier matched.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import stagebuf
from stagebuf import (
    DeviceParamTable,
    FusedStagedWriter,
    StagedWriteTensor,
    StepStager,
    TierUnavailableError,
    UvaBackedTensor,
    UvaBufferPool,
)

BLOCK = 16  # tokens per KV block


WARMUP_STEPS = 20
"""Steps run before timing starts (their kernels compile): excluded from us_per_step."""


def pick_device(args: argparse.Namespace, local_rank: int, local_world: int) -> tuple[torch.device, str]:
    if args.device == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu"), "cpu"
    n = torch.cuda.device_count()
    if not args.shared_gpu and n >= local_world:
        return torch.device("cuda", local_rank), "one GPU per process"
    return torch.device("cuda", 0), f"{local_world} processes sharing one GPU ({n} visible)"


class Model:
    """The engine's host state, in numpy: what every device tensor must hold."""

    def __init__(self, rng: np.random.Generator, max_reqs: int, max_blocks: int):
        self.rng = rng
        self.max_reqs, self.max_blocks = max_reqs, max_blocks
        self.block_table = np.zeros((max_reqs, max_blocks), np.int32)
        self.counter = np.zeros((max_reqs, 4), np.int32)
        self.seq_lens = np.zeros(max_reqs, np.int32)
        self.temperature = np.zeros(max_reqs, np.float32)
        self.top_k = np.zeros(max_reqs, np.int32)
        self.active: list[int] = []
        self.next_block = 1

    def admit(self, req: int) -> list[tuple[int, int, np.ndarray]]:
        """A new request: a fresh prompt length, its first blocks; returns the block-table edits."""
        plen = int(self.rng.integers(1, BLOCK * 3))
        self.seq_lens[req] = plen
        nblk = (plen + BLOCK - 1) // BLOCK
        blocks = np.arange(self.next_block, self.next_block + nblk, dtype=np.int32)
        self.next_block += nblk
        self.block_table[req, :] = 0
        self.block_table[req, :nblk] = blocks
        self.temperature[req] = self.rng.integers(0, 16) / 8
        self.top_k[req] = self.rng.integers(1, 100)
        self.active.append(req)
        return [(req, 0, np.zeros(self.max_blocks, np.int32)), (req, 0, blocks)]


def run_tier(tier: str, device: torch.device, steps: int, seed: int, busy: int) -> dict[str, Any]:
    os.environ["STAGEBUF_TIER"] = tier
    stagebuf.reset_capabilities()
    try:
        caps = stagebuf.capabilities(device)
    except TierUnavailableError as e:
        return {"tier": tier, "status": "unavailable", "reason": str(e)[:300]}
    rng = np.random.default_rng(seed)
    max_reqs, max_blocks = 64, 64
    m = Model(rng, max_reqs, max_blocks)

    stager = StepStager(device=device, capacity=256, max_concurrency=2)
    pool = UvaBufferPool(8, torch.int64, max_concurrency=2, device=device)
    seq_lens = UvaBackedTensor(max_reqs, torch.int32, max_concurrency=2, device=device)
    block_table = StagedWriteTensor((max_reqs, max_blocks), torch.int32, device)
    counter = StagedWriteTensor((max_reqs, 4), torch.int32, device, uva_instead_of_gpu=True)
    writer = FusedStagedWriter(device, 8)
    params = DeviceParamTable(max_reqs, {"temperature": torch.float32, "top_k": torch.int32}, device)
    objects = {
        "stager": stager.tier.name,
        "pool": pool.tier.name,
        "backed": seq_lens.tier.name,
        "staged_write": block_table.tier.name,
        "param_table": params.tier.name,
    }

    results = torch.zeros(steps, dtype=torch.int64, device=device)
    mismatches = torch.zeros((), dtype=torch.int64, device=device)
    expected: list[int] = []
    devices_ok = True
    busy_a = torch.randn(busy, busy, device=device) if busy and device.type == "cuda" else None
    # the first steps compile kernels (Triton's JIT, ATen's first launches): time the steps after them
    warmup = min(WARMUP_STEPS, steps // 2)
    t0 = time.perf_counter()
    for s in range(steps):
        if s == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
        # host: arrivals, departures, one token per active request
        free = [r for r in range(max_reqs) if r not in m.active]
        for _ in range(int(rng.integers(0, 4))):
            if free and len(m.active) < 48:
                for row, start, vals in m.admit(free.pop(int(rng.integers(0, len(free))))):
                    block_table.stage_write(row, start, vals)
        if m.active and rng.random() < 0.2:
            m.active.remove(m.active[int(rng.integers(0, len(m.active)))])
        if not m.active:
            for row, start, vals in m.admit(free[0]):
                block_table.stage_write(row, start, vals)
        req = np.array(m.active, np.int32)
        pos = m.seq_lens[req].astype(np.int64)  # the new token's position
        for r, p in zip(req.tolist(), pos.tolist(), strict=True):
            if p // BLOCK >= max_blocks:  # a full request leaves
                m.active.remove(r)
                continue
            if p % BLOCK == 0:  # a new block
                m.block_table[r, p // BLOCK] = m.next_block
                block_table.stage_write(r, p // BLOCK, [m.next_block])
                m.next_block += 1
            m.seq_lens[r] = p + 1
            m.counter[r, s % 4] += 1
            counter.stage_write(r, s % 4, [m.counter[r, s % 4]])
        req = np.array(m.active, np.int32)
        pos = m.seq_lens[req].astype(np.int64) - 1
        tok = rng.integers(0, 50_000, req.shape[0]).astype(np.int64)
        slot = m.block_table[req, pos // BLOCK].astype(np.int64) * BLOCK + pos % BLOCK
        chunk = rng.integers(0, 50_000, int(rng.integers(0, 40))).astype(np.int64)
        if rng.random() < 0.1 and m.active:
            r = m.active[int(rng.integers(0, len(m.active)))]
            m.temperature[r] = rng.integers(0, 16) / 8
            m.top_k[r] = rng.integers(1, 100)
        params["temperature"].np[:] = m.temperature
        params["top_k"].np[:] = m.top_k
        seq_lens.np[:] = m.seq_lens

        # stage and publish
        writer.apply([block_table, counter])
        params.sync()
        d_lens = seq_lens.copy_to_uva()
        d_chunk = pool.copy_to_uva(chunk)
        with stager.step() as st:
            d_req = st.stage(req)
            d_pos = st.stage(pos)
            d_tok = st.stage(tok)
            d_slot = st.stage(slot)

        # the device consumes, asynchronously
        if busy_a is not None:
            busy_a = torch.tanh(busy_a @ busy_a * 1e-3)  # keeps the GPU behind the host
        ri = d_req.long()
        blk = block_table.gpu[ri].gather(1, (d_pos // BLOCK).unsqueeze(1)).squeeze(1).long()
        mismatches += (blk * BLOCK + d_pos % BLOCK != d_slot).sum()
        mismatches += (d_lens[ri].long() != d_pos + 1).sum()
        temp8 = (params["temperature"].gpu[ri].double() * 8).round().long()
        results[s] = (
            (d_tok * (d_pos + 1)).sum()
            + (params["top_k"].gpu[ri].long() * ri).sum()
            + temp8.sum()
            + d_chunk.sum()
            + counter.gpu[ri].long().sum()
        )
        stager.mark_consumed()
        expected.append(
            int(
                (tok * (pos + 1)).sum()
                + (m.top_k[req].astype(np.int64) * req).sum()
                + (m.temperature[req].astype(np.float64) * 8).round().astype(np.int64).sum()
                + chunk.sum()
                + m.counter[req].astype(np.int64).sum()
            )
        )
        for t in (d_req, d_pos, d_tok, d_slot, d_chunk, d_lens, block_table.gpu, counter.gpu):
            devices_ok &= t.device == device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t0
    got = results.cpu().numpy()
    bad_steps = [int(i) for i in np.flatnonzero(got != np.array(expected, np.int64))]
    tables_ok = (
        np.array_equal(block_table.gpu.cpu().numpy(), m.block_table)
        and np.array_equal(counter.gpu.cpu().numpy(), m.counter)
        and np.array_equal(params["top_k"].gpu.cpu().numpy(), m.top_k)
    )
    ok = (
        not bad_steps and int(mismatches) == 0 and tables_ok and devices_ok and caps.tier.name == tier.upper()
    )
    return {
        "tier": tier,
        "status": "ok" if ok else "MISMATCH",
        "caps_tier": caps.tier.name,
        "objects": objects,
        "steps": steps,
        "bad_steps": bad_steps[:20],
        "n_bad_steps": len(bad_steps),
        "slot_mismatches": int(mismatches),
        "tables_ok": tables_ok,
        "devices_ok": devices_ok,
        "counter_in_host_memory": counter.in_host_memory,
        "us_per_step": round(elapsed / max(steps - warmup, 1) * 1e6, 1),
        "warmup_steps": warmup,
        "guard_waits": {"stager": stager.stats()["guard_waits"], "pool": pool.stats()["guard_waits"]},
        "transfers": {"stager": stager.stats()["transfers"], "pool": pool.stats()["transfers"]},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument(
        "--tiers",
        default=None,
        help="comma-separated (default: uva,pinned,pageable on CUDA, host,pageable on the CPU)",
    )
    ap.add_argument("--device", choices=["auto", "cpu"], default="auto")
    ap.add_argument("--shared-gpu", action="store_true", help="put every process on cuda:0")
    ap.add_argument(
        "--busy", type=int, default=2048, help="size of the busy matmul per step on CUDA (0: none)"
    )
    ap.add_argument("--out", default=None, help="rank 0 writes mp_decode_summary.json here")
    args = ap.parse_args()

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if world > 1:
        dist.init_process_group("gloo")
    device, mode = pick_device(args, local_rank, local_world)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tiers = (args.tiers or ("uva,pinned,pageable" if device.type == "cuda" else "host,pageable")).split(",")
    mine: dict[str, Any] = {
        "rank": rank,
        "device": str(device),
        "mode": mode,
        "pid": os.getpid(),
        "tiers": [],
    }
    try:
        if device.type == "cuda":
            mine["device_name"] = torch.cuda.get_device_name(device)
        for i, tier in enumerate(tiers):
            seed = 1000 * rank + i
            mine["tiers"].append(run_tier(tier.strip(), device, args.steps, seed=seed, busy=args.busy))
    except Exception:
        mine["error"] = traceback.format_exc()[-3000:]
    everyone: list[Any] = [None] * world
    if world > 1:
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    ok = all(
        "error" not in r
        and all(t["status"] in ("ok", "unavailable") for t in r["tiers"])
        and any(t["status"] == "ok" for t in r["tiers"])
        for r in everyone
    )
    if rank == 0:
        summary = {
            "ok": ok,
            "world_size": world,
            "steps": args.steps,
            "ranks": everyone,
            "distinct_devices": sorted({r["device"] for r in everyone}),
        }
        text = json.dumps(summary, indent=2)
        print(text)
        for r in everyone:
            for t in r["tiers"]:
                print(
                    f"mp_decode: rank {r['rank']} on {r['device']} ({r['mode']}) tier {t['tier']}: "
                    f"{t['status']}"
                    + (
                        f", {t['us_per_step']} us/step, guard waits {t['guard_waits']}"
                        if t["status"] != "unavailable"
                        else f" ({t['reason'][:120]})"
                    )
                )
            if "error" in r:
                print(f"mp_decode: rank {r['rank']} failed:\n{r['error']}")
        print(f"mp_decode: {'PASS' if ok else 'FAIL'}: {world} processes on {summary['distinct_devices']}")
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "mp_decode_summary.json").write_text(text + "\n")
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
