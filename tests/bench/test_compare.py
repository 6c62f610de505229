"""``python -m benchmarks.compare``: the verdict per cell, checked against reports made to a known answer.

Reports are built from the committed H200 run with every sample scaled: a cell scaled
past its noise on every after run must read SLOWER, an unchanged one never, and a
cell whose runs overlap never. The pairing and the ratio (geometric means of run
medians) are recomputed here with plain Python.
"""

from __future__ import annotations

import copy
import json
import statistics
from pathlib import Path
from typing import Any

import pytest
from benchmarks import compare as C
from benchmarks import render_docs as R
from click.testing import CliRunner


@pytest.fixture(scope="module")
def base() -> dict[str, Any]:
    return json.loads(R.REPORT.read_text())


def _scaled(report: dict[str, Any], factor: float, only: str | None = None) -> dict[str, Any]:
    """``report`` with every sample (or only those of cell key ``only``) times ``factor``."""
    r = copy.deepcopy(report)
    for wl, strategies in r["results"].items():
        for name, entry in strategies.items():
            for size, row in entry["sizes"].items():
                if only in (None, f"{wl} {name} {size}"):
                    for k in ("e2e_samples_us", "host_samples_us"):
                        row[k] = [v * factor for v in row.get(k, [])]
    for setup, runs in r.get("engine", {}).get("runs", {}).items():
        for run in runs:
            for part in ("prep_us", "buffer_us"):
                if only in (None, f"engine {setup} {part[:-3]}"):
                    run[part] *= factor
    for cell, per in r.get("vs_vllm", {}).get("raw_us", {}).items():
        for name in per:
            if only in (None, f"vs_vllm {cell} {name}"):
                per[name] = [v * factor for v in per[name]]
    return r


def test_every_cell_of_a_report_is_paired_with_its_own_samples(base: dict[str, Any]) -> None:
    cells = C.pair([base], [base], "e2e_us")
    n_results = sum(len(e["sizes"]) for s in base["results"].values() for e in s.values())
    n_engine = 2 * len(base["engine"]["runs"])
    n_vs = sum(len(v) for v in base["vs_vllm"]["raw_us"].values())
    assert len(cells) == n_results + n_engine + n_vs
    for c in cells:
        assert c.ratio == pytest.approx(1.0)
        assert not c.slower and not c.faster
    by_key = {c.key: c for c in cells}
    row = base["results"]["writes"]["staged_write_uva"]["sizes"]["16x1"]
    got = by_key["writes staged_write_uva 16x1"]
    assert got.ours and got.before == [row["e2e_samples_us"]]
    assert not by_key["writes row_copy_per_edit 16x1"].ours
    assert by_key["engine stagebuf_own_uva|g1|busy prep"].ours
    assert not by_key["engine vllm_uva|g1|busy buffer"].ours


def test_a_cell_slower_on_every_run_by_more_than_its_noise_is_flagged(base: dict[str, Any]) -> None:
    key = "writes staged_write_uva 16x1"
    before = [base, _scaled(base, 1.02)]  # the same code, 2 % apart: noise 0.02
    after = [_scaled(base, 1.01, key), _scaled(_scaled(base, 1.01), 1.5, key)]
    cells = {c.key: c for c in C.pair(before, after, "e2e_us")}
    c = cells[key]
    b = [statistics.median(r) for r in c.before]
    a = [statistics.median(r) for r in c.after]
    assert min(a) <= max(b) * 1.0  # the first after run sits inside the before runs: not separated
    assert not c.slower
    after = [_scaled(base, 1.3, key), _scaled(base, 1.5, key)]
    c = {x.key: x for x in C.pair(before, after, "e2e_us")}[key]
    assert c.noise == pytest.approx(1.5 / 1.3 - 1)  # the after side moved more than the before side
    assert c.ratio == pytest.approx((1.3 * 1.5) ** 0.5 / 1.02**0.5)
    assert c.slower and c.ratio > 1 + c.noise
    s = C.summary(list(C.pair(before, after, "e2e_us")))
    assert s["ours"]["slower_beyond_noise"] == [key]
    assert s["peers"]["slower_beyond_noise"] == []


def test_a_move_within_the_noise_is_not_flagged(base: dict[str, Any]) -> None:
    key = "engine stagebuf_own_uva|g1|busy prep"
    before = [base, _scaled(base, 1.2, key)]  # this cell's own runs differ by 20 %
    after = [_scaled(base, 1.25, key), _scaled(base, 1.3, key)]  # separated, but 1.27 < 1 + noise
    c = {x.key: x for x in C.pair(before, after, "e2e_us")}[key]
    assert min(statistics.median(r) for r in c.after) > max(statistics.median(r) for r in c.before)
    assert c.ratio < 1 + c.noise
    assert not c.slower


def test_the_command_writes_its_verdicts(base: dict[str, Any], tmp_path: Path) -> None:
    paths = []
    for i, r in enumerate([base, _scaled(base, 1.01), _scaled(base, 0.5), _scaled(base, 0.52)]):
        p = tmp_path / f"r{i}.json"
        p.write_text(json.dumps(r))
        paths.append(str(p))
    out = tmp_path / "cmp.json"
    args = ["--before", paths[0], "--before", paths[1], "--after", paths[2], "--after", paths[3]]
    res = CliRunner().invoke(C.main, [*args, "--json", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["summary"]["ours"]["slower_beyond_noise"] == []
    assert all(c["faster"] for c in data["cells"])  # everything halved, far past 1 % noise


def test_one_run_a_side_warns_and_flags_nothing(base: dict[str, Any], tmp_path: Path) -> None:
    """Without a second run no noise is known: equal reports (ratio 1.000) and even a doubled one are not
    flagged, and the command says why."""
    paths = {}
    for name, rep in (("b", base), ("a", _scaled(base, 2.0))):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(rep))
    cells = C.pair([base], [_scaled(base, 2.0)], "e2e_us")
    assert cells and all(c.noise is None and not c.slower and not c.faster for c in cells)
    out = tmp_path / "cmp.json"
    res = CliRunner().invoke(
        C.main, ["--before", str(paths["b"]), "--after", str(paths["a"]), "--json", str(out)]
    )
    assert res.exit_code == 0, res.output
    assert "one run a side" in res.output and "SLOWER" not in res.output
    data = json.loads(out.read_text())
    assert data["summary"]["ours"]["slower_beyond_noise"] == []


def test_drift_of_a_whole_run_is_divided_out_and_a_real_slowdown_still_shows(base: dict[str, Any]) -> None:
    """The machine 40 % slower on both after runs moves every cell, peers too: raw, most cells read slower
    beyond noise; with the drift factors (the peers' median move per run) divided out, only the cell that
    also got 1.5x slower is flagged."""
    key = "writes staged_write_uva 16x1"
    before = [base, _scaled(base, 1.02)]
    after = [_scaled(base, 1.4), _scaled(_scaled(base, 1.43), 1.5, key)]
    after[0] = _scaled(after[0], 1.5, key)
    raw = C.pair(before, after, "e2e_us")
    f = C.drift_factors(raw)
    g = statistics.geometric_mean([1.0, 1.02, 1.4, 1.43])
    assert f == pytest.approx([1.0 / g, 1.02 / g, 1.4 / g, 1.43 / g])
    assert sum(c.slower for c in raw) > len(raw) // 2  # the drift alone flags most cells
    fixed = {c.key: c for c in C.pair(before, after, "e2e_us", f)}
    assert fixed[key].slower and fixed[key].ratio == pytest.approx(1.5)  # the drift cancels out
    assert [k for k, c in fixed.items() if c.slower] == [key]
