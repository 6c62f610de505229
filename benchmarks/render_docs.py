"""docs/BENCHMARKS.md's tables, made from a committed bench report.

    python -m benchmarks.render_docs [REPORT] [--doc PATH] [--check]

REPORT defaults to ``benchmarks/results/h200.json``. The tables replace whatever lies between
``<!-- tables:begin -->`` and ``<!-- tables:end -->`` in the doc (default ``docs/BENCHMARKS.md``), and
the end-to-end report's (``--e2e``, default ``benchmarks/results/h200-e2e.json``, where it exists) what
lies between ``<!-- e2e:begin -->`` and ``<!-- e2e:end -->``; ``--check`` changes nothing and exits 1
when the doc's tables are not the reports'.

The doc shows a compact selection of the report (every current target, and per workload the
columns a reader compares); ``python -m benchmarks --from-json REPORT --markdown out.md`` prints
every table of it. The cells are formatted by the bench's own helpers (:mod:`benchmarks.bench`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from . import bench as B
from . import engine as E
from . import nanovllm_engine as NV
from . import workloads as W

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "benchmarks" / "results" / "h200.json"
DOC = ROOT / "docs" / "BENCHMARKS.md"
BEGIN, END = "<!-- tables:begin -->", "<!-- tables:end -->"
E2E_REPORT = ROOT / "benchmarks" / "results" / "h200-e2e.json"
E2E_BEGIN, E2E_END = "<!-- e2e:begin -->", "<!-- e2e:end -->"
WRITES_LENGTH = 8
"""The staged-write table shows edits of this many elements (the middle length of the sweep)."""
NA = {"cuda": "n/a (GPU only)", "cpu": "n/a (CPU only)"}
MICRO_SIZES = (64, 32768)
"""The micro table's columns, where the report has them (else every size it has)."""
OTHER_TIERS = ("_pinned", "_pageable")
"""Staged-write rows of these tiers are left out of the writes table (the vs-vLLM table has them)."""
VS_VLLM_PEERS = ("vllm_uva", "stagebuf_uva", "vllm_nopin", "stagebuf_pageable")
"""The vs-vLLM table's columns, where the report has them (else every peer it has)."""
VS_VLLM_LEFT_OUT = ("pool|k1", "backed|k1")
"""vs-vLLM cases left out of the table (the targets use the K=8 cases)."""


def current_targets() -> set[str]:
    """The targets the bench computes now; a report's others are left out of the tables."""
    return set(B.TARGET_NEEDS) | set(E.targets(None, None)) | set(NV.targets(None))


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    """A GitHub table, without the optional outer pipes (the docs' word budget counts each pipe)."""
    out = [" | ".join(head), "|".join("---" for _ in head)]
    return out + [" | ".join(r) for r in rows] + [""]


def _result(r: dict[str, Any]) -> str:
    status = B._status(r)
    if status == "fail":
        return "**fail**"
    if status == "n/a":
        return NA.get(r.get("needs") or "", "n/a")
    return status


def _run_line(report: dict[str, Any]) -> str:
    v = report.get("versions", {})
    dirty = " (dirty tree)" if report.get("dirty") else ""
    return (
        f"Run: `{report.get('command', '?')}` at commit `{report.get('commit') or '?'}`{dirty} on "
        f"{report.get('device_name', '?')}, {report.get('started_utc', '?')[:10]}; "
        f"torch {v.get('torch', '?')}, driver {v.get('driver') or '-'}, Triton {v.get('triton') or '-'}."
    )


def _targets(report: dict[str, Any]) -> list[str]:
    keep = current_targets()
    ratios = report.get("ratios", {})
    rows = [[f"`{k}`", B._measured(r), B._goal(r), _result(r)] for k, r in ratios.items() if k in keep]
    out = ["#### Targets", "", *_table(["target", "measured", "goal", "result"], rows)]
    gone = [k for k in ratios if k not in keep]
    if gone:
        out += ["Left out: " + ", ".join(f"`{k}`" for k in gone) + " (not current targets of the bench).", ""]
    return out


