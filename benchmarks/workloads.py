"""The strategies and workloads that ``python -m benchmarks`` times.

Three workloads, each a list of :class:`Strategy`; a strategy builds a
:class:`Case` (one step to time, and a ``finish`` that checks the device data
after timing). Baselines reproduce what engines do today and are written here;
the stagebuf strategies use the public classes on a forced tier.

* micro: K int32 arrays of N per step, consumed by one op reading them all.
* decode: a simulated serving loop (requests arrive and finish) staging the
  per-request arrays, appending block ids to a block table and computing the
  slot mapping on the device, checked against a numpy model every few steps.
* writes: a sweep over E edits of L elements each (distinct rows), staged and
  applied once per step to a 2-D device table.

The ``mrv2_*`` baselines are vLLM's own Model Runner V2 classes (``vllm_mrv2.NEWEST``'s)
(``baselines``, loaded by ``vllm_mrv2``): ``mrv2_uva_pool`` (its UvaBufferPool on
pinned memory), ``mrv2_fallback_per_array`` (the same pool on a machine without
pinned memory: its NonUvaBuffer fallback), ``mrv2_staged_write`` (its
StagedWriteTensor) and ``mrv2_decode`` (the decode loop built from both); vLLM V1's
own ``CpuGpuBuffer`` is ``pinned_buffer_per_array``.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from stagebuf import StepStager, Tier, UvaBufferPool

from . import vllm_mrv2
from .baselines import (
    MRV2_SLOTS,
    PoolMaker,
    cpu_gpu_buffer,
    mrv2_fallback_pool,
    mrv2_staged_write,
    mrv2_uva_pool,
    uva_pool_cached,
)

_V = vllm_mrv2.NEWEST.rpartition(".")[0]
"""The peer's vLLM release in strategy descriptions, as "0.34"."""

# --- shared pieces ------------------------------------------------------------------------------


@dataclass
class Env:
    """What a strategy is built for: the device and the workload parameters."""

    device: torch.device
    cuda: bool
    pin_memory: bool
    uva: bool
    k: int = 8
    batch: int = 256
    block_size: int = 16
    check_every: int = 50
    decode_steps: int = 500
    seed: int = 0


EXCLUDED_S = [0.0]
"""Seconds that timed steps spent checking answers; ``bench.time_repeat`` subtracts them.

The decode loop checks the device result every ``check_every`` steps (a device
round trip and a numpy comparison). That work is the bench's, not the
strategy's, and the floor has none of it, so it is kept out of every timing.
"""


@dataclass
class Case:
    """One step to time, and a check (plus extra facts) to run after timing."""

    step: Callable[[], object]
    finish: Callable[[], dict[str, Any]] = field(default=lambda: {})
    min_warmup: int = 0
    """Steps to run before timing, at least (the decode loop's first steps are all prefill)."""
    fixed_iters: int | None = None
    """Steps per repeat, when every strategy must time the same steps (the decode loop)."""


@dataclass(frozen=True)
class Strategy:
    name: str
    label: str
    kind: str
    """'baseline', 'stagebuf' or 'floor'."""
    build: Callable[[Env, Any], Case]
    """(env, size): size is an int (micro N, decode batch) or a :class:`WriteCell` (writes)."""
    tier: Tier | None = None
    """The forced stagebuf tier (None: built with STAGEBUF_TIER unset)."""
    needs: tuple[str, ...] = ()
    """Subset of 'cuda', 'pinned', 'uva', 'triton', 'vllm' (vLLM's files, fetched): what the
    strategy needs from the machine."""


class BenchCheckError(RuntimeError):
    """The device result of a strategy differs from the host model: the run fails."""


