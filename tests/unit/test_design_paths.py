"""DESIGN.md's two paths (a pool publish, a staged apply) are the code's: the number of package functions
and modules each crosses, counted by ``scripts/path_count.py``, is the one the picture states, on the copy
path (PAGEABLE) and on HOST, for edits of mixed lengths and of one length alike. A change that lengthens
or shortens a path fails here until DESIGN says so."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest

import stagebuf

ROOT = Path(__file__).resolve().parents[2]
DESIGN = (ROOT / "docs" / "DESIGN.md").read_text()


def _path_count() -> Any:
    spec = importlib.util.spec_from_file_location("path_count", ROOT / "scripts" / "path_count.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _stated(tier: str) -> dict[str, tuple[int, int]]:
    """(functions, modules) per path as DESIGN.md states them for ``tier``."""
    if tier == "pageable":
        pool = re.search(r"pool publish\s+UvaBufferPool\.copy_to_uva.*?\n\s*\((\d+) in (\d+)\)", DESIGN)
        apply = re.search(r"staged apply\s+StagedWriteTensor\.apply_write\s*\n\s*\((\d+) in (\d+)\)", DESIGN)
        assert pool and apply, "DESIGN.md's path picture is not where this test looks"
        return {"pool publish": (int(pool[1]), int(pool[2])), "staged apply": (int(apply[1]), int(apply[2]))}
    host = re.search(
        r"On HOST .*?a pool publish crosses (\d+) functions in (\d+)\s+modules and a staged apply"
        r".*?: (\d+) in (\d+)\.",
        DESIGN,
        re.S,
    )
    assert host, "DESIGN.md's sentence on HOST is not where this test looks"
    return {"pool publish": (int(host[1]), int(host[2])), "staged apply": (int(host[3]), int(host[4]))}


@pytest.mark.parametrize("tier", ["pageable", "host"])
def test_the_paths_cross_what_design_says(tier: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAGEBUF_TIER", tier)
    stagebuf.reset_capabilities()
    try:
        pc = _path_count()
        crossed = pc.paths()
        same_length = pc.paths(second=[4, 5, 6])["staged apply"]
    finally:
        stagebuf.reset_capabilities()
    assert {name: (len(seen), pc.modules(seen)) for name, seen in crossed.items()} == _stated(tier)
    # DESIGN: edits all of one length cross the same functions as edits of mixed lengths
    assert same_length == crossed["staged apply"]
