"""The engine and vs-vLLM targets say why they missed, from the numbers of the same run (no GPU needed)."""

from __future__ import annotations

from benchmarks import engine as E
from benchmarks import vs_vllm as V


def _sections(writes: float, publish: float, tables: float, copies: float) -> dict[str, float]:
    return dict(zip(E.SECTIONS, (writes, publish, tables, copies)))


def test_a_missed_busy_ratio_names_the_part_that_grew_and_the_guard_waits() -> None:
    meds = {
        "vllm_uva|g1|idle": {"prep_us": 1000.0, "buffer_us": 500.0},
        "vllm_uva|g1|busy": {"prep_us": 1000.0, "buffer_us": 500.0},
        "stagebuf_step_uva|g1|idle": {"prep_us": 800.0, "buffer_us": 300.0},
        "stagebuf_step_uva|g1|busy": {"prep_us": 960.0, "buffer_us": 380.0},  # busy/idle 1.2: +0.2
    }
    runs = {
        "stagebuf_step_uva|g1|idle": [{"sections_us": _sections(100, 20, 60, 120), "guard_waits": 0}],
        "stagebuf_step_uva|g1|busy": [
            {"sections_us": _sections(100, 20, 60, 300), "guard_waits": 2},
            {"sections_us": _sections(110, 25, 70, 200), "guard_waits": 1},
        ],
    }
    res = {
        "medians": meds,
        "runs": runs,
        "setups": ["vllm_uva", "stagebuf_step_uva"],
        "vllm_version": "0.34.0",
    }
    t = E.targets(res)["engine_busy_ratio_vs_vllm_v034"]
    assert t["passed"] is False and t["measured"] == 0.2
    assert t["why"] == (
        "the part that grows most on the busy GPU (stagebuf_step_uva, 1g, last run, mean µs a step): "
        "per_step_copies 120.0 -> 200.0; guard waits in its busy runs: 3"
    )


def test_a_missed_staged_write_cell_splits_staging_from_the_apply() -> None:
    med = {
        "writes|16x1": {"stagebuf_uva": 30.0, "vllm_uva": 60.0},  # 0.5: met
        "writes|256x1": {"stagebuf_uva": 105.0, "vllm_uva": 150.0},  # 0.7: the worst cell, missed
        "stage|256x1": {"stagebuf_uva": 70.0, "vllm_uva": 120.0},
    }
    t = V.targets({"median_us": med, "vllm_version": "0.33.0"})["vllm_staged_write_per_cell"]
    assert t["passed"] is False and t["measured"] == 0.7
    assert t["why"] == (
        "E x L = 256x1: stagebuf 105.0 µs (70.0 staging + 35.0 apply) against "
        "vLLM 0.33 150.0 µs (120.0 staging + 30.0 apply)"
    )
    assert "/ vLLM 0.33's on UVA" in t["description"]
    newest = E.vllm_mrv2.NEWEST.rpartition(".")[0]  # a run that does not say: the harness's newest
    assert f"vLLM {newest} 150.0" in V.targets({"median_us": med})["vllm_staged_write_per_cell"]["why"]


def test_a_missed_backed_copy_names_the_cost_of_a_call_and_of_the_guard() -> None:
    med = {
        "backed|k8": {"stagebuf_uva": 24.0, "vllm_uva": 24.0},  # 1.0: missed
        "backed|k1": {"stagebuf_uva": 7.0, "vllm_uva": 3.5},
        "pool|k8": {"stagebuf_uva": 12.0, "vllm_uva": 24.0},  # 0.5: met, no reason
        "pool|k1": {"stagebuf_uva": 4.0, "vllm_uva": 3.5},
    }
    t = V.targets({"median_us": med})
    b = t["vllm_backed_copy_to_uva"]
    assert b["passed"] is False and b["why"] == (
        "a call: 3.00 µs against vLLM's 3.00; with one call a step (each pays the slot guard's event record "
        "and query) 7.0 against 3.5: vLLM's has no guard"
    )
    assert t["vllm_pool_copy_to_uva"]["passed"] is True and "why" not in t["vllm_pool_copy_to_uva"]


def _dropin(release: str, tables: float) -> dict[str, object]:
    """An engine run where =1 on UVA is at 0.8 of vLLM's buffer work, its block tables at ``tables`` µs
    against vLLM's 100."""
    meds = {
        f"{s}|g1|{m}": {"prep_us": 1000.0 * f, "buffer_us": 500.0 * f}
        for s, f in (("vllm_uva", 1.0), ("stagebuf_dropin_uva", 0.8))
        for m in ("idle", "busy")
    }
    runs = {
        "vllm_uva|g1|busy": [{"sections_us": _sections(200, 50, 100, 150)}],
        "stagebuf_dropin_uva|g1|busy": [{"sections_us": _sections(100, 40, tables, 60)}],
    }
    return {
        "medians": meds,
        "runs": runs,
        "setups": ["vllm_uva", "stagebuf_dropin_uva"],
        "vllm_version": release,
    }


def test_engine_targets_carry_their_release_and_its_goals() -> None:
    new = E.targets(_dropin("0.34.0", 100.0))
    old = E.targets(_dropin("0.33.0", 100.0))
    assert E.release_suffix("0.34.0") == "_v034" and E.release_suffix("1.2.3") == "_v102"
    t34, t33 = new["engine_dropin_uva_vs_vllm_uva_g1_v034"], old["engine_dropin_uva_vs_vllm_uva_g1_v033"]
    assert t34["measured"] == t33["measured"] == 0.8
    assert (t34["target"], t34["passed"]) == (0.9, True)  # 0.34's goal
    assert (t33["target"], t33["passed"]) == (0.7, False)  # 0.33's goal
    assert not any(k.endswith("_v033") for k in new) and not any(
        k.endswith("_v034") and "engine" in k for k in old
    )


def test_dropin_on_the_newest_release_fails_where_a_part_is_slower_than_vllms() -> None:
    t = E.targets(_dropin("0.34.0", 120.0))["engine_dropin_uva_vs_vllm_uva_g1_v034"]
    assert t["measured"] == 0.8 and t["passed"] is False
    assert t["why"] == "slower than vLLM's own in block_tables 120.0 µs against 100.0"


def test_the_prompt_target_takes_the_worst_kind_and_length() -> None:
    med = {
        "prompt|tokens|16": {"stagebuf_uva": 30.0, "vllm_uva": 40.0},
        "prompt|list|131072": {"stagebuf_uva": 900.0, "vllm_uva": 1500.0},
        "prompt|ndarray|131072": {"stagebuf_uva": 66.0, "vllm_uva": 60.0},  # 1.1: the worst, missed
    }
    t = V.targets({"median_us": med, "vllm_version": "0.34.0"})["vllm_stage_prompt_v034"]
    assert t["passed"] is False and t["measured"] == 1.1 and t["worst_note"] == "ndarray|131072"
    assert t["why"] == "ndarray|131072: stagebuf 66.0 µs against vLLM 0.34's 60.0"
