"""The nano-vllm bench workload on the CPU, small: it runs, checks identical inputs, and reports its targets.

nano-vllm's wheel is fetched from the package registry (``benchmarks.nanovllm_pkg``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from benchmarks import bench as B
from benchmarks import nanovllm_engine as NV
from benchmarks import nanovllm_pkg as P
from benchmarks import render_docs as R
from benchmarks import report as RP
from click.testing import CliRunner

TARGETS = {"nanovllm_decode_uva_vs_own", "nanovllm_prefill_uva_vs_own", "nanovllm_decode_pageable_vs_own",
           "nanovllm_graph_copies"}  # fmt: skip


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    if torch.cuda.is_available():
        pytest.skip("a CPU test of --quick; on a GPU run the workload itself (python -m benchmarks)")
    why = P.available()
    if why:
        pytest.skip(f"needs {P.DIST} {P.VERSION} from the package registry (pip download --no-deps): {why}")
    out = tmp_path_factory.mktemp("nv") / "r.json"
    res = CliRunner().invoke(B.bench, ["--quick", "--workload", "nanovllm", "--json", str(out)])
    assert res.exit_code == 0, res.output
    return json.loads(Path(out).read_text())


def test_quick_run_checks_and_times_every_cpu_setup(report: dict) -> None:
    nv = report["nanovllm"]
    assert nv["identical_inputs"] and nv["setups"] == ["own", "stagebuf_host", "stagebuf_pageable"]
    assert len(nv["checks"]) == 4 and all(c["steps"] == 60 for c in nv["checks"])
    for s in nv["setups"]:
        med = nv["medians"][f"{s}|idle"]
        assert med["prefill_us"] > 0 and med["decode_us"] > 0
    # the floor (the step's token lists into one array) is part of every setup's prefill
    floor = nv["medians"]["floor|idle"]["prefill_us"]
    assert 0 < floor < min(nv["medians"][f"{s}|idle"]["prefill_us"] for s in nv["setups"])
    assert nv["graph_writes"]["own"]["d2d_copies_per_step"] == 5.0
    assert nv["graph_writes"]["stagebuf_host"]["d2d_copies_per_step"] == 0.0


def test_targets_have_the_bench_shape(report: dict) -> None:
    ratios = report["ratios"]
    assert set(ratios) >= TARGETS
    for name in TARGETS:
        e = ratios[name]
        assert {"description", "workload", "op", "target", "measured", "passed"} <= set(e)
        assert e["workload"] == "nanovllm"
    assert ratios["nanovllm_graph_copies"]["measured"] is None  # no CUDA graphs on a CPU
    assert ratios["nanovllm_decode_pageable_vs_own"]["measured"] is not None
    assert R.current_targets() >= TARGETS


def test_tables_render(report: dict) -> None:
    titles = [t for t, _, _ in RP.nanovllm_tables(report)]
    assert titles[0].startswith("nanovllm: nano-vllm-fork 20260210") and "4/4 checks" in titles[0]
    md = R.tables(report)
    assert "#### nanovllm: nano-vllm-fork 20260210" in md and "`stagebuf_pageable`" in md
    assert [r[0] for r in RP.nanovllm_tables(report)[0][2]][-1] == "`floor (token lists into one array)`"


def test_a_missed_ratio_gives_its_reason_from_the_worse_gpu_state() -> None:
    """A missed ratio's ``why`` names the setup's and nano-vllm's medians in the worse GPU state (and,
    for prefill, the floor); a met one has none."""
    meds = {
        "own|idle": {"prefill_us": 400.0, "decode_us": 1000.0},
        "own|busy": {"prefill_us": 500.0, "decode_us": 1000.0},
        "stagebuf_uva|idle": {"prefill_us": 120.0, "decode_us": 50.0},
        "stagebuf_uva|busy": {"prefill_us": 250.0, "decode_us": 40.0},  # 0.5 of own: missed, here
        "stagebuf_pageable|idle": {"prefill_us": 100.0, "decode_us": 300.0},  # 0.3: missed
        "floor|idle": {"prefill_us": 20.0, "decode_us": float("nan")},
        "floor|busy": {"prefill_us": 30.0, "decode_us": float("nan")},
    }
    t = NV.targets({"medians": meds})
    pre = t["nanovllm_prefill_uva_vs_own"]
    assert pre["passed"] is False and pre["measured"] == 0.5
    floor = "the floor (token lists into one array) 30.0 µs"
    assert pre["why"] == f"stagebuf_uva 250.0 µs against own 500.0 µs (busy GPU); {floor}"
    dec = t["nanovllm_decode_pageable_vs_own"]
    assert (
        dec["passed"] is False and dec["why"] == "stagebuf_pageable 300.0 µs against own 1000.0 µs (idle GPU)"
    )
    assert t["nanovllm_decode_uva_vs_own"]["passed"] is True and "why" not in t["nanovllm_decode_uva_vs_own"]