def _sources(env: Env, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(env.seed * 7919 + n)
    return [rng.integers(0, 1 << 20, n, dtype=np.int32) for _ in range(env.k)]


def _verify_arrays(name: str, got: Sequence[torch.Tensor], want: Sequence[np.ndarray]) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        host = g.cpu().numpy()
        if host.shape != w.shape or not np.array_equal(host, w):
            bad = int(np.count_nonzero(host != w)) if host.shape == w.shape else -1
            raise BenchCheckError(
                f"{name}: array {i} on the device differs from the host source "
                f"({bad} of {w.size} elements differ; shape {host.shape} vs {w.shape})"
            )


def _pinned_zeros(shape: int | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, pin_memory=True)


# --- workload 1: micro --------------------------------------------------------------------------


def consume(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The micro consumer: one op reading every staged array (a concatenation), then a sum."""
    return torch.cat(list(ts)).sum()


def _micro_case(name: str, srcs: list[np.ndarray], run: Callable[[], list[torch.Tensor]]) -> Case:
    def step() -> object:
        ts = run()
        consume(ts)
        return ts

    def finish() -> dict[str, Any]:
        ts = run()
        consume(ts)
        _verify_arrays(name, ts, srcs)
        return {"verified": True}

    return Case(step, finish)


def micro_list_tensor(env: Env, n: int) -> Case:
    srcs = _sources(env, n)
    lists = [s.tolist() for s in srcs]
    dev = env.device
    return _micro_case(
        "list_tensor", srcs, lambda: [torch.tensor(x, dtype=torch.int32, device=dev) for x in lists]
    )


def micro_pinned_tensor(env: Env, n: int) -> Case:
    srcs = _sources(env, n)
    lists = [s.tolist() for s in srcs]
    dev = env.device
    return _micro_case(
        "pinned_tensor_per_array",
        srcs,
        lambda: [
            torch.tensor(x, dtype=torch.int32, pin_memory=True).to(dev, non_blocking=True) for x in lists
        ],
    )


def micro_pinned_buffer(env: Env, n: int) -> Case:
    srcs = _sources(env, n)
    bufs = [cpu_gpu_buffer(n, torch.int32, env.device) for _ in srcs]

    def run() -> list[torch.Tensor]:
        out = []
        for b, s in zip(bufs, srcs):
            b.np[:n] = s
            out.append(b.copy_to_gpu(n))
        return out

    return _micro_case("pinned_buffer_per_array", srcs, run)


def micro_baseline_pool(make: PoolMaker, name: str) -> Callable[[Env, int], Case]:
    def build(env: Env, n: int) -> Case:
        srcs = _sources(env, n)
        pools = [make(n, torch.int32, env.device) for _ in srcs]
        return _micro_case(name, srcs, lambda: [p.copy_to_uva(s) for p, s in zip(pools, srcs)])

    return build


def micro_pool(guard: str = "auto") -> Callable[[Env, int], Case]:
    def build(env: Env, n: int) -> Case:
        srcs = _sources(env, n)
        pools = [UvaBufferPool(n, torch.int32, device=env.device, guard=guard) for _ in srcs]
        case = _micro_case("pool", srcs, lambda: [p.copy_to_uva(s) for p, s in zip(pools, srcs)])
        return _with_stats(
            case,
            lambda: {"tier": pools[0].tier.name, "guard_waits": sum(p.stats()["guard_waits"] for p in pools)},
        )

    return build


def _capacity_for(nbytes: int) -> int:
    return max(1 << 20, 1 << (max(nbytes, 1) - 1).bit_length())


def micro_stager(guard: str = "auto", static: bool = False) -> Callable[[Env, int], Case]:
    def build(env: Env, n: int) -> Case:
        srcs = _sources(env, n)
        stager = StepStager(
            device=env.device, capacity=_capacity_for(env.k * (n * 4 + 16)), guard=guard, static=static
        )

        def run() -> list[torch.Tensor]:
            with stager.step() as s:
                return [s.stage(x) for x in srcs]

        case = _micro_case("stager", srcs, run)
        return _with_stats(case, lambda: {"tier": stager.tier.name, "guard": stager.guard, **stager.stats()})

    return build


def micro_floor(env: Env, n: int) -> Case:
    srcs = _sources(env, n)
    ts = [torch.from_numpy(s).to(env.device) for s in srcs]
    return _micro_case("floor", srcs, lambda: ts)


def _with_stats(case: Case, stats: Callable[[], dict[str, Any]]) -> Case:
    inner = case.finish
    return Case(case.step, lambda: {**inner(), **stats()})


# --- workload 2: decode loop --------------------------------------------------------------------


@dataclass
class DecodeStep:
    """What the scheduler hands the model runner for one step."""

    idx: np.ndarray
    """int32 [B]: each batch entry's row in the request state (and the block table)."""
    pos: np.ndarray
    """int64 [T]: each scheduled token's position."""
    seq: np.ndarray
    """int32 [B]: sequence lengths after this step."""
    qsl: np.ndarray
    """int32 [B+1]: query-start offsets (the cumulative tokens per request)."""
    edits: list[tuple[int, int, list[int]]]
    """Block-table appends: (row, first column, block ids)."""


DECODE_WARMUP = 64
"""Decode steps before timing: the first step prefills every request at once."""


class DecodeSim:
    """A serving loop's scheduler state, and the numpy model of the block table.

    ``batch`` requests run at once; one that reaches its target length finishes
    and a new one arrives in its place, on a free row of the request state
    (rows come in pairs r, r + batch: exactly one of each pair is in use). A new
    request is prefilled in one step (1..max_prompt tokens), then decodes one
    token per step. Each step appends the blocks that the new tokens need.
    """

    def __init__(
        self, batch: int, block_size: int = 16, max_prompt: int = 64, max_len: int = 1024, seed: int = 0
    ):
        self.batch = batch
        self.block_size = block_size
        self.max_prompt = max_prompt
        self.max_blocks = -(-max_len // block_size)
        self.rows_total = 2 * batch
        self.table = np.zeros((self.rows_total, self.max_blocks), np.int32)
        self.rows = np.arange(batch, dtype=np.int32) + batch
        self.seq = np.zeros(batch, np.int32)
        self.target = np.zeros(batch, np.int32)
        self.qlen = np.zeros(batch, np.int32)
        self.nblk = np.zeros(batch, np.int32)
        self.num_blocks = 1 << 22
        self.next_block = 0
        rng = np.random.default_rng(seed)
        self._prompts = rng.integers(1, max_prompt + 1, 1 << 14).astype(np.int32)
        self._gens = rng.integers(16, max_len - max_prompt + 1, 1 << 14).astype(np.int32)
        self._draw = 0
        self._ar = np.arange(batch * max_prompt + 1, dtype=np.int64)
        self._cols = np.arange(self.max_blocks, dtype=np.int32)
        self.step_no = 0
        self.tokens = 0

    @property
    def max_tokens(self) -> int:
        return self.batch * self.max_prompt

    def advance(self) -> DecodeStep:
        B, bs = self.batch, self.block_size
        fin = self.seq >= self.target
        nf = int(np.count_nonzero(fin))
        self.qlen.fill(1)
        if nf:
            self.rows[fin] = (self.rows[fin] + B) % self.rows_total
            take = np.arange(self._draw, self._draw + nf)
            self._draw += nf
            p = np.take(self._prompts, take, mode="wrap")
            self.seq[fin] = 0
            self.nblk[fin] = 0
            self.qlen[fin] = p
            self.target[fin] = p + np.take(self._gens, take, mode="wrap")
        self.seq += self.qlen
        need = (self.seq + (bs - 1)) // bs
        new = need - self.nblk
        at = np.flatnonzero(new)
        edits: list[tuple[int, int, list[int]]] = []
        if at.size:
            counts = new[at]
            total = int(counts.sum())
            ids = (1 + (self.next_block + self._ar[:total]) % (self.num_blocks - 1)).astype(np.int32)
            self.next_block += total
            erow = self.rows[at]
            estart = self.nblk[at]
            first = np.cumsum(counts) - counts
            cols = np.repeat(estart, counts) + (self._ar[:total] - np.repeat(first, counts))
            self.table[np.repeat(erow, counts), cols] = ids
            self.nblk[at] = need[at]
            flat = ids.tolist()
            bounds = first.tolist() + [total]
            parts = [flat[bounds[i] : bounds[i + 1]] for i in range(len(bounds) - 1)]
            edits = list(zip(erow.tolist(), estart.tolist(), parts))
        qsl = np.zeros(B + 1, np.int32)
        np.cumsum(self.qlen, out=qsl[1:])
        T = int(qsl[-1])
        start = (self.seq - self.qlen).astype(np.int64) - qsl[:-1]
        pos = np.repeat(start, self.qlen) + self._ar[:T]
        self.step_no += 1
        self.tokens += T
        return DecodeStep(self.rows.copy(), pos, self.seq.copy(), qsl, edits)

    def reference_slots(self, st: DecodeStep) -> np.ndarray:
        T = st.pos.shape[0]
        b = np.searchsorted(st.qsl[1:], self._ar[:T], side="right")
        blk = self.table[st.idx[b], st.pos // self.block_size].astype(np.int64)
        slots: np.ndarray = blk * self.block_size + st.pos % self.block_size
        return slots

    def check(self, name: str, st: DecodeStep, slots: torch.Tensor, table: torch.Tensor) -> None:
        """Compare the device slot mapping and the live block-table cells with the model."""
        got = slots.cpu().numpy()
        want = self.reference_slots(st)
        if got.shape != want.shape or not np.array_equal(got, want):
            if got.shape != want.shape:
                detail = f"shape {got.shape} vs {want.shape}"
            else:
                bad = np.flatnonzero(got != want)
                i = int(bad[0])
                detail = f"{bad.size} of {want.size} tokens differ; token {i}: got {got[i]}, want {want[i]}"
            raise BenchCheckError(
                f"decode loop [{name}] step {self.step_no}: the device slot mapping "
                f"differs from the host model: {detail}"
            )
        dev = table.cpu().numpy()[st.idx]
        live = self._cols[None, :] < self.nblk[:, None]
        host = self.table[st.idx]
        if not np.array_equal(dev[live], host[live]):
            n_bad = int(np.count_nonzero(dev[live] != host[live]))
            raise BenchCheckError(
                f"decode loop [{name}] step {self.step_no}: {n_bad} live block-table "
                "cells on the device differ from the host model"
            )


def slot_mapping(
    idx: torch.Tensor,
    pos: torch.Tensor,
    seq: torch.Tensor,
    qsl: torch.Tensor,
    table: torch.Tensor,
    tok: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Each token's KV-cache slot: block_table[row, pos // bs] * bs + pos % bs (-1 past seq_len)."""
    T = pos.shape[0]
    b = torch.searchsorted(qsl[1:], tok[:T], right=True)
    blk = table[idx[b], pos // block_size]
    slot = blk.to(torch.int64) * block_size + pos % block_size
    return torch.where(pos < seq[b], slot, -1)


class TableOps(NamedTuple):
    """How a strategy edits the block table: write per edit, apply per step, the device tensor."""

    write: Callable[[int, int, list[int]], None]
    apply: Callable[[], None]
    target: Callable[[], torch.Tensor]


class RowCopyTable:
    """Engine-style block table: a host copy edited in place, one indexed row copy per edit."""

    def __init__(self, shape: tuple[int, int], device: torch.device, pinned: bool):
        self.cpu = _pinned_zeros(shape, torch.int32) if pinned else torch.zeros(shape, dtype=torch.int32)
        self.np = self.cpu.numpy()
        self.dev = torch.zeros(shape, dtype=torch.int32, device=device)
        self.non_blocking = pinned

    def write(self, row: int, start: int, values: list[int]) -> None:
        end = start + len(values)
        self.np[row, start:end] = values
        self.dev[row, start:end].copy_(self.cpu[row, start:end], non_blocking=self.non_blocking)

    def ops(self) -> TableOps:
        return TableOps(self.write, lambda: None, lambda: self.dev)


def staged_write_tensor(shape: tuple[int, int], device: torch.device, kernel: str | None = None) -> Any:
    """A StagedWriteTensor on the tier STAGEBUF_TIER forces; ``kernel`` forces its apply kernel."""
    from stagebuf import StagedWriteTensor
    from stagebuf._tiers.settings import ENV_KERNEL

    if kernel is None:
        return StagedWriteTensor(shape, torch.int32, device)
    old = os.environ.get(ENV_KERNEL)
    os.environ[ENV_KERNEL] = kernel
    try:
        return StagedWriteTensor(shape, torch.int32, device)
    finally:
        if old is None:
            os.environ.pop(ENV_KERNEL, None)
        else:
            os.environ[ENV_KERNEL] = old


def staged_ops(sw: Any) -> TableOps:
    return TableOps(sw.stage_write, sw.apply_write, lambda: sw.gpu)


Stage4 = Callable[[DecodeStep], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


def _decode_case(
    env: Env,
    batch: int,
    name: str,
    make_stage: Callable[[DecodeSim], Stage4],
    make_table: Callable[[DecodeSim], TableOps],
    extra: Callable[[], dict[str, Any]] | None = None,
) -> Case:
    sim = DecodeSim(batch, env.block_size, seed=env.seed)
    stage = make_stage(sim)
    table = make_table(sim)
    tok = torch.arange(sim.max_tokens, dtype=torch.int32, device=env.device)
    bs, every = env.block_size, env.check_every
    checks = [0]

    def step() -> object:
        st = sim.advance()
        d = stage(st)
        write = table.write
        for row, start, values in st.edits:
            write(row, start, values)
        table.apply()
        slots = slot_mapping(*d, table.target(), tok, bs)
        if sim.step_no % every == 0:
            t0 = time.perf_counter()
            sim.check(name, st, slots, table.target())
            EXCLUDED_S[0] += time.perf_counter() - t0
            checks[0] += 1
        return slots

    def finish() -> dict[str, Any]:
        st = sim.advance()
        d = stage(st)
        for row, start, values in st.edits:
            table.write(row, start, values)
        table.apply()
        sim.check(name, st, slot_mapping(*d, table.target(), tok, bs), table.target())
        checks[0] += 1
        return {
            "checks": checks[0],
            "steps": sim.step_no,
            "check_every": every,
            "tokens_per_step": round(sim.tokens / max(sim.step_no, 1), 1),
            **(extra() if extra else {}),
        }

    return Case(step, finish, DECODE_WARMUP, env.decode_steps)


def _per_array(convert: Callable[[np.ndarray], torch.Tensor]) -> Callable[[DecodeSim], Stage4]:
    def make(sim: DecodeSim) -> Stage4:
        return lambda st: (convert(st.idx), convert(st.pos), convert(st.seq), convert(st.qsl))

    return make


def _decode_sizes(sim: DecodeSim) -> tuple[tuple[int, torch.dtype], ...]:
    return (
        (sim.batch, torch.int32),
        (sim.max_tokens, torch.int64),
        (sim.batch, torch.int32),
        (sim.batch + 1, torch.int32),
    )


def _table_shape(sim: DecodeSim) -> tuple[int, int]:
    return (sim.rows_total, sim.max_blocks)


def decode_list_tensor(env: Env, batch: int) -> Case:
    dev = env.device
    return _decode_case(
        env,
        batch,
        "list_tensor",
        _per_array(lambda a: torch.tensor(a, device=dev)),
        lambda sim: RowCopyTable(_table_shape(sim), dev, pinned=False).ops(),
    )


def decode_pinned_tensor(env: Env, batch: int) -> Case:
    dev = env.device
    return _decode_case(
        env,
        batch,
        "pinned_tensor_per_array",
        _per_array(lambda a: torch.from_numpy(a).pin_memory().to(dev, non_blocking=True)),
        lambda sim: RowCopyTable(_table_shape(sim), dev, pinned=True).ops(),
    )


def decode_pinned_buffer(env: Env, batch: int) -> Case:
    dev = env.device

    def make(sim: DecodeSim) -> Stage4:
        bufs = [cpu_gpu_buffer(n, dt, dev) for n, dt in _decode_sizes(sim)]

        def stage(st: DecodeStep) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
            out = []
            for b, a in zip(bufs, (st.idx, st.pos, st.seq, st.qsl)):
                n = a.shape[0]
                b.np[:n] = a
                out.append(b.copy_to_gpu(n))
            return out[0], out[1], out[2], out[3]

        return stage

    return _decode_case(
        env,
        batch,
        "pinned_buffer_per_array",
        make,
        lambda sim: RowCopyTable(_table_shape(sim), dev, pinned=True).ops(),
    )


def _pool_stage(make_pool: PoolMaker, dev: torch.device) -> Callable[[DecodeSim], Stage4]:
    """Each per-step array through its own pool (``copy_to_uva``)."""

    def make(sim: DecodeSim) -> Stage4:
        p = [make_pool(n, dt, dev) for n, dt in _decode_sizes(sim)]
        return lambda st: (
            p[0].copy_to_uva(st.idx),
            p[1].copy_to_uva(st.pos),
            p[2].copy_to_uva(st.seq),
            p[3].copy_to_uva(st.qsl),
        )

    return make


def decode_baseline_pool(make_pool: PoolMaker, name: str, pinned_table: bool) -> Callable[[Env, int], Case]:
    def build(env: Env, batch: int) -> Case:
        dev = env.device
        return _decode_case(
            env,
            batch,
            name,
            _pool_stage(make_pool, dev),
            lambda sim: RowCopyTable(_table_shape(sim), dev, pinned=pinned_table).ops(),
        )

    return build


def decode_mrv2(make_pool: PoolMaker = mrv2_uva_pool) -> Callable[[Env, int], Case]:
    """MRV2's decode step with vLLM's own classes: per-step arrays through its UvaBufferPools,
    block-table appends through its StagedWriteTensor (one stage_write per edit, one apply per step).
    ``make_pool`` lets a CPU test use the fallback pool."""

    def build(env: Env, batch: int) -> Case:
        dev = env.device

        def make_table(sim: DecodeSim) -> TableOps:
            sw = mrv2_staged_write(_table_shape(sim), torch.int32, dev)
            return TableOps(sw.stage_write, sw.apply_write, lambda: sw.gpu)

        return _decode_case(
            env,
            batch,
            "mrv2_decode",
            _pool_stage(make_pool, dev),
            make_table,
            lambda: {"peer": f"vLLM {vllm_mrv2.NEWEST}", "pool_slots": MRV2_SLOTS},
        )

    return build


def decode_stager(env: Env, batch: int) -> Case:
    dev = env.device
    holder: dict[str, Any] = {}

    def make(sim: DecodeSim) -> Stage4:
        stager = holder["stager"] = StepStager(device=dev)

        def stage(st: DecodeStep) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
            with stager.step() as s:
                return s.stage(st.idx), s.stage(st.pos), s.stage(st.seq), s.stage(st.qsl)

        return stage

    def make_table(sim: DecodeSim) -> TableOps:
        sw = holder["table"] = staged_write_tensor(_table_shape(sim), dev)
        return staged_ops(sw)

    def extra() -> dict[str, Any]:
        st, tb = holder["stager"], holder["table"]
        return {
            "tier": st.tier.name,
            "guard": st.guard,
            "stager": st.stats(),
            "staged_write_kernel": getattr(tb, "kernel", None),
            "staged_write": _stats_of(tb),
        }

    return _decode_case(env, batch, "stager", make, make_table, extra)


def _stats_of(obj: Any) -> Any:
    stats = getattr(obj, "stats", None)
    return stats() if callable(stats) else None


def decode_floor(env: Env, batch: int) -> Case:
    """Host bookkeeping and the slot-mapping kernels on device-resident inputs: no staging."""
    dev = env.device
    warm = DecodeSim(batch, env.block_size, seed=env.seed)
    for _ in range(3):
        st0 = warm.advance()
    fixed = tuple(torch.from_numpy(a).to(dev) for a in (st0.idx, st0.pos, st0.seq, st0.qsl))
    table = torch.from_numpy(warm.table).to(dev)
    sim = DecodeSim(batch, env.block_size, seed=env.seed)
    tok = torch.arange(sim.max_tokens, dtype=torch.int32, device=dev)
    bs, every = env.block_size, env.check_every

    def step() -> object:
        sim.advance()
        slots = slot_mapping(fixed[0], fixed[1], fixed[2], fixed[3], table, tok, bs)
        if sim.step_no % every == 0:
            t0 = time.perf_counter()
            slots.cpu()  # the same device round trip as a check (kept out of the timing too)
            EXCLUDED_S[0] += time.perf_counter() - t0
        return slots

    def finish() -> dict[str, Any]:
        got = slot_mapping(fixed[0], fixed[1], fixed[2], fixed[3], table, tok, bs).cpu().numpy()
        if not np.array_equal(got, warm.reference_slots(st0)):
            raise BenchCheckError(
                "decode loop [floor]: the slot-mapping kernels disagree with the host model"
            )
        return {"checks": 0, "steps": sim.step_no, "check_every": every}

    return Case(step, finish, DECODE_WARMUP, env.decode_steps)


# --- workload 3: staged writes ------------------------------------------------------------------

WRITE_MIN_ROWS = 4096
WRITE_MIN_COLS = 64


@dataclass(frozen=True, order=True)
class WriteCell:
    """One cell of the writes sweep: E edits of L elements each, on distinct rows; key ``"ExL"``."""

    edits: int
    length: int

    def __str__(self) -> str:
        return f"{self.edits}x{self.length}"

    @classmethod
    def parse(cls, key: str) -> WriteCell:
        """``"256x8"``; a plain ``"256"`` (reports from before the sweep: one-element edits) is 256x1."""
        e, _, ln = key.partition("x")
        return cls(int(e), int(ln or 1))


def write_shape(cell: WriteCell) -> tuple[int, int]:
    """The table of a cell: max(4096, E) rows (edits go to distinct rows) and max(64, 2 L) columns,
    so that an edit's start has at least L + 1 choices (0 .. cols - L)."""
    return (max(WRITE_MIN_ROWS, cell.edits), max(WRITE_MIN_COLS, 2 * cell.length))


@dataclass
class WriteSets:
    """Two sets of the same E edits (rows, starts) with different values, applied alternately."""

    rows: np.ndarray
    """int64 [E], distinct."""
    starts: np.ndarray
    """int64 [E], each in [0, cols - L]."""
    values: list[np.ndarray]
    """Per set: int32 [E, L]."""
    lists: list[list[tuple[int, int, list[int]]]]
    """Per set, the same edits as Python ints and lists (what per-edit staging gets)."""
    want: np.ndarray
    """The table after the second set."""


def write_sets(env: Env, cell: WriteCell) -> WriteSets:
    shape = write_shape(cell)
    e, ln = cell.edits, cell.length
    rng = np.random.default_rng((env.seed, e, ln))
    rows = rng.permutation(shape[0])[:e].astype(np.int64)
    starts = rng.integers(0, shape[1] - ln + 1, e).astype(np.int64)
    want = np.zeros(shape, np.int32)
    values, lists = [], []
    cols = starts[:, None] + np.arange(ln)[None, :]
    for _ in range(2):
        vals = rng.integers(1, 1 << 30, (e, ln)).astype(np.int32)
        values.append(vals)
        lists.append(list(zip(rows.tolist(), starts.tolist(), vals.tolist())))
        want[rows[:, None], cols] = vals
    return WriteSets(rows, starts, values, lists, want)


def _writes_case(
    name: str,
    cell: WriteCell,
    ws: WriteSets,
    stage: Callable[[int], None],
    apply: Callable[[], None],
    target: Callable[[], torch.Tensor],
    extra: Callable[[], dict[str, Any]] | None = None,
) -> Case:
    """Each step stages set 0 or set 1 (alternately) with ``stage(k)``, then applies once."""
    state = [0]

    def step() -> object:
        k = state[0] & 1
        state[0] += 1
        stage(k)
        apply()
        return None

    def finish() -> dict[str, Any]:
        if state[0] & 1:  # end on the second set, whose values ``want`` holds
            step()
        got = target().cpu().numpy()
        if not np.array_equal(got, ws.want):
            bad = int(np.count_nonzero(got != ws.want))
            raise BenchCheckError(
                f"staged writes [{name}] E={cell.edits} L={cell.length}: {bad} table "
                f"cells differ from the host model after {state[0]} applies"
            )
        return {
            "edits": cell.edits,
            "length": cell.length,
            "applies": state[0],
            "verified": True,
            **(extra() if extra else {}),
        }

    return Case(step, finish)


def _per_edit(write: Callable[[int, int, list[int]], None], ws: WriteSets) -> Callable[[int], None]:
    """Stage set k with one ``write(row, start, values)`` per edit, from Python lists."""

    def stage(k: int) -> None:
        for row, start, values in ws.lists[k]:
            write(row, start, values)

    return stage


def writes_row_copy(env: Env, cell: WriteCell) -> Case:
    ws = write_sets(env, cell)
    t = RowCopyTable(write_shape(cell), env.device, pinned=env.pin_memory and env.cuda)
    return _writes_case(
        "row_copy_per_edit",
        cell,
        ws,
        _per_edit(t.write, ws),
        lambda: None,
        lambda: t.dev,
        lambda: {"host_memory": "pinned" if t.non_blocking else "pageable"},
    )


def writes_staged(env: Env, cell: WriteCell, kernel: str | None = None) -> Case:
    """StagedWriteTensor: one ``stage_write(row, start, list)`` per edit, then ``apply_write()``."""
    ws = write_sets(env, cell)
    sw = staged_write_tensor(write_shape(cell), env.device, kernel)
    return _writes_case(
        "staged_write",
        cell,
        ws,
        _per_edit(sw.stage_write, ws),
        sw.apply_write,
        lambda: sw.gpu,
        lambda: _sw_facts(sw),
    )


def _sw_facts(sw: Any) -> dict[str, Any]:
    return {"kernel": getattr(sw, "kernel", None), "stats": _stats_of(sw)}


def writes_staged_batched(env: Env, cell: WriteCell, kernel: str | None = None) -> Case:
    """StagedWriteTensor: one ``stage_writes(rows, starts, values[E, L])`` from numpy, then apply."""
    ws = write_sets(env, cell)
    sw = staged_write_tensor(write_shape(cell), env.device, kernel)
    rows, starts, values = ws.rows, ws.starts, ws.values

    def stage(k: int) -> None:
        sw.stage_writes(rows, starts, values[k])

    return _writes_case(
        "staged_writes", cell, ws, stage, sw.apply_write, lambda: sw.gpu, lambda: _sw_facts(sw)
    )


def writes_mrv2() -> Callable[[Env, WriteCell], Case]:
    """vLLM's own StagedWriteTensor: one stage_write per edit from Python lists, then apply_write."""

    def build(env: Env, cell: WriteCell) -> Case:
        ws = write_sets(env, cell)
        sw = mrv2_staged_write(write_shape(cell), torch.int32, env.device)
        return _writes_case(
            "mrv2_staged_write",
            cell,
            ws,
            _per_edit(sw.stage_write, ws),
            sw.apply_write,
            lambda: sw.gpu,
            lambda: {"peer": f"vLLM {vllm_mrv2.NEWEST}"},
        )

    return build


# --- the strategy lists -------------------------------------------------------------------------

TIER_NAMES = {Tier.UVA: "uva", Tier.PINNED: "pinned", Tier.PAGEABLE: "pageable", Tier.HOST: "host"}


def micro_strategies(tiers: Sequence[Tier]) -> list[Strategy]:
    out = [
        Strategy("list_tensor", "list -> torch.tensor(device=...) per array", "baseline", micro_list_tensor),
        Strategy(
            "pinned_tensor_per_array",
            "pinned tensor per array + .cuda(non_blocking) (nano-vllm)",
            "baseline",
            micro_pinned_tensor,
            needs=("pinned",),
        ),
        Strategy(
            "pinned_buffer_per_array",
            f"vLLM {_V} V1 CpuGpuBuffer per array (fixed pinned buffer + async copy)",
            "baseline",
            micro_pinned_buffer,
            needs=(
                "vllm",
                "pinned",
            ),
        ),
        Strategy(
            "mrv2_fallback_per_array",
            f"vLLM {_V} UvaBufferPool without pinned memory (NonUvaBuffer) per array",
            "baseline",
            micro_baseline_pool(mrv2_fallback_pool, "mrv2_fallback_per_array"),
            needs=("vllm",),
        ),
        Strategy(
            "uva_pool_per_array",
            "UVA pool per array on stagebuf's UvaBuffer (2 slots, cached views, no guard)",
            "baseline",
            micro_baseline_pool(uva_pool_cached, "uva_pool_per_array"),
            needs=("uva",),
        ),
        Strategy(
            "mrv2_uva_pool",
            f"vLLM {_V} UvaBufferPool per array (2 UVA slots, no guard)",
            "baseline",
            micro_baseline_pool(mrv2_uva_pool, "mrv2_uva_pool"),
            needs=(
                "vllm",
                "uva",
            ),
        ),
    ]
    for t in tiers:
        n = TIER_NAMES[t]
        out.append(
            Strategy(
                f"pool_{n}", f"stagebuf UvaBufferPool per array [{t.name}]", "stagebuf", micro_pool(), tier=t
            )
        )
        out.append(
            Strategy(
                f"stager_static_{n}",
                f"stagebuf StepStager(static=True), CUDA-graph ready [{t.name}]",
                "stagebuf",
                micro_stager(static=True),
                tier=t,
            )
        )
        out.append(
            Strategy(f"stager_{n}", f"stagebuf StepStager [{t.name}]", "stagebuf", micro_stager(), tier=t)
        )
    out.append(Strategy("floor", "floor: consumer only, data already on the device", "floor", micro_floor))
    return out


def guard_strategies(tiers: Sequence[Tier]) -> list[Strategy]:
    """StepStager and per-array pools with the guard forced to wait and to off (for 'guard_cost')."""
    out = []
    for t in tiers:
        n = TIER_NAMES[t]
        for g in ("wait", "off"):
            out.append(
                Strategy(
                    f"stager_{n}.guard_{g}",
                    f"StepStager [{t.name}] guard={g}",
                    "stagebuf",
                    micro_stager(g),
                    tier=t,
                )
            )
            out.append(
                Strategy(
                    f"pool_{n}.guard_{g}",
                    f"UvaBufferPool per array [{t.name}] guard={g}",
                    "stagebuf",
                    micro_pool(g),
                    tier=t,
                )
            )
    return out


def decode_strategies(tiers: Sequence[Tier]) -> list[Strategy]:
    out = [
        Strategy(
            "list_tensor",
            "torch.tensor(device=...) per array; row copies from pageable memory",
            "baseline",
            decode_list_tensor,
        ),
        Strategy(
            "pinned_tensor_per_array",
            "pinned tensor per array + .cuda(non_blocking); pinned row copies",
            "baseline",
            decode_pinned_tensor,
            needs=("pinned",),
        ),
        Strategy(
            "pinned_buffer_per_array",
            f"vLLM {_V} V1 CpuGpuBuffer per array; pinned row copies",
            "baseline",
            decode_pinned_buffer,
            needs=(
                "vllm",
                "pinned",
            ),
        ),
        Strategy(
            "mrv2_fallback_per_array",
            f"vLLM {_V} UvaBufferPool without pinned memory (NonUvaBuffer) per array; row copies",
            "baseline",
            decode_baseline_pool(mrv2_fallback_pool, "mrv2_fallback_per_array", False),
            needs=("vllm",),
        ),
        Strategy(
            "uva_pool_per_array",
            "UVA pool per array on stagebuf's UvaBuffer; pinned row copies",
            "baseline",
            decode_baseline_pool(uva_pool_cached, "uva_pool_per_array", True),
            needs=("uva",),
        ),
        Strategy(
            "mrv2_decode",
            f"vLLM {_V} MRV2: UvaBufferPool per array; StagedWriteTensor appends",
            "baseline",
            decode_mrv2(),
            needs=("vllm", "uva", "triton"),
        ),
    ]
    for t in tiers:
        out.append(
            Strategy(
                f"stager_{TIER_NAMES[t]}",
                f"StepStager + StagedWriteTensor [{t.name}]",
                "stagebuf",
                decode_stager,
                tier=t,
            )
        )
    out.append(
        Strategy(
            "floor",
            "floor: host bookkeeping + slot-mapping kernels, inputs on the device",
            "floor",
            decode_floor,
        )
    )
    return out


def writes_strategies(tiers: Sequence[Tier]) -> list[Strategy]:
    out = [
        Strategy(
            "row_copy_per_edit",
            "per-row indexed copy per edit (host table + copy_)",
            "baseline",
            writes_row_copy,
        ),
        Strategy(
            "mrv2_staged_write",
            f"vLLM {_V} StagedWriteTensor (its own class)",
            "baseline",
            writes_mrv2(),
            needs=("vllm", "uva", "triton"),
        ),
    ]
    for t in tiers:
        n = TIER_NAMES[t]
        out.append(
            Strategy(
                f"staged_write_{n}",
                f"StagedWriteTensor: stage_write per edit + apply [{t.name}]",
                "stagebuf",
                writes_staged,
                tier=t,
            )
        )
        out.append(
            Strategy(
                f"staged_writes_{n}",
                f"StagedWriteTensor: stage_writes (numpy) + apply [{t.name}]",
                "stagebuf",
                writes_staged_batched,
                tier=t,
            )
        )
    if Tier.UVA in tiers:  # the two apply kernels forced, to show where 'auto' switches
        forced = (
            ("staged_write", "StagedWriteTensor", writes_staged, ("triton",)),
            (
                "staged_writes",
                "stage_writes (numpy)",
                writes_staged_batched,
                ("triton",),
            ),
        )
        for k in ("scatter", "triton"):
            for name, what, builder, needs in forced:
                out.append(
                    Strategy(
                        f"{name}_uva.{k}",
                        f"{what}, kernel={k} forced [UVA]",
                        "stagebuf",
                        functools.partial(builder, kernel=k),
                        tier=Tier.UVA,
                        needs=needs,
                    )
                )
    return out
