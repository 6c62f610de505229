"""The staged-writes workload: E edits of L elements (distinct rows) staged, then applied once per step.

Every E x L (:class:`WriteCell`) of a 2-D int32 device table: per-row indexed copies, vLLM MRV2's own
``StagedWriteTensor``, and stagebuf's on each tier, from lists (``staged_write_*``) or arrays
(``staged_writes_*``), on UVA also with each apply kernel forced; after timing the table must equal the numpy
model. The stage-only runs time ``stage_write`` calls alone: what of a step is staging.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stagebuf import StagedWriteTensor, Tier

from . import baselines as BL
from . import targets as T
from . import vllm_mrv2
from .harness import BenchCheckError, Case, Env, Strategy, env_var


@dataclass(frozen=True, order=True)
class WriteCell:
    """One cell of the sweep: E edits of L elements each, on distinct rows; key ``"ExL"``."""

    edits: int
    length: int

    def __str__(self) -> str:
        return f"{self.edits}x{self.length}"

    @classmethod
    def parse(cls, key: str) -> WriteCell:
        """``"256x8"``; a plain ``"256"`` (reports from before the sweep: one-element edits) is 256x1."""
        e, _, ln = key.partition("x")
        return cls(int(e), int(ln or 1))


RATIO_CELL = WriteCell(256, 1)  # staged_write_256_speedup's cell: 256 one-element edits.
STAGE_ONLY_CELL = WriteCell(256, 8)  # stage_write_8_ints_us's cell


def write_shape(cell: WriteCell) -> tuple[int, int]:
    """max(4096, E) rows (each edit its own) and max(64, 2 L) columns."""
    return max(4096, cell.edits), max(64, 2 * cell.length)


@dataclass
class WriteSets:
    """Two sets of the same E edits (rows, starts) with different values, applied alternately."""

    rows: np.ndarray  # int64 [E], distinct.
    starts: np.ndarray  # int64 [E], each in [0, cols - L].
    values: list[np.ndarray]  # Per set: int32 [E, L].
    lists: list[list[tuple[int, int, list[int]]]]  # Per set, the edits as Python ints and lists.
    want: np.ndarray  # The table after the second set.


def write_sets(env: Env, cell: WriteCell) -> WriteSets:
    shape, e, ln = write_shape(cell), cell.edits, cell.length
    rng = np.random.default_rng((env.seed, e, ln))
    rows = rng.permutation(shape[0])[:e].astype(np.int64)
    starts = rng.integers(0, shape[1] - ln + 1, e).astype(np.int64)
    want = np.zeros(shape, np.int32)
    values = [rng.integers(1, 1 << 30, (e, ln)).astype(np.int32) for _ in range(2)]
    for vals in values:
        want[rows[:, None], starts[:, None] + np.arange(ln)[None, :]] = vals
    lists = [list(zip(rows.tolist(), starts.tolist(), v.tolist())) for v in values]
    return WriteSets(rows, starts, values, lists, want)


def staged_write_tensor(shape: tuple[int, int], device: torch.device, kernel: str | None = None) -> Any:
    """A StagedWriteTensor on the tier ``STAGEBUF_TIER`` forces; ``kernel`` forces its apply kernel."""
    with env_var("STAGEBUF_WRITE_KERNEL", kernel) if kernel else contextlib.nullcontext():
        return StagedWriteTensor(shape, torch.int32, device)


def case(
    name: str,
    cell: WriteCell,
    ws: WriteSets,
    stage: Callable[[int], None],
    apply: Callable[[], None],
    target: Callable[[], torch.Tensor],
    facts: Callable[[], dict[str, Any]] = dict,
) -> Case:
    """Each step stages set 0 or set 1 (alternately) with ``stage(k)``, then applies once."""
    done = [0]

    def step() -> None:
        stage(done[0] & 1)
        done[0] += 1
        apply()

    def finish() -> dict[str, Any]:
        if done[0] & 1:  # end on the second set, whose values ``want`` holds
            step()
        got = target().cpu().numpy()
        if not np.array_equal(got, ws.want):
            bad = int(np.count_nonzero(got != ws.want))
            raise BenchCheckError(
                f"staged writes [{name}] E={cell.edits} L={cell.length}: {bad} table "
                f"cells differ from the host model after {done[0]} applies"
            )
        return {"edits": cell.edits, "length": cell.length, "applies": done[0], "verified": True, **facts()}

    return Case(step, finish)


def per_edit(write: Callable[[int, int, list[int]], None], ws: WriteSets) -> Callable[[int], None]:
    """Stage set k with one ``write(row, start, values)`` per edit, from Python lists."""

    def stage(k: int) -> None:
        for row, start, values in ws.lists[k]:
            write(row, start, values)

    return stage


def row_copy(env: Env, cell: WriteCell) -> Case:
    ws = write_sets(env, cell)
    t = BL.RowCopyTable(write_shape(cell), env.device, pinned=env.pin_memory and env.cuda)
    memory = {"host_memory": "pinned" if t.non_blocking else "pageable"}
    stage = per_edit(t.write, ws)
    return case("row_copy_per_edit", cell, ws, stage, lambda: None, lambda: t.dev, lambda: memory)


def staged(env: Env, cell: WriteCell, kernel: str | None = None, batched: bool = False) -> Case:
    """StagedWriteTensor: ``stage_write`` per edit (``batched``: ``stage_writes``), then the apply."""
    ws = write_sets(env, cell)
    sw = staged_write_tensor(write_shape(cell), env.device, kernel)
    stage = per_edit(sw.stage_write, ws)
    if batched:
        stage = lambda k: sw.stage_writes(ws.rows, ws.starts, ws.values[k])
    facts = lambda: {"kernel": sw.kernel, "stats": sw.stats()}
    name = "staged_writes" if batched else "staged_write"
    return case(name, cell, ws, stage, sw.apply_write, lambda: sw.gpu, facts)


staged_batched = functools.partial(staged, batched=True)


def mrv2(env: Env, cell: WriteCell) -> Case:
    """vLLM's own StagedWriteTensor: one stage_write per edit from Python lists, then apply_write."""
    ws = write_sets(env, cell)
    sw = BL.mrv2_staged_write(write_shape(cell), torch.int32, env.device)
    peer = lambda: {"peer": f"vLLM {vllm_mrv2.NEWEST}"}
    return case(
        "mrv2_staged_write", cell, ws, per_edit(sw.stage_write, ws), sw.apply_write, lambda: sw.gpu, peer
    )


