"""benchmarks.engine_profile on the CPU: each part's profile holds the calls that part makes.

vLLM's real MRV2 modules (``vllm_mrv2.NEWEST``'s, fetched as for tests/bench/test_engine.py), a small trace.
"""

from __future__ import annotations

import cProfile

import click
import pytest
import torch
from benchmarks import engine as E
from benchmarks import engine_profile as P
from benchmarks.report import profile_markdown

CPU = torch.device("cpu")
SMALL = {"max_num_reqs": 24, "max_model_len": 256, "max_num_batched_tokens": 192, "running": 16,
         "prompt": (16, 120), "output": (1, 6)}  # fmt: skip

pytestmark = pytest.mark.usefixtures("vllm_interpreted")


def _calls(run: dict, part: str, *names: str) -> float:
    """Calls per step of the functions of ``part`` whose name contains each of ``names`` (0 if none)."""
    return sum(t["calls"] for t in run["parts"][part]["top"] if all(n in t["function"] for n in names))


def test_each_part_profiles_its_own_calls() -> None:
    names = ["vllm_uva", "stagebuf_step_pageable"]
    r = P.run(CPU, names, (1,), (False,), steps=12, warmup=4, k=400, trace=SMALL)
    assert set(r["runs"]) == {"vllm_uva|g1|idle", "stagebuf_step_pageable|g1|idle"}
    vllm, step = r["runs"]["vllm_uva|g1|idle"], r["runs"]["stagebuf_step_pageable|g1|idle"]
    for run in (vllm, step):
        assert list(run["sections_us"]) == list(run["floor_us"]) == list(E.SECTIONS)
    # vLLM's own layer: its BlockTables apply is in block_tables, its two copies in per_step_copies
    assert _calls(vllm, "block_tables", "block_table.py") >= 1
    assert _calls(vllm, "per_step_copies", "async_tensor_h2d") == 2
    assert _calls(vllm, "request_writes", "StepBatch") == 0
    # step mode: the last copy flushes the step's batch, once a step; the parts before it only add
    assert _calls(step, "per_step_copies", "vllm_step_batch.py:", "(flush)") == 1
    assert _calls(step, "block_tables", "vllm_step_batch.py:", "(flush)") == 0
    assert _calls(step, "block_tables", "vllm_step_batch.py:", "(add)") >= 1
    assert step["parts"]["block_tables"]["profiled_us"] > 0


def test_an_unknown_or_own_api_setup_is_refused_naming_the_allowed_ones() -> None:
    for bad in ("stagebuf_own_pageable", "nope"):
        with pytest.raises(click.BadParameter, match=f"{bad}; allowed: vllm_uva, "):
            P.run(CPU, ["vllm_uva", bad], (1,), (False,), steps=6, warmup=2, k=5, trace=SMALL)


def test_a_part_never_called_has_an_empty_profile() -> None:
    """A part no step after the warm-up calls (no arrivals: no request writes) reads as nothing."""
    assert P.top(cProfile.Profile(), steps=5, k=3) == {"profiled_us": 0.0, "top": []}


def test_the_markdown_lists_each_parts_time_floor_and_top_functions() -> None:
    r = P.run(CPU, ["vllm_uva"], (1,), (False,), steps=8, warmup=2, k=3, trace=SMALL)
    md = profile_markdown(r)
    assert md.startswith("#### vllm_uva|g1|idle")
    rows = [ln for ln in md.splitlines() if ln.split(" | ")[0] in E.SECTIONS]
    assert [ln.split(" | ")[0] for ln in rows] == list(E.SECTIONS)
    assert "async_tensor_h2d" in next(ln for ln in rows if ln.startswith("per_step_copies"))
