"""The docs describe the software, its evidence and its limits: not how the work on it was scheduled.

A line of the README, docs/*.md, the API site's pages or the CHANGELOG that speaks of sessions, lent
machines, leases or workshops is about the workplace, not the project (a reader cannot act on it).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
DOCS += sorted((ROOT / "docs" / "api").glob("*.rst"))
WORKPLACE = re.compile(r"\b(sessions?|lent|lending|leases?|leased|workshops?|the brief|device time)\b", re.I)


def test_the_docs_speak_of_the_project_not_the_workshop() -> None:
    found = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in DOCS
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if WORKPLACE.search(line)
    ]
    assert not found, "\n".join(found)