def stage_only(env: Env, cell: WriteCell) -> Case:
    """``stage_write`` x E, then ``clear_staged_writes()``: no apply."""
    sw = staged_write_tensor(write_shape(cell), env.device)
    stage = per_edit(sw.stage_write, write_sets(env, cell))

    def step() -> None:
        stage(0)
        sw.clear_staged_writes()

    return Case(step)


def strategies(tiers: Sequence[Tier]) -> list[Strategy]:
    v = vllm_mrv2.NEWEST.rpartition(".")[0]
    out = [
        Strategy("row_copy_per_edit", "per-row indexed copy per edit (host table + copy_)", "baseline",
                 row_copy),
        Strategy("mrv2_staged_write", f"vLLM {v} StagedWriteTensor (its own class)", "baseline", mrv2,
                 needs=("vllm", "uva", "triton")),
    ]  # fmt: skip
    one = ("staged_write", "StagedWriteTensor: stage_write per edit + apply", "StagedWriteTensor", staged)
    batched = "StagedWriteTensor: stage_writes (numpy) + apply"
    ways = (one, ("staged_writes", batched, "stage_writes (numpy)", staged_batched))
    for t in tiers:
        out += [
            Strategy(f"{n}_{t.name.lower()}", f"{what} [{t.name}]", "stagebuf", b, t)
            for n, what, _, b in ways
        ]
    if Tier.UVA in tiers:  # the two apply kernels forced, to show where 'auto' switches
        for k in ("scatter", "triton"):
            for n, _, what, b in ways:
                forced = functools.partial(b, kernel=k)
                label = f"{what}, kernel={k} forced [UVA]"
                out.append(Strategy(f"{n}_uva.{k}", label, "stagebuf", forced, Tier.UVA, ("triton",)))
    return out


def stage_only_strategies(tiers: Sequence[Tier]) -> list[Strategy]:
    name = lambda t: f"staged_write_{t.name.lower()}.stage_only"
    return [Strategy(name(t), "stage_write x E, no apply", "stagebuf", stage_only, t) for t in tiers]


def _stage_write_us(stage_only: dict[str, Any], tiers_run: Sequence[Tier], goal: float) -> dict[str, Any]:
    """Host µs per ``stage_write`` call of the stage-only runs, the worst tier."""
    cell, parts = STAGE_ONLY_CELL, []
    for t in tiers_run:
        name = f"staged_write_{t.name.lower()}.stage_only"
        row, miss = stage_only.get(name, {}).get(str(cell)), f"writes {name} at ExL={cell}"
        part = T.target(name, "writes", row and row["host_us"] / cell.edits, "<=", goal, missing=miss)
        part |= {"size": str(cell), "numerator": name, "numerator_us": row and row["host_us"]}
        parts.append(part if row else part | {"missing": [miss]})
    what = (
        f"StagedWriteTensor.stage_write of a list of {cell.length} ints: host µs per call ({cell.edits} "
        "calls, then clear_staged_writes(); no apply); measured is the worst tier"
    )
    tier = lambda p: p["numerator"].split(".")[0].rsplit("_", 1)[1].upper()
    e = T.worst_of(what, parts, "host µs per call", "<=", goal, "no stagebuf tier ran", tier)
    return e | {"unit": "µs"}


