"""The bench's verdicts: every missed target says why in one line, and the last line's verdict and the exit
status agree, or the line says why they do not (a miss is reported, and is an exit status only with
``--strict``)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from benchmarks import bench as B
from benchmarks import micro, writes
from benchmarks import render_docs as R
from benchmarks import report as RP
from benchmarks import targets as VD
from click.testing import CliRunner

from stagebuf import Tier


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    return json.loads(R.REPORT.read_text())


def test_every_target_of_the_bench_has_a_reason_for_a_miss() -> None:
    """Results where every stagebuf strategy is far slower than every other (PAGEABLE slower still): each of
    the bench's targets misses on the device it is defined for, each with its own one-line reason."""
    tiers, cfg = list(Tier), B.BenchConfig()
    res: dict[str, Any] = {}
    for wl, strategies, sizes in (
        ("micro", micro.strategies(tiers), ["64"]),
        ("writes", writes.strategies(tiers), [str(c) for c in cfg.cells()]),
    ):
        for s in strategies:
            v = {"floor": 1.0, "baseline": 10.0}.get(s.kind, 2000.0 if "pageable" in s.name else 1000.0)
            res.setdefault(wl, {})[s.name] = {"sizes": {n: {"host_us": v, "e2e_us": v} for n in sizes}}
    B.add_staging(res)
    only = {
        f"staged_write_{t.name.lower()}.stage_only": {"256x8": {"host_us": 1e3, "e2e_us": 1e3}} for t in tiers
    }
    missed: set[str] = set()
    for device in ("cuda:0", "cpu"):
        for name, t in B.compute_ratios(res, only, tiers, cfg, device).items():
            if VD.status(t) == "fail":
                missed.add(name)
                assert t[VD.REASON] != VD.GENERIC and len(t[VD.REASON]) < 200 and "\n" not in t[VD.REASON]
    assert missed == set(B.compute_ratios({}, {}, [], cfg, "cpu"))


def test_each_miss_carries_a_one_line_reason(report: dict[str, Any]) -> None:
    r = copy.deepcopy(report)
    fails = [n for n, t in r["ratios"].items() if VD.status(t) == "fail"]
    assert fails  # the committed run misses some
    lines = VD.misses(r)
    assert len(lines) == len(fails)
    for name, line in zip(fails, lines):
        assert line.startswith(f"{name}: ") and " against " in line and "\n" not in line
        assert r["ratios"][name][VD.REASON]
        assert len(r["ratios"][name][VD.REASON]) < 300
    r["ratios"]["made_up"] = {"status": "fail", "measured": 2.0, "op": "<=", "target": 1.0}
    assert VD.misses(r)[-1] == f"made_up: 2.000 against <= 1.0 (100% past it): {VD.GENERIC}"
    r["ratios"]["given"] = {"status": "fail", "measured": 2.0, "op": "<=", "target": 1.0, "why": "it said"}
    assert VD.misses(r)[-1].endswith(": it said")


def _run(tmp_path: Path, rep: dict[str, Any], *args: str) -> Any:
    p = tmp_path / "r.json"
    p.write_text(json.dumps(rep))
    return CliRunner().invoke(B.bench, ["--from-json", str(p), *args])


def test_the_verdict_line_and_the_exit_status_agree_or_say_why(
    report: dict[str, Any], tmp_path: Path
) -> None:
    res = _run(tmp_path, report)
    last = res.output.strip().splitlines()[-1]
    assert res.exit_code == 0 and last.startswith("verdict: FAIL"), res.output[-2000:]
    assert "exit status 0" in last and "--strict" in last and "Why each missed target missed" in res.output
    res = _run(tmp_path, report, "--strict")
    assert res.exit_code == 3 and "exit status 3 (--strict)" in res.output.strip().splitlines()[-1]
    passing = copy.deepcopy(report)
    for t in passing["ratios"].values():
        if VD.status(t) == "fail":
            t.update(status="pass", passed=True)
    res = _run(tmp_path, passing, "--strict")
    assert res.exit_code == 0 and res.output.strip().splitlines()[-1].startswith("verdict: pass")


def test_the_markdown_lists_the_reasons(report: dict[str, Any]) -> None:
    md = RP.markdown(copy.deepcopy(report))
    assert "Why each missed target missed:" in md
    t = report["ratios"]["no_tier_slower_than_uva_pool"]
    assert t["passed"] is False  # the committed H200 run misses it
    assert f"- no_tier_slower_than_uva_pool: {t['measured']:.3f} against <= 1.1" in md


def test_vllm_s_own_log_lines_say_whose_they_are(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """The bench's first line used to be vLLM's bare "falling back to device memory for UVA buffers"."""
    from benchmarks import vllm_mrv2

    monkeypatch.setattr(vllm_mrv2._Logger, "explained", False)
    log = vllm_mrv2._Logger("vllm.v1.worker.gpu.buffer_utils")
    with caplog.at_level("WARNING"):
        for _ in range(2):
            log.warning_once(
                "Pinned memory is not available on this platform; falling back to device memory."
            )
        log.warning_once("another line")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and all(s.startswith(f"vLLM {vllm_mrv2.NEWEST}: ") for s in said)
    assert "baseline" in said[0] and "not stagebuf's" in said[0] and "baseline" not in said[1]
