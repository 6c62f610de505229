"""docs/BENCHMARKS.md's tables, made from the committed reports (:func:`benchmarks.report.docs_tables`).

``python -m benchmarks.render_docs [REPORT] [--e2e REPORT] [--check]`` fills the doc between its ``tables``
and ``e2e`` markers; ``--check`` changes nothing and exits 1 when the doc's tables are not the reports'.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from . import report as R

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "benchmarks" / "results" / "h200.json"
E2E_REPORT = ROOT / "benchmarks" / "results" / "h200-e2e.json"
DOC = ROOT / "docs" / "BENCHMARKS.md"
BEGIN, END = "<!-- tables:begin -->", "<!-- tables:end -->"
E2E_BEGIN, E2E_END = "<!-- e2e:begin -->", "<!-- e2e:end -->"


def current_targets() -> set[str]:
    """The targets the bench computes now; a report's others are left out of the tables."""
    from . import bench

    return bench.target_names()


def tables(report: dict[str, Any]) -> str:
    return R.docs_tables(report, current_targets())


def _between(doc: str, begin: str, end: str, text: str) -> str:
    if doc.count(begin) != 1 or doc.count(end) != 1 or doc.index(begin) > doc.index(end):
        raise ValueError(f"the doc needs one {begin} line, then one {end} line")
    head, rest = doc.split(begin, 1)
    return f"{head}{begin}\n{text}{end}{rest.split(end, 1)[1]}"


def render(doc: str, report: dict[str, Any], e2e: dict[str, Any] | None = None) -> str:
    """``doc`` with the text between its markers replaced by the reports' tables."""
    doc = _between(doc, BEGIN, END, tables(report))
    return doc if e2e is None else _between(doc, E2E_BEGIN, E2E_END, R.e2e_markdown(e2e))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.render_docs", description=__doc__.split("\n\n")[0])
    p.add_argument("report", nargs="?", default=str(REPORT), help="a bench report (--json) [%(default)s]")
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
        return int(new != old)
    if new != old:
        doc.write_text(new)
    print(f"{doc}: tables from {a.report}" + ("" if new != old else " (unchanged)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