PER_CELL = (  # name, description, stagebuf's strategy, which cells, goal
    ("staged_write_uva_vs_mrv2_e_le_16", "UVA StagedWriteTensor (stage_write per edit from lists + apply) / "
     "MRV2's StagedWriteTensor, step time in every cell with E <= 16", "staged_write_uva", "E <= 16", 0.5),
    ("staged_writes_uva_vs_mrv2_e_ge_256", "UVA StagedWriteTensor batched (stage_writes from numpy + apply) "
     "/ MRV2's (stage_write per edit), every cell with E >= 256", "staged_writes_uva", "E >= 256", 0.2),
    *((f"staged_write_{t.lower()}_vs_mrv2", f"{t} StagedWriteTensor (stage_write per edit + apply) / MRV2's "
       "StagedWriteTensor on UVA, every cell", f"staged_write_{t.lower()}", "any cell", 0.8)
      for t in ("PINNED", "PAGEABLE")),
)  # fmt: skip
"""Targets against vLLM MRV2's StagedWriteTensor, cell by cell of the sweep: the worst cell is measured."""
WHY = {
    "staged_write_256_speedup": "batching 256 small edits into one apply gains less over per-row indexed "
    "copies than claimed",
    "staged_write_uva_vs_mrv2_e_le_16": "for few edits (E <= 16) staged writes gain less over MRV2's "
    "StagedWriteTensor than claimed at the worst cell",
    "staged_writes_uva_vs_mrv2_e_ge_256": "for many edits the batched stage_writes path gains less over "
    "MRV2's per-edit staging than claimed",
    "staged_write_pinned_vs_mrv2": "on PINNED (one copy per apply) staged writes gain less over MRV2's UVA "
    "StagedWriteTensor than claimed at the worst cell",
    "staged_write_pageable_vs_mrv2": "on PAGEABLE staged writes gain less over MRV2's UVA StagedWriteTensor "
    "than claimed at the worst cell",
    "stage_write_8_ints_us": "one stage_write of 8 ints costs more host time than its budget: per-call "
    "overhead on the engine's per-step path",
    "host_one_edit_vs_row_copy": "one small edit on the CPU costs more than twice a row copy: an apply's "
    "fixed cost on tier HOST",
}
NEEDS = {"staged_write_256_speedup": None, "stage_write_8_ints_us": None, "host_one_edit_vs_row_copy": "cpu"}


def targets(
    results: dict[str, Any], stage_only: dict[str, Any], tiers_run: Sequence[Tier], cells: Sequence[WriteCell]
) -> dict[str, dict[str, Any]]:
    """The writes targets: against row copies, against MRV2's, a ``stage_write`` call, a CPU edit."""
    sw = f"staged_write_{tiers_run[0].name.lower()}" if tiers_run else "staged_write_uva"
    rc, n = str(RATIO_CELL), RATIO_CELL.edits
    what = (
        f"per-row indexed copies / StagedWriteTensor ({tiers_run[0].name if tiers_run else '-'}) for {n} "
        f"one-element edits (stage_write x {n} + apply_write)"
    )
    speedup = T.ratio(what, results, "writes", rc, "row_copy_per_edit", sw, "step", ">=", 20)
    out = {"staged_write_256_speedup": speedup}
    which = {"E <= 16": lambda c: c.edits <= 16, "E >= 256": lambda c: c.edits >= 256, "any cell": bool}
    mrv2 = "mrv2_staged_write"
    for name, what, num, where, goal in PER_CELL:
        parts = [
            T.ratio(f"writes {c}: {num} / {mrv2}", results, "writes", str(c), num, mrv2, "step", "<=", goal)
            for c in cells
            if which[where](c)
        ]
        why_none = f"no cell of this run's writes sweep has {where}"
        what = f"{what}; measured is the worst cell"
        cell = lambda p: f"E x L = {p['size']}"
        out[name] = T.worst_of(what, parts, "step (e2e µs), per cell", "<=", goal, why_none, cell)
    out["stage_write_8_ints_us"] = _stage_write_us(stage_only, tiers_run, 1.0)
    what = "one one-element edit on the CPU: HOST StagedWriteTensor stage_write + apply_write / one row copy"
    one = str(WriteCell(1, 1))
    out["host_one_edit_vs_row_copy"] = T.ratio(
        what, results, "writes", one, "staged_write_host", "row_copy_per_edit", "step", "<=", 2.0
    )
    for name, e in out.items():
        e["needs"] = NEEDS.get(name, "cuda")
        if e["passed"] is False:
            e[T.REASON] = WHY[name]
    return out
