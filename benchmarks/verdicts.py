"""The bench's verdicts in words: a one-line reason for each missed target, and what the exit status says.

A target is a dict in ``report["ratios"]``. Its builder may give it ``why`` (:data:`REASON`): one line
saying what a miss of that target means (which claim it tests, how much it matters). The bench attaches
a reason to every missed target that has none: the bench's own from :data:`MISS_WHY`, else a generic
one that says no reason was recorded. The printed report and ``--markdown`` list each miss with the
measured gap and its reason; the last line says the verdict and the exit status, and why they differ
when they do (the bench exits 0 on a miss unless ``--strict``).
"""

from __future__ import annotations

from typing import Any

REASON = "why"
"""The field of a target dict holding the one-line reason shown when the target is missed."""

MISS_WHY: dict[str, str] = {
    "uva_stager_vs_pinned_per_array": "UVA staging saves less over one pinned copy per array than the "
    "README claims: the headline claim does not hold on this machine",
    "pinned_stager_vs_pinned_per_array": "with pinned memory but no UVA, one copy per step saves less over "
    "one copy per array than claimed",
    "pageable_stager_vs_mrv2_fallback": "without pinned memory, one copy per step saves less over MRV2's "
    "synchronous per-array fallback than claimed",
    "staged_write_256_speedup": "batching 256 small edits into one apply gains less over per-row indexed "
    "copies than claimed",
    "decode_pageable_vs_uva": "a decode step on PAGEABLE costs markedly more than on UVA here: losing "
    "pinned memory costs step time on this machine",
    "no_tier_slower_than_uva_pool": "a fallback tier's step (the worst part names it) costs more than "
    "MRV2's UVA pool: correct, but slower where UVA is missing",
    "staged_write_uva_vs_mrv2_e_le_16": "for few edits (E <= 16) staged writes gain less over MRV2's "
    "StagedWriteTensor than claimed at the worst cell",
    "staged_writes_uva_vs_mrv2_e_ge_256": "for many edits the batched stage_writes path gains less over "
    "MRV2's per-edit staging than claimed",
    "staged_write_pinned_vs_mrv2": "on PINNED (one copy per apply) staged writes gain less over MRV2's "
    "UVA StagedWriteTensor than claimed at the worst cell",
    "staged_write_pageable_vs_mrv2": "on PAGEABLE staged writes gain less over MRV2's UVA "
    "StagedWriteTensor than claimed at the worst cell",
    "stage_write_8_ints_us": "one stage_write of 8 ints costs more host time than its budget: per-call "
    "overhead on the engine's per-step path",
    "pool_vs_mrv2_pool": "stagebuf's UvaBufferPool (its guard on) costs more per array than MRV2's "
    "(no guard)",
    "decode_stager_uva_vs_mrv2": "a decode step's staging on UVA gains less over MRV2's UVA pools and "
    "StagedWriteTensor than claimed",
    "decode_stager_pinned_vs_mrv2": "a decode step's staging on PINNED gains less over MRV2's UVA layer "
    "than claimed",
    "decode_stager_pageable_vs_mrv2": "a decode step's staging on PAGEABLE gains less over MRV2's UVA "
    "layer than claimed",
    "host_decode_vs_naive_cpu": "on the CPU (tier HOST) the stager's decode step gains less over the "
    "fastest naive strategy than claimed",
    "host_one_edit_vs_row_copy": "one small edit on the CPU costs more than twice a row copy: an apply's "
    "fixed cost on tier HOST",
}
"""What a miss of each of the bench's own targets (``bench.compute_ratios``) means."""

GENERIC = f"no reason was recorded for this target (its builder sets {REASON!r})"


def status(r: dict[str, Any]) -> str:
    """'pass', 'fail', 'info', 'skipped' or 'n/a' (reports from before the field: from ``passed``)."""
    if "status" in r:
        return str(r["status"])
    return "skipped" if r.get("passed") is None else "pass" if r["passed"] else "fail"


def attach(ratios: dict[str, dict[str, Any]]) -> None:
    """Give every missed target a :data:`REASON`: its builder's, the bench's own, or the generic one."""
    for name, r in ratios.items():
        if status(r) == "fail" and not r.get(REASON):
            r[REASON] = MISS_WHY.get(name, GENERIC)


def gap(r: dict[str, Any]) -> str:
    """How far a target missed: "1.276 against <= 1.1 (16 % past it; worst: micro stager_pinned)"."""
    m, t = r.get("measured"), r.get("target")
    if not isinstance(m, (int, float)) or not isinstance(t, (int, float)) or not t:
        return "missed"
    past = (m / t - 1) if r.get("op", "<=") in ("<=", "<") else (t / m - 1 if m else float("inf"))
    worst = f"; worst: {r['worst_note']}" if r.get("worst_note") else ""
    unit = f" {r['unit']}" if r.get("unit") else ""
    return f"{m:.3f}{unit} against {r.get('op', '')} {t}{unit} ({past:.0%} past it{worst})"


def misses(report: dict[str, Any]) -> list[str]:
    """One line per missed target: "name: gap: reason"."""
    ratios = report.get("ratios", {})
    attach(ratios)
    return [f"{name}: {gap(r)}: {r[REASON]}" for name, r in ratios.items() if status(r) == "fail"]


def exit_status(report: dict[str, Any], strict: bool) -> int:
    """The bench's exit status: 3 with ``--strict`` when a judged target missed, else 0."""
    failed = any(status(r) == "fail" for r in report.get("ratios", {}).values())
    return 3 if strict and failed else 0


def verdict(report: dict[str, Any], strict: bool) -> str:
    """The last line: the verdict, the exit status, and why they differ when they do."""
    ratios = report.get("ratios", {}).values()
    judged = [r for r in ratios if status(r) in ("pass", "fail")]
    failed = [r for r in judged if status(r) == "fail"]
    code = exit_status(report, strict)
    if not judged:
        if any(status(r) == "info" for r in ratios):
            return f"verdict: not judged (see 'info' above); exit status {code}"
        return f"verdict: no target applies to this run; exit status {code}"
    if not failed:
        return f"verdict: pass: all {len(judged)} judged targets met; exit status {code}"
    head = f"verdict: FAIL: {len(failed)} of {len(judged)} judged targets missed (each with its reason above)"
    if strict:
        return f"{head}; exit status {code} (--strict)"
    return (
        f"{head}; exit status {code}: the bench measures and reports, a miss is not an error; "
        "pass --strict to exit 3 on a miss"
    )