def _pick(have: list[int], want: tuple[int, ...]) -> list[int]:
    """The sizes of ``want`` that ``have`` holds; all of ``have`` when it holds none of them."""
    return [n for n in have if n in want] or have


def _micro(report: dict[str, Any]) -> list[str]:
    data = report.get("results", {}).get("micro")
    if not data:
        return []
    sizes = _pick(sorted({int(s) for e in data.values() for s in e["sizes"]}), MICRO_SIZES)
    rows = []
    for name, e in data.items():
        key = "e2e_us" if name == "floor" else "staging_e2e_us"
        cells = [B._fmt(e["sizes"].get(str(n), {}).get(key)) for n in sizes]
        rows.append([f"`{name}`" + (" (its step time)" if name == "floor" else ""), *cells])
    k = report.get("config", {}).get("k", "?")
    return [
        f"#### micro: staging cost of K={k} int32 arrays of N, µs per step (synchronised, minus the floor)",
        "",
        *_table(["strategy", *(f"N={n}" for n in sizes)], rows),
    ]


def _decode(report: dict[str, Any]) -> list[str]:
    data = report.get("results", {}).get("decode")
    if not data:
        return []
    rows = []
    for name, e in data.items():
        row = next(iter(e["sizes"].values()))
        key = "e2e_us" if name == "floor" else "staging_e2e_us"
        rows.append([f"`{name}`" + (" (its step time)" if name == "floor" else ""), B._fmt(row.get(key))])
    batch = report.get("config", {}).get("batch", "?")
    return [
        f"#### decode loop, batch {batch}: staging cost, µs per step (synchronised, minus the floor)",
        "",
        *_table(["strategy", "staging"], rows),
    ]


