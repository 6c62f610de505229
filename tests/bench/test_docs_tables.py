"""docs/BENCHMARKS.md's tables are the committed H200 report's (``python -m benchmarks.render_docs``).

A new run committed to benchmarks/results/h200.json without regenerating the doc fails here, as
does a table edited by hand. The generator itself is checked against the JSON read directly.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from benchmarks import render_docs as R

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    return json.loads(R.REPORT.read_text())


def _rows(md: str, first_cell: str) -> list[list[str]]:
    """The cells of every table row of ``md`` whose first cell is ``first_cell``."""
    out = []
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if cells and cells[0] == first_cell:
            out.append(cells)
    return out


def test_committed_tables_are_the_committed_reports() -> None:
    doc = R.DOC.read_text()
    e2e = json.loads(R.E2E_REPORT.read_text())
    assert R.render(doc, json.loads(R.REPORT.read_text()), e2e) == doc, (
        "docs/BENCHMARKS.md's tables differ from benchmarks/results/h200.json or h200-e2e.json: run "
        "`.venv/bin/python -m benchmarks.render_docs` and commit the doc"
    )
    section = doc.split(R.E2E_BEGIN, 1)[1].split(R.E2E_END, 1)[0]
    for name, r in e2e["summary"]["ratios"].items():
        (row,) = _rows(section, f"`{name}`")
        assert row[3] == f"{r['measured']:.3f}" and row[4] == r["status"]
    assert e2e["commit"][:7] in section and e2e["device_name"] in section


def test_results_live_outside_docs() -> None:
    assert R.REPORT.is_file()
    for w in ("micro", "writes"):  # one figure per workload (report.plot_paths)
        assert R.REPORT.with_name(f"h200-{w}.png").is_file()
        assert f"](../benchmarks/results/h200-{w}.png)" in R.DOC.read_text()
    assert not sorted((ROOT / "docs").rglob("*.json")), "run data belongs in benchmarks/results/"
    assert R.E2E_REPORT.with_suffix(".png").is_file()
    assert "](../benchmarks/results/h200-e2e.png)" in R.DOC.read_text()


def test_target_rows_come_from_the_report(report: dict[str, Any]) -> None:
    md = R.tables(report)
    current = R.current_targets()
    shown = [k for k in report["ratios"] if k in current]
    assert shown, "the committed report has none of the bench's current targets"
    for name in shown:
        r = report["ratios"][name]
        (row,) = _rows(md, f"`{name}`")
        if r.get("measured") is None:
            assert row[1] == "-"
        else:
            assert row[1].split(" ")[0] == f"{r['measured']:.3f}"
        assert row[2].startswith(f"{r['op']} {r['target']}")
        status = r.get("status") or ("pass" if r["passed"] else "fail")
        assert row[3] == {"fail": "**fail**"}.get(status, row[3]) and row[3].strip("*").startswith(status)
    for name in report["ratios"]:
        if name not in current:
            assert not _rows(md, f"`{name}`") and f"`{name}`" in md  # named as left out, no row


def test_micro_cells_are_staging_costs(report: dict[str, Any]) -> None:
    md = R.tables(report).split("#### micro", 1)[1].split("####", 1)[0]
    micro = report["results"]["micro"]
    name = next(n for n in micro if n != "floor")
    (row,) = _rows(md, f"`{name}`")
    n = min(int(s) for s in micro[name]["sizes"])
    assert row[1] == f"{micro[name]['sizes'][str(n)]['staging_e2e_us']:.1f}"


def test_a_changed_report_makes_the_doc_stale(report: dict[str, Any], tmp_path: Path) -> None:
    changed = copy.deepcopy(report)
    name = next(k for k, r in changed["ratios"].items() if r.get("measured") is not None)
    changed["ratios"][name]["measured"] += 1.0
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text(R.render("# title\n\n<!-- tables:begin -->\nold\n<!-- tables:end -->\ntail\n", report))
    src = tmp_path / "h200.json"
    src.write_text(json.dumps(changed))
    none = ["--e2e", str(tmp_path / "no-e2e-report.json")]
    assert R.main([str(src), "--doc", str(doc), "--check", *none]) == 1
    assert R.main([str(src), "--doc", str(doc), *none]) == 0
    text = doc.read_text()
    assert text.startswith("# title\n\n<!-- tables:begin -->\n") and text.endswith(
        "<!-- tables:end -->\ntail\n"
    )
    assert R.main([str(src), "--doc", str(doc), "--check", *none]) == 0
    assert f"{changed['ratios'][name]['measured']:.3f}" in text


@pytest.mark.parametrize(
    "doc",
    ["no markers\n", "<!-- tables:end -->\n<!-- tables:begin -->\n", "<!-- tables:begin -->\n" * 2],
)
def test_markers_are_required(doc: str, report: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="tables:begin"):
        R.render(doc, report)


def test_the_readmes_end_to_end_rows_are_the_committed_e2e_report() -> None:
    e2e = json.loads(R.E2E_REPORT.read_text())
    table = e2e["summary"]["table"]
    readme = (ROOT / "README.md").read_text()
    assert "](benchmarks/results/h200-e2e.png)" in readme and f"commit `{e2e['commit'][:7]}`" in readme
    for workload, kind in (("decode", "decode"), ("prefill", "prefill")):
        (row,) = [ln for ln in readme.splitlines() if ln.startswith(f"{kind} tokens/s (")]
        cells = row.split(" | ")[1:]
        rows = table[workload]
        own = rows["own"][f"{kind}_tokens_per_s"]
        for cell, setup in zip(cells, ("own", "stagebuf_uva", "stagebuf_pageable", "stagebuf_nopin")):
            v = rows[setup][f"{kind}_tokens_per_s"]
            assert cell.startswith(f"{round(v):,}".replace(",", " ")), (setup, cell)
            if setup != "own":
                assert f"({v / own:.2f}×)" in cell, (setup, cell)
