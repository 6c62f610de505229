"""``python -m benchmarks.vs_vllm --json``: a run of the vs-vLLM cells alone is one side of
``benchmarks.compare`` (vLLM's own classes, ``vllm_mrv2.NEWEST``'s, against stagebuf's, on this CPU: its
Triton kernels in the interpreter). Skips where vLLM's files cannot be fetched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmarks import compare as C
from benchmarks import vs_vllm
from benchmarks.harness import env_var
from click.testing import CliRunner

pytestmark = pytest.mark.usefixtures("vllm_interpreted")


def test_two_runs_are_a_compare_of_every_cell_they_timed(tmp_path: Path) -> None:
    files = [tmp_path / f"vs{i}.json" for i in range(2)]
    args = ["--repeats", "2", "--steps", "3", "--edits", "1,16", "--lengths", "1"]
    with env_var("STAGEBUF_BENCH_COMMIT", "abc1234"):
        for f in files:
            got = CliRunner().invoke(vs_vllm.main, ["--json", str(f), *args])
            assert got.exit_code == 0, got.output
    reports = [json.loads(f.read_text()) for f in files]
    assert all(r["commit"] == "abc1234" and r["device"] == "cpu" for r in reports)
    raw = reports[0]["vs_vllm"]["raw_us"]
    # every peer of every cell, two repeats each: vLLM's own classes and stagebuf's CPU tiers
    assert {"pool|k1", "writes|1x1", "fused|16x1", "stage|16x1"} <= set(raw)
    assert {"vllm_uva", "stagebuf_host", "stagebuf_pageable"} <= set(raw["writes|1x1"])
    assert all(len(v) == 2 for per in raw.values() for v in per.values())
    cells = C.pair(reports[:1], reports[1:], "e2e_us")
    assert len(cells) == sum(len(per) for per in raw.values())
    assert {c.key for c in cells if c.ours} == {
        f"vs_vllm {cell} {name}" for cell, per in raw.items() for name in per if name.startswith("stagebuf")
    }
