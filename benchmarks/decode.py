"""The decode workload: a serving loop's step, its per-request arrays staged, its block table edited.

Each step of :class:`DecodeSim` (requests arrive and finish; a new one prefills in one step, then decodes a
token a step) stages four arrays (rows, positions, sequence lengths, query starts), appends the new blocks
to a block table and computes the slot mapping on the device; every ``check_every`` steps the device's
slot mapping and block table are compared with the numpy model (time kept out of the timing). Strategies:
per-array copies with row copies into the table, vLLM's ``CpuGpuBuffer``s, vLLM's pools without pinned
memory, a UVA pool without a guard, vLLM MRV2's own pools and ``StagedWriteTensor``, and stagebuf's
``StepStager`` and ``StagedWriteTensor`` on each tier; the floor is the bookkeeping and the slot-mapping
kernels on inputs already on the device.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from stagebuf import StepStager, Tier

from . import baselines as BL
from . import micro, vllm_mrv2
from . import targets as T
from .harness import EXCLUDED_S, BenchCheckError, Case, Env, Strategy
from .writes import staged_write_tensor

V = micro.V
WARMUP = 64  # Decode steps before timing: the first step prefills every request at once.
Arrays = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class DecodeStep:
    """What the scheduler hands the model runner for one step."""

    idx: np.ndarray  # int32 [B]: each batch entry's row in the request state (and the block table).
    pos: np.ndarray  # int64 [T]: each scheduled token's position.
    seq: np.ndarray  # int32 [B]: sequence lengths after this step.
    qsl: np.ndarray  # int32 [B+1]: query-start offsets (the cumulative tokens per request).
    edits: list[tuple[int, int, list[int]]]  # Block-table appends: (row, first column, block ids).


class DecodeSim:
    """A serving loop's scheduler state, and the numpy model of the block table.

    ``batch`` requests run at once; one that reaches its target length finishes and a new one arrives in
    its place, on a free row of the request state (rows come in pairs r, r + batch: exactly one of each
    pair is in use). A new request is prefilled in one step (1..max_prompt tokens), then decodes one token
    per step. Each step appends the blocks that the new tokens need.
    """

    def __init__(self, batch: int, block_size: int = 16, max_prompt: int = 64, max_len: int = 1024,
                 seed: int = 0):  # fmt: skip
        self.batch, self.block_size, self.max_prompt = batch, block_size, max_prompt
        self.max_blocks = -(-max_len // block_size)
        self.rows_total = 2 * batch
        self.table = np.zeros((self.rows_total, self.max_blocks), np.int32)
        self.rows = np.arange(batch, dtype=np.int32) + batch
        self.seq, self.target, self.qlen, self.nblk = (np.zeros(batch, np.int32) for _ in range(4))
        self.num_blocks, self.next_block = 1 << 22, 0
        rng = np.random.default_rng(seed)
        self._prompts = rng.integers(1, max_prompt + 1, 1 << 14).astype(np.int32)
        self._gens = rng.integers(16, max_len - max_prompt + 1, 1 << 14).astype(np.int32)
        self._draw = 0
        self._ar = np.arange(batch * max_prompt + 1, dtype=np.int64)
        self._cols = np.arange(self.max_blocks, dtype=np.int32)
        self.step_no = self.tokens = 0

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
            erow, estart = self.rows[at], self.nblk[at]
            first = np.cumsum(counts) - counts
            cols = np.repeat(estart, counts) + (self._ar[:total] - np.repeat(first, counts))
            self.table[np.repeat(erow, counts), cols] = ids
            self.nblk[at] = need[at]
            flat, bounds = ids.tolist(), first.tolist() + [total]
            parts = [flat[bounds[i] : bounds[i + 1]] for i in range(len(bounds) - 1)]
            edits = list(zip(erow.tolist(), estart.tolist(), parts))
        qsl = np.zeros(B + 1, np.int32)
        np.cumsum(self.qlen, out=qsl[1:])
        start = (self.seq - self.qlen).astype(np.int64) - qsl[:-1]
        pos = np.repeat(start, self.qlen) + self._ar[: int(qsl[-1])]
        self.step_no += 1
        self.tokens += int(qsl[-1])
        return DecodeStep(self.rows.copy(), pos, self.seq.copy(), qsl, edits)

    def reference_slots(self, st: DecodeStep) -> np.ndarray:
        b = np.searchsorted(st.qsl[1:], self._ar[: st.pos.shape[0]], side="right")
        blk = self.table[st.idx[b], st.pos // self.block_size].astype(np.int64)
        slots: np.ndarray = blk * self.block_size + st.pos % self.block_size
        return slots

    def check(self, name: str, st: DecodeStep, slots: torch.Tensor, table: torch.Tensor) -> None:
        """Compare the device slot mapping and the live block-table cells with the model."""
        got, want = slots.cpu().numpy(), self.reference_slots(st)
        where = f"decode loop [{name}] step {self.step_no}"
        if got.shape != want.shape:
            raise BenchCheckError(f"{where}: the device slot mapping differs from the host model: shape "
                                  f"{got.shape} vs {want.shape}")  # fmt: skip
        bad = np.flatnonzero(got != want)
        if bad.size:
            i = int(bad[0])
            raise BenchCheckError(
                f"{where}: the device slot mapping differs from the host model: {bad.size} of {want.size} "
                f"tokens differ; token {i}: got {got[i]}, want {want[i]}"
            )
        live = self._cols[None, :] < self.nblk[:, None]
        dev, host = table.cpu().numpy()[st.idx][live], self.table[st.idx][live]
        if not np.array_equal(dev, host):
            n_bad = int(np.count_nonzero(dev != host))
            raise BenchCheckError(
                f"{where}: {n_bad} live block-table cells on the device differ from the host model"
            )


def slot_mapping(
    idx: torch.Tensor, pos: torch.Tensor, seq: torch.Tensor, qsl: torch.Tensor, table: torch.Tensor,
    tok: torch.Tensor, block_size: int,
) -> torch.Tensor:  # fmt: skip
    """Each token's KV-cache slot: block_table[row, pos // bs] * bs + pos % bs (-1 past seq_len)."""
    b = torch.searchsorted(qsl[1:], tok[: pos.shape[0]], right=True)
    slot = table[idx[b], pos // block_size].to(torch.int64) * block_size + pos % block_size
    return torch.where(pos < seq[b], slot, -1)


class TableOps(NamedTuple):
    """How a strategy edits the block table: write per edit, apply per step, the device tensor."""

    write: Callable[[int, int, list[int]], None]
    apply: Callable[[], None]
    target: Callable[[], torch.Tensor]


def staged_ops(sw: Any) -> TableOps:
    return TableOps(sw.stage_write, sw.apply_write, lambda: sw.gpu)


def row_copies(pinned: bool) -> Callable[[DecodeSim, torch.device], TableOps]:
    """An engine's block table: a host copy edited in place, one indexed row copy per edit."""

    def make(sim: DecodeSim, dev: torch.device) -> TableOps:
        t = BL.RowCopyTable((sim.rows_total, sim.max_blocks), dev, pinned)
        return TableOps(t.write, lambda: None, lambda: t.dev)

    return make


def sizes(sim: DecodeSim) -> list[tuple[int, torch.dtype]]:
    """The four arrays' largest sizes and dtypes: rows, positions, sequence lengths, query starts."""
    return [(sim.batch, torch.int32), (sim.max_tokens, torch.int64), (sim.batch, torch.int32),
            (sim.batch + 1, torch.int32)]  # fmt: skip


def case(env: Env, batch: int, name: str, stage: Callable[[DecodeStep], Arrays], table: TableOps,
         sim: DecodeSim, extra: Callable[[], dict[str, Any]] = dict) -> Case:  # fmt: skip
    """A step advances ``sim``, stages its arrays, applies its block-table edits and computes the slot
    mapping; every ``check_every`` steps (and after timing) the device's answer is checked."""
    tok = torch.arange(sim.max_tokens, dtype=torch.int32, device=env.device)
    checks = [0]

    def run(check: bool) -> object:
        st = sim.advance()
        check = check or sim.step_no % env.check_every == 0
        d = stage(st)
        for row, start, values in st.edits:
            table.write(row, start, values)
        table.apply()
        slots = slot_mapping(*d, table.target(), tok, env.block_size)
        if check:
            t0 = time.perf_counter()
            sim.check(name, st, slots, table.target())
            EXCLUDED_S[0] += time.perf_counter() - t0
            checks[0] += 1
        return slots

    def finish() -> dict[str, Any]:
        run(True)
        return {"checks": checks[0], "steps": sim.step_no, "check_every": env.check_every,
                "tokens_per_step": round(sim.tokens / max(sim.step_no, 1), 1), **extra()}  # fmt: skip

    return Case(lambda: run(False), finish, WARMUP, env.decode_steps)


Maker = Callable[[DecodeSim, torch.device], Callable[[DecodeStep], Arrays]]


def strategy(
    name: str, stage: Maker, table: Callable[[DecodeSim, torch.device], TableOps]
) -> Callable[[Env, int], Case]:
    def build(env: Env, batch: int) -> Case:
        sim = DecodeSim(batch, env.block_size, seed=env.seed)
        return case(env, batch, name, stage(sim, env.device), table(sim, env.device), sim)

    return build


def per_array(convert: Callable[[np.ndarray, torch.device], torch.Tensor]) -> Maker:
    def make(sim: DecodeSim, dev: torch.device) -> Callable[[DecodeStep], Arrays]:
        c = convert
        return lambda st: (c(st.idx, dev), c(st.pos, dev), c(st.seq, dev), c(st.qsl, dev))

    return make


def pooled(make_pool: Callable[[int, torch.dtype, torch.device], Any]) -> Maker:
    """Each array through its own pool (``copy_to_uva``)."""

    def make(sim: DecodeSim, dev: torch.device) -> Callable[[DecodeStep], Arrays]:
        p = [make_pool(n, dt, dev) for n, dt in sizes(sim)]
        return lambda st: (p[0].copy_to_uva(st.idx), p[1].copy_to_uva(st.pos), p[2].copy_to_uva(st.seq),
                           p[3].copy_to_uva(st.qsl))  # fmt: skip

    return make


def cpu_gpu_buffers(sim: DecodeSim, dev: torch.device) -> Callable[[DecodeStep], Arrays]:
    bufs = [BL.cpu_gpu_buffer(n, dt, dev) for n, dt in sizes(sim)]

    def stage(st: DecodeStep) -> Arrays:
        out = []
        for b, a in zip(bufs, (st.idx, st.pos, st.seq, st.qsl)):
            b.np[: a.shape[0]] = a
            out.append(b.copy_to_gpu(a.shape[0]))
        return out[0], out[1], out[2], out[3]

    return stage


def mrv2(
    make_pool: Callable[[int, torch.dtype, torch.device], Any] = BL.mrv2_uva_pool,
) -> Callable[[Env, int], Case]:
    """MRV2's decode step with vLLM's own classes: the arrays through its UvaBufferPools, block-table appends
    through its StagedWriteTensor (``make_pool``: a CPU test's fallback pool)."""

    def build(env: Env, batch: int) -> Case:
        sim = DecodeSim(batch, env.block_size, seed=env.seed)
        stage = pooled(make_pool)(sim, env.device)
        sw = BL.mrv2_staged_write((sim.rows_total, sim.max_blocks), torch.int32, env.device)
        facts = {"peer": f"vLLM {vllm_mrv2.NEWEST}", "pool_slots": BL.MRV2_SLOTS}
        return case(env, batch, "mrv2_decode", stage, staged_ops(sw), sim, lambda: facts)

    return build


def stager(env: Env, batch: int) -> Case:
    sim = DecodeSim(batch, env.block_size, seed=env.seed)
    st = StepStager(device=env.device)
    sw = staged_write_tensor((sim.rows_total, sim.max_blocks), env.device)

    def stage(d: DecodeStep) -> Arrays:
        with st.step() as s:
            return s.stage(d.idx), s.stage(d.pos), s.stage(d.seq), s.stage(d.qsl)

    def facts() -> dict[str, Any]:
        return {"tier": st.tier.name, "guard": st.guard, "stager": st.stats(),
                "staged_write_kernel": getattr(sw, "kernel", None), "staged_write": sw.stats()}  # fmt: skip

    return case(env, batch, "stager", stage, staged_ops(sw), sim, facts)


def floor(env: Env, batch: int) -> Case:
    """Host bookkeeping and the slot-mapping kernels on device-resident inputs: no staging."""
    dev, warm = env.device, DecodeSim(batch, env.block_size, seed=env.seed)
    for _ in range(3):
        st0 = warm.advance()
    fixed = [torch.from_numpy(a).to(dev) for a in (st0.idx, st0.pos, st0.seq, st0.qsl)]
    table = torch.from_numpy(warm.table).to(dev)
    sim = DecodeSim(batch, env.block_size, seed=env.seed)
    tok = torch.arange(sim.max_tokens, dtype=torch.int32, device=dev)

    def step() -> object:
        sim.advance()
        slots = slot_mapping(*fixed, table, tok, env.block_size)
        if sim.step_no % env.check_every == 0:
            t0 = time.perf_counter()
            slots.cpu()  # the same device round trip as a check (kept out of the timing too)
            EXCLUDED_S[0] += time.perf_counter() - t0
        return slots

    def finish() -> dict[str, Any]:
        got = slot_mapping(*fixed, table, tok, env.block_size).cpu().numpy()
        if not np.array_equal(got, warm.reference_slots(st0)):
            raise BenchCheckError(
                "decode loop [floor]: the slot-mapping kernels disagree with the host model"
            )
        return {"checks": 0, "steps": sim.step_no, "check_every": env.check_every}

    return Case(step, finish, WARMUP, env.decode_steps)


def _pinned(a: np.ndarray, dev: torch.device) -> torch.Tensor:
    return torch.from_numpy(a).pin_memory().to(dev, non_blocking=True)


BASELINES = (  # name, label, stage, table, needs
    ("list_tensor", "torch.tensor(device=...) per array; row copies from pageable memory",
     per_array(lambda a, dev: torch.tensor(a, device=dev)), row_copies(False), ()),
    ("pinned_tensor_per_array", "pinned tensor per array + .cuda(non_blocking); pinned row copies",
     per_array(_pinned), row_copies(True), ("pinned",)),
    ("pinned_buffer_per_array", f"vLLM {V} V1 CpuGpuBuffer per array; pinned row copies", cpu_gpu_buffers,
     row_copies(True), ("vllm", "pinned")),
    ("mrv2_fallback_per_array", f"vLLM {V} UvaBufferPool without pinned memory (NonUvaBuffer) per array; row "
     "copies", pooled(BL.mrv2_fallback_pool), row_copies(False), ("vllm",)),
    ("uva_pool_per_array", "UVA pool per array on stagebuf's UvaBuffer; pinned row copies",
     pooled(BL.uva_pool_cached), row_copies(True), ("uva",)),
)  # fmt: skip


def strategies(tiers: Sequence[Tier]) -> list[Strategy]:
    out = [
        Strategy(n, label, "baseline", strategy(n, s, t), needs=needs) for n, label, s, t, needs in BASELINES
    ]
    out.append(Strategy("mrv2_decode", f"vLLM {V} MRV2: UvaBufferPool per array; StagedWriteTensor appends",
                        "baseline", mrv2(), needs=("vllm", "uva", "triton")))  # fmt: skip
    for t in tiers:
        out.append(Strategy(f"stager_{t.name.lower()}", f"StepStager + StagedWriteTensor [{t.name}]",
                            "stagebuf", stager, t))  # fmt: skip
    return [*out, Strategy("floor", "floor: host bookkeeping + slot-mapping kernels, inputs on the device",
                           "floor", floor)]  # fmt: skip


NAIVE_CPU = ("list_tensor", "mrv2_fallback_per_array", "pinned_tensor_per_array", "pinned_buffer_per_array")
"""The naive strategies a HOST-tier decode step is compared with (the pinned ones never run on a CPU)."""
TARGETS = (
    T.Ratio("decode_pageable_vs_uva", "cuda", "decode loop step time: PAGEABLE StepStager / UVA StepStager",
            "stager_pageable", "stager_uva", 1.5, "a decode step on PAGEABLE costs markedly more than on UVA "
            "here: losing pinned memory costs step time on this machine", "step"),
    *(T.Ratio(f"decode_stager_{t}_vs_mrv2", "cuda", f"decode loop staging cost: {t.upper()} StepStager "
              "+ StagedWriteTensor / MRV2's UVA pools + StagedWriteTensor (on UVA)", f"stager_{t}",
              "mrv2_decode", goal, f"a decode step's staging on {t.upper()} gains less over MRV2's UVA "
              "pools and StagedWriteTensor than claimed")
      for t, goal in (("uva", 0.5), ("pinned", 0.7), ("pageable", 0.7))),
)  # fmt: skip


def targets(results: dict[str, Any], tiers_run: Sequence[Tier], batch: int) -> dict[str, dict[str, Any]]:
    """The decode targets, and one over micro and decode: no tier slower than a UVA pool."""
    out = T.ratios(TARGETS, results, "decode", batch)
    parts = [
        T.ratio(f"{wl}: {t.name} StepStager / MRV2-style UVA pool", results, wl, size,
                f"stager_{t.name.lower()}", "uva_pool_per_array", "step", "<=", 1.10)
        for wl, size in (("micro", micro.SIZE), ("decode", batch))
        for t in tiers_run
    ]  # fmt: skip
    out["no_tier_slower_than_uva_pool"] = e = T.worst_of(
        "every tier's StepStager step time / the MRV2-style UVA pool's step time (micro K=8 N=64 and decode "
        "loop); measured is the worst", parts, "step (e2e µs)", "<=", 1.10, "no stagebuf tier ran",
        lambda p: f"{p['workload']} {p['numerator']}",
    )  # fmt: skip
    e["needs"] = "cuda"
    if e["passed"] is False:
        e[T.REASON] = ("a fallback tier's step (the worst part names it) costs more than MRV2's UVA pool: "
                       "correct, but slower where UVA is missing")  # fmt: skip
    cands = {n: v for n in NAIVE_CPU if (v := T._value(results, "decode", n, batch, "e2e_us")) is not None}
    naive = min(cands, key=cands.__getitem__) if cands else NAIVE_CPU[0]
    host = T.Ratio("host_decode_vs_naive_cpu", "cpu", "decode loop step time on the CPU: HOST StepStager "
                   f"+ StagedWriteTensor / the fastest naive strategy of this run ({naive}, of "
                   f"{', '.join(cands) or 'none measured'})", "stager_host", naive, 0.8, "on the CPU (tier "
                   "HOST) the stager's decode step gains less over the fastest naive strategy than claimed",
                   "step")  # fmt: skip
    out |= T.ratios([host], results, "decode", batch)
    out["host_decode_vs_naive_cpu"]["naive_candidates_us"] = cands
    return out
