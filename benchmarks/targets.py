"""The bench's targets: a measured ratio (or time) against a goal, how each is judged, and the verdict.

A target is a dict in ``report["ratios"]``: ``description``, ``op`` and ``target`` (the goal), ``measured``,
``passed`` and ``status`` ('pass', 'fail', 'info': a ``--quick`` CPU run, not judged; 'skipped': not measured;
'n/a': defined for another device); a target made of parts measures its worst; ``why`` says what a miss means.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

REASON = "why"  # The field of a target holding the one-line reason shown when it is missed.
GENERIC = f"no reason was recorded for this target (its builder sets {REASON!r})"
PART_KEYS = (
    "workload",
    "size",
    "numerator",
    "denominator",
    "numerator_us",
    "denominator_us",
    "measured",
    "passed",
    "skipped",
)
NA_DROP = (
    "measured_host",
    "numerator_us",
    "denominator_us",
    "missing",
    "skipped",
    "parts",
    "worst",
    "worst_size",
    "worst_note",
    "vs_pinned_tensor_per_array",
)
"""What a target that does not apply to the run's device keeps no longer."""
INFO_WHY = (
    "a --quick run on a CPU is a smoke test, not a measurement: its repeats are short, and on a CPU "
    "shared with other work (the 2-core CI machine) they moved these ratios across their goals from "
    "one run to the next, so they are printed, not judged. A full run (python -m benchmarks, without "
    "--quick) or a GPU run judges every target that applies"
)


def meets(value: float, op: str, goal: float) -> bool:
    return value <= goal if op == "<=" else value == goal if op == "==" else value >= goal


def target(
    description: str,
    workload: str,
    value: float | None,
    op: str,
    goal: float,
    note: str | None = None,
    missing: str = "",
    why: str = "",
) -> dict[str, Any]:
    """A target from one measured value (None or NaN: not measured, ``missing`` says what it needs)."""
    e: dict[str, Any] = {"description": description, "workload": workload, "op": op, "target": goal}
    if value is None or value != value:
        return {
            **e,
            "measured": None,
            "passed": None,
            "skipped": f"not measured in this run{': ' + missing if missing else ''}",
        }
    e.update(measured=round(value, 4), passed=meets(value, op, goal))
    if note:
        e["worst_note"] = note
    if why and not e["passed"]:
        e[REASON] = why
    return e


def _value(results: dict[str, Any], wl: str, strat: str, size: Any, key: str) -> float | None:
    v = results.get(wl, {}).get(strat, {}).get("sizes", {}).get(str(size), {}).get(key)
    return None if v is None else float(v)


def ratio(
    description: str,
    results: dict[str, Any],
    wl: str,
    size: Any,
    num: str,
    den: str,
    metric: str,
    op: str,
    goal: float,
) -> dict[str, Any]:
    """``num / den`` of ``metric`` ('staging' or 'step') at ``size``: synchronised µs, host µs beside."""
    key = {"staging": "staging_{}_us", "step": "{}_us"}[metric]
    nv, dv = (_value(results, wl, s, size, key.format("e2e")) for s in (num, den))
    nh, dh = (_value(results, wl, s, size, key.format("host")) for s in (num, den))
    missing = [f"{wl} {s} at {SIZE_NAMES[wl]}={size}" for s, v in ((num, nv), (den, dv)) if v is None]
    ok = nv is not None and dv is not None and dv > 0
    e = target(description, wl, nv / dv if ok else None, op, goal, missing=", ".join(missing))
    e |= {"size": size, "metric": f"{metric} (e2e µs)", "numerator": num, "denominator": den}
    e |= {"numerator_us": nv, "denominator_us": dv}
    if missing:
        e["missing"] = missing
    elif not ok:
        e["skipped"] = f"{den} is not above the floor ({dv} µs): no ratio"
    else:
        e["measured_host"] = round(nh / dh, 4) if nh is not None and dh and dh > 0 else None
    return e


