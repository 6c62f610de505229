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


def test_timers_give_each_part_its_own_calls_and_are_removed_after() -> None:
    """--timers: step mode's flush counts once a step, in per-step copies only; the block tables' part
    only adds; own time never exceeds total; vLLM's own layer calls none of stagebuf's functions; and
    every timed function is put back after the run."""
    from stagebuf._engines.vllm_step_batch import StepBatch

    flush = StepBatch.flush
    names = ["vllm_uva", "stagebuf_step_pageable"]
    r = P.run(CPU, names, (1,), (False,), steps=12, warmup=4, k=5, trace=SMALL, timers=True)
    assert StepBatch.flush is flush
    runs = r["runs"]
    vllm, step = runs["vllm_uva|g1|idle"]["timers"], runs["stagebuf_step_pageable|g1|idle"]["timers"]
    assert list(step) == list(E.SECTIONS) and not any(vllm.values())

    def calls(part: str, fn: str) -> float:
        return sum(t["calls"] for t in step[part] if t["function"] == fn)

    assert calls("per_step_copies", "StepBatch.flush") == 1
    assert calls("block_tables", "StepBatch.flush") == 0
    assert calls("block_tables", "StepBatch.add") >= 1
    assert calls("per_step_copies", "vllm_step.close_window") >= 1
    for part in step.values():
        for t in part:
            assert -1e-6 <= t["own_us"] <= t["total_us"] + 1e-6, t


def test_timers_refuse_a_timed_function_that_does_not_exist(monkeypatch: pytest.MonkeyPatch) -> None:
    from stagebuf._rings.ring import Ring

    acquire = Ring.acquire
    monkeypatch.setattr(P, "TIMED", (*P.TIMED, ("stagebuf._rings.ring", "Ring", ("no_such_call",))))
    timers = P.Timers()
    with pytest.raises(AttributeError, match="TIMED: stagebuf._rings.ring has no function Ring.no_such_call"):
        timers.install()
    assert Ring.acquire is not acquire  # the entries before the missing one were timed
    timers.remove()
    assert Ring.acquire is acquire
