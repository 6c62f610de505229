"""The micro workload: K int32 arrays of N staged per step, then one op reading them all.

Per-array copies (a tensor from a list, a pinned tensor, vLLM's ``CpuGpuBuffer``), vLLM's ``UvaBufferPool``
(with and without pinned memory), a UVA pool without a guard, and stagebuf's ``UvaBufferPool`` and
``StepStager`` on each tier, against the floor (the consumer alone); each case checks the device data after
timing. The guard variants (``guard="wait"`` and ``"off"``) give the guard's cost (:func:`guard_cost`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from stagebuf import StepStager, Tier, UvaBufferPool

from . import baselines as BL
from . import targets as T
from . import vllm_mrv2
from .harness import BenchCheckError, Case, Env, Strategy

V = vllm_mrv2.NEWEST.rpartition(".")[0]  # The peer's vLLM release in the strategies' labels, as "0.34".
SIZE = 64  # The N of the targets.


def sources(env: Env, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(env.seed * 7919 + n)
    return [rng.integers(0, 1 << 20, n, dtype=np.int32) for _ in range(env.k)]


def case(
    name: str,
    srcs: list[np.ndarray],
    run: Callable[[], list[torch.Tensor]],
    stats: Callable[[], dict[str, Any]] = dict,
) -> Case:
    """A step stages every array and sums them on the device; after timing each must equal its source."""

    def step() -> object:
        ts = run()
        torch.cat(ts).sum()
        return ts

    def finish() -> dict[str, Any]:
        for i, (g, w) in enumerate(zip(run(), srcs)):
            got = g.cpu().numpy()
            if got.shape != w.shape or not np.array_equal(got, w):
                bad = int(np.count_nonzero(got != w)) if got.shape == w.shape else -1
                why = f"{bad} of {w.size} elements differ; shape {got.shape} vs {w.shape}"
                raise BenchCheckError(f"{name}: array {i} on the device differs from the host source ({why})")
        return {"verified": True, **stats()}

    return Case(step, finish)


def list_tensor(env: Env, n: int) -> Case:
    srcs = sources(env, n)
    lists = [s.tolist() for s in srcs]
    run = lambda: [torch.tensor(x, dtype=torch.int32, device=env.device) for x in lists]
    return case("list_tensor", srcs, run)


def pinned_tensor(env: Env, n: int) -> Case:
    srcs = sources(env, n)
    lists = [s.tolist() for s in srcs]

    pinned = lambda x: torch.tensor(x, dtype=torch.int32, pin_memory=True).to(env.device, non_blocking=True)
    return case("pinned_tensor_per_array", srcs, lambda: [pinned(x) for x in lists])


def pinned_buffer(env: Env, n: int) -> Case:
    srcs = sources(env, n)
    bufs = [BL.cpu_gpu_buffer(n, torch.int32, env.device) for _ in srcs]

    def run() -> list[torch.Tensor]:
        for b, s in zip(bufs, srcs):
            b.np[:n] = s
        return [b.copy_to_gpu(n) for b in bufs]

    return case("pinned_buffer_per_array", srcs, run)


def baseline_pool(
    make: Callable[[int, torch.dtype, torch.device], Any], name: str
) -> Callable[[Env, int], Case]:
    def build(env: Env, n: int) -> Case:
        srcs = sources(env, n)
        pools = [make(n, torch.int32, env.device) for _ in srcs]
        return case(name, srcs, lambda: [p.copy_to_uva(s) for p, s in zip(pools, srcs)])

    return build


def pool(guard: str = "auto") -> Callable[[Env, int], Case]:
    def build(env: Env, n: int) -> Case:
        srcs = sources(env, n)
        pools = [UvaBufferPool(n, torch.int32, device=env.device, guard=guard) for _ in srcs]
        waits = lambda: sum(p.stats()["guard_waits"] for p in pools)
        run = lambda: [p.copy_to_uva(s) for p, s in zip(pools, srcs)]
        return case("pool", srcs, run, lambda: {"tier": pools[0].tier.name, "guard_waits": waits()})

    return build


def stager(guard: str = "auto", static: bool = False) -> Callable[[Env, int], Case]:
    def build(env: Env, n: int) -> Case:
        srcs = sources(env, n)
        capacity = max(1 << 20, 1 << (max(env.k * (n * 4 + 16), 1) - 1).bit_length())
        st = StepStager(device=env.device, capacity=capacity, guard=guard, static=static)

        def run() -> list[torch.Tensor]:
            with st.step() as s:
                return [s.stage(x) for x in srcs]

        return case("stager", srcs, run, lambda: {"tier": st.tier.name, "guard": st.guard, **st.stats()})

    return build


def floor(env: Env, n: int) -> Case:
    srcs = sources(env, n)
    ts = [torch.from_numpy(s).to(env.device) for s in srcs]
    return case("floor", srcs, lambda: ts)


BASELINES = (  # name, label, builder, needs
    ("list_tensor", "list -> torch.tensor(device=...) per array", list_tensor, ()),
    ("pinned_tensor_per_array", "pinned tensor per array + .cuda(non_blocking) (nano-vllm)", pinned_tensor,
     ("pinned",)),
    ("pinned_buffer_per_array", f"vLLM {V} V1 CpuGpuBuffer per array (fixed pinned buffer + async copy)",
     pinned_buffer, ("vllm", "pinned")),
    ("mrv2_fallback_per_array", f"vLLM {V} UvaBufferPool without pinned memory (NonUvaBuffer) per array",
     baseline_pool(BL.mrv2_fallback_pool, "mrv2_fallback_per_array"), ("vllm",)),
    ("uva_pool_per_array", "UVA pool per array on stagebuf's UvaBuffer (2 slots, cached views, no guard)",
     baseline_pool(BL.RoundRobinPool, "uva_pool_per_array"), ("uva",)),
    ("mrv2_uva_pool", f"vLLM {V} UvaBufferPool per array (2 UVA slots, no guard)",
     baseline_pool(BL.mrv2_uva_pool, "mrv2_uva_pool"), ("vllm", "uva")),
)  # fmt: skip


def strategies(tiers: Sequence[Tier]) -> list[Strategy]:
    out = [Strategy(name, label, "baseline", build, needs=needs) for name, label, build, needs in BASELINES]
    for t in tiers:
        n = t.name.lower()
        out += [
            Strategy(f"pool_{n}", f"stagebuf UvaBufferPool per array [{t.name}]", "stagebuf", pool(), t),
            Strategy(f"stager_static_{n}", f"stagebuf StepStager(static=True), CUDA-graph ready [{t.name}]",
                     "stagebuf", stager(static=True), t),
            Strategy(f"stager_{n}", f"stagebuf StepStager [{t.name}]", "stagebuf", stager(), t),
        ]  # fmt: skip
    return [*out, Strategy("floor", "floor: consumer only, data already on the device", "floor", floor)]


def guard_strategies(tiers: Sequence[Tier]) -> list[Strategy]:
    """StepStager and per-array pools with the guard forced to wait and to off (for :func:`guard_cost`)."""
    kinds = (("stager", "StepStager", stager), ("pool", "UvaBufferPool per array", pool))
    return [
        Strategy(
            f"{what}_{t.name.lower()}.guard_{g}", f"{label} [{t.name}] guard={g}", "stagebuf", make(g), t
        )
        for t in tiers
        for g in ("wait", "off")
        for what, label, make in kinds
    ]


def guard_cost(raw: dict[str, Any]) -> dict[str, Any]:
    """Per tier and structure: guard='wait' minus guard='off', µs per step."""
    out: dict[str, Any] = {}
    for name, by_size in raw.items():
        base, _, mode = name.partition(".guard_")
        off = raw.get(f"{base}.guard_off", {})
        what, _, tier = base.partition("_")
        structure = {"stager": "StepStager", "pool": "UvaBufferPool per array"}.get(what, what)
        for size, w in by_size.items():
            if mode != "wait" or (o := off.get(size)) is None:
                continue
            row = {"structure": structure, "tier": tier.upper(), "guard_waits": w.get("guard_waits", 0)}
            for k in ("host", "e2e"):
                row |= {f"wait_{k}_us": w[f"{k}_us"], f"off_{k}_us": o[f"{k}_us"]}
                row[f"delta_{k}_us"] = round(w[f"{k}_us"] - o[f"{k}_us"], 3)
            out.setdefault(base, {})[size] = row
    return out


TARGETS = {  # name: (the device it needs, numerator, denominator, goal): staging costs at N = SIZE
    "uva_stager_vs_pinned_per_array": ("cuda", "stager_uva", "pinned_buffer_per_array", 0.2),
    "pinned_stager_vs_pinned_per_array": ("cuda", "stager_pinned", "pinned_buffer_per_array", 0.3),
    "pageable_stager_vs_mrv2_fallback": (None, "stager_pageable", "mrv2_fallback_per_array", 0.25),
    "pool_vs_mrv2_pool": ("cuda", "pool_uva", "mrv2_uva_pool", 1.0),
}
WHAT = {
    "uva_stager_vs_pinned_per_array": "UVA StepStager staging cost / per-array pinned copies' (fixed pinned "
    "buffer per array + async copy, vLLM V1 style)",
    "pinned_stager_vs_pinned_per_array": "PINNED StepStager staging cost / per-array pinned copies'",
    "pageable_stager_vs_mrv2_fallback": "PAGEABLE StepStager staging cost / MRV2's synchronous-copy fallback "
    "(NonUvaBuffer) per array",
    "pool_vs_mrv2_pool": "UVA UvaBufferPool per array (default guard) staging cost / MRV2's UvaBufferPool "
    "per array",
}
WHY = {
    "uva_stager_vs_pinned_per_array": "UVA staging saves less over one pinned copy per array than the README "
    "claims: the headline claim does not hold on this machine",
    "pinned_stager_vs_pinned_per_array": "with pinned memory but no UVA, one copy per step saves less over "
    "one copy per array than claimed",
    "pageable_stager_vs_mrv2_fallback": "without pinned memory, one copy per step saves less over MRV2's "
    "synchronous per-array fallback than claimed",
    "pool_vs_mrv2_pool": "stagebuf's UvaBufferPool (its guard on) costs more per array than MRV2's "
    "(no guard)",
    "no_tier_slower_than_uva_pool": "a fallback tier's step (the worst part names it) costs more than MRV2's "
    "UVA pool: correct, but slower where UVA is missing",
}


def targets(results: dict[str, Any], tiers_run: Sequence[Tier]) -> dict[str, dict[str, Any]]:
    """The micro targets (:data:`TARGETS`), and each tier's step time against a UVA pool's."""
    out = {}
    for name, (needs, num, den, goal) in TARGETS.items():
        out[name] = T.ratio(WHAT[name], results, "micro", SIZE, num, den, "staging", "<=", goal)
        out[name]["needs"] = needs
        if den == "pinned_buffer_per_array":
            alt = T.ratio("", results, "micro", SIZE, num, "pinned_tensor_per_array", "staging", "<=", 0)
            out[name]["vs_pinned_tensor_per_array"] = alt.get("measured")
    parts = []
    for t in tiers_run:
        what, num = f"micro: {t.name} StepStager / MRV2-style UVA pool", f"stager_{t.name.lower()}"
        parts.append(T.ratio(what, results, "micro", SIZE, num, "uva_pool_per_array", "step", "<=", 1.10))
    what = "every tier's StepStager step time / the MRV2-style UVA pool's (micro K=8 N=64); the worst"
    worst = lambda p: f"micro {p['numerator']}"
    e = out["no_tier_slower_than_uva_pool"] = T.worst_of(
        what, parts, "step (e2e µs)", "<=", 1.10, "no stagebuf tier ran", worst
    )
    e["needs"] = "cuda"
    for name, e in out.items():
        if e["passed"] is False:
            e[T.REASON] = WHY[name]
    return out