SIZE_NAMES = {"micro": "N", "writes": "ExL"}  # How a workload's size keys read ("ExL": E edits of L).


def worst_of(
    description: str,
    parts: list[dict[str, Any]],
    metric: str,
    op: str,
    goal: float,
    none_why: str,
    note: Callable[[dict[str, Any]], str],
) -> dict[str, Any]:
    """A target made of ``parts``: the worst measured, passed if all measured parts pass."""
    got = [p for p in parts if p.get("measured") is not None]
    w = (max if op == "<=" else min)(got, key=lambda p: p["measured"]) if got else None
    e: dict[str, Any] = {
        "description": description, "metric": metric, "op": op, "target": goal,
        "measured": w["measured"] if w else None, "worst": f"{w['workload']} {w['numerator']}" if w else None,
        "worst_size": w.get("size") if w else None, "worst_note": note(w) if w else None,
        "passed": all(p["passed"] for p in got) if got else None,
        "parts": [{k: p.get(k) for k in PART_KEYS if k in p} for p in parts],
    }  # fmt: skip
    if not got:
        missing = sorted({x for p in parts for x in p.get("missing", [])})
        e["skipped"] = f"not measured in this run: {', '.join(missing)}" if missing else none_why
    return e


# --- judging ------------------------------------------------------------------------------------


def na_reason(needs: str | None, device: str) -> str | None:
    """Why a target for ``needs`` ('cuda', 'cpu' or None) does not apply on ``device``, or None."""
    kind = device.split(":", 1)[0]
    if needs == "cuda" and kind != "cuda":
        return f"needs a CUDA device; this run's device is {device}"
    if needs == "cpu" and kind != "cpu":
        return f"a HOST-tier target: applies only when the device is the CPU; this run's device is {device}"
    return None


def not_judged(quick: bool, device: str) -> str | None:
    """Why this run's targets are printed, not judged (only a ``--quick`` run on a CPU); None: judged."""
    return INFO_WHY if quick and device.split(":", 1)[0] == "cpu" else None


def inform(entry: dict[str, Any], why: str | None) -> None:
    """A judged target of a run that is not judged: ``status`` 'info', ``passed`` None (its parts' too)."""
    if why is None or entry.get("passed") is None:
        return
    entry.update(passed=None, status="info", info=why)
    for part in entry.get("parts", []):
        part["passed"] = None


def settle(entry: dict[str, Any], needs: str | None, device: str, info: str | None = None) -> None:
    """Add ``needs``, ``applies`` and ``status`` ('n/a' with ``na``, 'info' with ``info``)."""
    entry["needs"] = needs
    why = na_reason(needs, device)
    if why is not None:
        for k in NA_DROP:
            entry.pop(k, None)
        entry.update(measured=None, passed=None, applies=False, status="n/a", na=why)
        return
    entry["applies"] = True
    entry["status"] = status(entry)
    inform(entry, info)


def status(r: dict[str, Any]) -> str:
    """'pass', 'fail', 'info', 'skipped' or 'n/a' (reports from before the field: from ``passed``)."""
    if "status" in r:
        return str(r["status"])
    return "skipped" if r.get("passed") is None else "pass" if r["passed"] else "fail"


def attach(ratios: dict[str, dict[str, Any]], whys: dict[str, str] | None = None) -> None:
    """Give every missed target a reason: its builder's, ``whys``' (by name), or the generic one."""
    for name, r in ratios.items():
        if status(r) == "fail" and not r.get(REASON):
            r[REASON] = (whys or {}).get(name, GENERIC)


def gap(r: dict[str, Any]) -> str:
    """How far a target missed: "1.276 against <= 1.1 (16% past it; worst: micro stager_pinned)"."""
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
    return 3 if strict and any(status(r) == "fail" for r in report.get("ratios", {}).values()) else 0


def verdict(report: dict[str, Any], strict: bool) -> str:
    """The last line: the verdict, the exit status, and why they differ when they do."""
    ratios: Iterable[dict[str, Any]] = report.get("ratios", {}).values()
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