def _writes(report: dict[str, Any]) -> list[str]:
    data = report.get("results", {}).get("writes")
    if not data:
        return []
    cells = {W.WriteCell.parse(s) for e in data.values() for s in e["sizes"]}
    lengths = sorted({c.length for c in cells})
    ln = WRITES_LENGTH if WRITES_LENGTH in lengths else lengths[len(lengths) // 2]
    es = sorted({c.edits for c in cells if c.length == ln})
    rows = []
    for name, e in data.items():
        got = [e["sizes"].get(str(W.WriteCell(x, ln))) for x in es]
        if any(got) and not (name.startswith("staged_write") and name.split(".")[0].endswith(OTHER_TIERS)):
            rows.append([f"`{name}`", *(B._fmt(g["e2e_us"]) if g else "-" for g in got)])
    return [
        f"#### staged writes: E edits of L={ln} elements, µs per apply (synchronised)",
        "",
        *_table(["strategy", *(f"E={x}" for x in es)], rows),
    ]


def _engine(report: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for eng in [report.get("engine") or {}, *(report.get("engine_also") or {}).values()]:
        out += _engine_run(eng)
    return out


def _engine_run(eng: dict[str, Any]) -> list[str]:
    meds = eng.get("medians", {})
    if not meds:
        return [f"Engine workload: not run ({eng['skipped']}).", ""] if eng.get("skipped") else []
    groups = sorted({int(k.split("|")[1][1:]) for k in meds})
    cols = [("prep_us", "busy", "prep"), ("buffer_us", "busy", "buffer")]
    head = ["setup", *(f"{g}g {label}" for g in groups for _, _, label in cols)]
    rows = []
    for s in eng.get("setups", []):
        cells = [f"`{s}`"]
        for g in groups:
            for key, mode, _ in cols:
                v = meds.get(f"{s}|g{g}|{mode}", {}).get(key)
                cells.append("-" if v is None else f"{v:.0f}")
        rows.append(cells)
    checks = eng.get("checks", [])
    ok = sum(1 for c in checks if not c["mismatches"])
    return [
        f"#### engine: vLLM {eng.get('vllm_version', '?')}'s MRV2 input path, busy GPU, host µs per step "
        f"(identical inputs: {ok} of {len(checks)} checks)",
        "",
        *_table(head, rows),
    ]


def _nanovllm(report: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for title, head, rows in NV.tables(report):
        out += [f"#### {title}", "", *_table(head, [[f"`{r[0]}`", *r[1:]] for r in rows])]
    return out


def _vs_vllm(report: dict[str, Any]) -> list[str]:
    med = (report.get("vs_vllm") or {}).get("median_us", {})
    if not med:
        return []
    peers: list[str] = []
    for d in med.values():
        peers += [p for p in d if p not in peers]
    peers = [p for p in peers if p in VS_VLLM_PEERS] or peers
    lengths = {_length(c) for c in med} - {None}
    ln = WRITES_LENGTH if WRITES_LENGTH in lengths or not lengths else sorted(lengths)[len(lengths) // 2]
    rows = [
        [f"`{c}`".replace("|", "\\|"), *(B._fmt(d.get(p)) for p in peers)]
        for c, d in med.items()
        if _length(c) in (None, ln) and c not in VS_VLLM_LEFT_OUT
    ]
    title = f"#### vs vLLM's own classes: host µs per step, idle GPU (edits of L={ln})"
    return [title, "", *_table(["case", *peers], rows)]


def _length(case: str) -> int | None:
    """L of a vs-vLLM case named ``kind|ExL`` (None for ``pool|k8`` and the like)."""
    size = case.split("|", 1)[-1]
    try:
        return W.WriteCell.parse(size).length
    except (ValueError, TypeError):
        return None


def _guard(report: dict[str, Any]) -> list[str]:
    rows = [
        [g["structure"], g["tier"], str(n), f"{g['delta_e2e_us']:+.1f}", str(g["guard_waits"])]
        for by_size in (report.get("guard_cost") or {}).values()
        for n, g in by_size.items()
    ]
    if not rows:
        return []
    return [
        '#### guard cost: `guard="wait"` minus `"off"`, µs per step (synchronised)',
        "",
        *_table(["structure", "tier", "N", "cost", "waits"], rows),
    ]


def tables(report: dict[str, Any]) -> str:
    """The Markdown that goes between the markers, from one report (a ``--json`` file's contents)."""
    lines = [_run_line(report), ""]
    for part in (_targets, _micro, _decode, _writes, _engine, _nanovllm, _vs_vllm, _guard):
        lines += part(report)
    return "\n".join(lines).rstrip() + "\n"


def _between(doc: str, begin: str, end: str, text: str) -> str:
    if doc.count(begin) != 1 or doc.count(end) != 1 or doc.index(begin) > doc.index(end):
        raise ValueError(f"the doc needs one {begin} line, then one {end} line")
    head, rest = doc.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{text}{end}{tail}"


def render(doc: str, report: dict[str, Any], e2e: dict[str, Any] | None = None) -> str:
    """``doc`` with the text between its markers replaced by :func:`tables` (and, given an end-to-end
    report, :func:`benchmarks.e2e.markdown` between the e2e markers); ValueError without them."""
    doc = _between(doc, BEGIN, END, tables(report))
    if e2e is not None:
        from . import e2e as E2E

        doc = _between(doc, E2E_BEGIN, E2E_END, E2E.markdown(e2e))
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.render_docs", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "report", nargs="?", default=str(REPORT), help="a bench report (--json); default: %(default)s"
    )
    p.add_argument("--doc", default=str(DOC), help="the Markdown file to rewrite; default: %(default)s")
    p.add_argument("--e2e", default=str(E2E_REPORT), help="an end-to-end report; default: %(default)s")
    p.add_argument("--check", action="store_true", help="exit 1 if the doc's tables are stale; write nothing")
    a = p.parse_args(argv)
    report = json.loads(Path(a.report).read_text())
    e2e = json.loads(Path(a.e2e).read_text()) if Path(a.e2e).is_file() else None
    doc = Path(a.doc)
    old = doc.read_text()
    new = render(old, report, e2e)
    if a.check:
        if new != old:
            print(
                f"{doc}: tables differ from {a.report}; run python -m benchmarks.render_docs", file=sys.stderr
            )
            return 1
        return 0
    if new != old:
        doc.write_text(new)
    print(f"{doc}: tables from {a.report}" + ("" if new != old else " (unchanged)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
