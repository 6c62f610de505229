"""The end-to-end workload's parts that need no GPU: prompts, the pinning refusal, the step recorder on
nano-vllm's real runner, and the report (medians, targets, verdicts, Markdown, chart) against numpy."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from benchmarks import e2e as E
from benchmarks import nanovllm_pkg as P
from benchmarks import report as R
from benchmarks.targets import misses
from hypothesis import given, settings
from hypothesis import strategies as st

import stagebuf
from helpers import nano_or_skip


def test_prompts_are_seeded_in_range_and_share_prefixes() -> None:
    w = E.Workload(200, (5, 40), (3, 9), shared_prefix=0.5, prefix_len=16)
    a, la = E.prompts(w, 1000, seed=3)
    b, lb = E.prompts(w, 1000, seed=3)
    c, _ = E.prompts(w, 1000, seed=4)
    assert (a, la) == (b, lb) and a != c
    assert all(1 <= t < 1000 for p in a for t in p) and all(3 <= n <= 9 for n in la)
    heads = Counter(tuple(p[:16]) for p in a if len(p) >= 16)
    shared = {h for h, n in heads.items() if n > 1}  # a random 16-token head does not repeat
    prefixed = [p for p in a if tuple(p[:16]) in shared]
    assert len(shared) == 4 and 60 <= len(prefixed) <= 140  # about half, of four prefixes
    assert all(16 + 5 <= len(p) <= 16 + 40 for p in prefixed)
    assert all(5 <= len(p) <= 40 for p in a if tuple(p[:16]) not in shared)


def test_refuse_pinning_raises_like_a_machine_without_it_and_restores_torch() -> None:
    real = (torch.tensor, torch.zeros, torch.empty, torch.Tensor.pin_memory)
    with E.refuse_pinning():
        for f in (torch.tensor, torch.zeros, torch.empty):
            with pytest.raises(RuntimeError, match="pinned memory"):
                f([1, 2] if f is torch.tensor else 2, pin_memory=True)
        with pytest.raises(RuntimeError, match="pinned memory"):
            torch.ones(2).pin_memory()
        assert torch.zeros(3, dtype=torch.int32).tolist() == [0, 0, 0]
        assert torch.tensor([4, 5]).tolist() == [4, 5]
    assert (torch.tensor, torch.zeros, torch.empty, torch.Tensor.pin_memory) == real


@pytest.fixture(scope="module")
def nano() -> P.Nano:
    return nano_or_skip()


@pytest.mark.parametrize("attached", [False, True], ids=["own", "stagebuf"])
def test_the_recorder_times_the_runners_preparation_and_gives_it_back_unchanged(
    nano: P.Nano, tmp_path: Path, attached: bool
) -> None:
    import stagebuf.nanovllm as sn

    cfg = P.config(tmp_path / "model", max_num_seqs=8, max_num_batched_tokens=4096, max_model_len=1024)
    r = P.runner(cfg)
    P.own_buffers(r)
    r.sampler = object()
    if attached:
        sn.attach(r)
    before = dict(r.__dict__)
    seqs = [nano.sequence.Sequence(list(range(1, 20 + i))) for i in range(3)]
    bm = nano.block_manager.BlockManager(cfg.num_kvcache_blocks, cfg.kvcache_block_size)
    for s in seqs:
        bm.allocate(s)
    with E.Recorder(r) as rec:
        assert all(r.__dict__[n] is not before.get(n) for n in (*E.Recorder.PREP, "run_model"))
        assert r.sampler is not before["sampler"]
        ctx = P.own_path_on_cpu() if not attached else stagebuf_cpu()
        with ctx:
            ids, pos = r.prepare_prefill(seqs)
            r.prepare_sample(seqs)
        assert rec.prep_s > 0
    assert r.__dict__ == before
    assert ids.tolist() == [t for s in seqs for t in s.token_ids]
    assert pos.tolist() == [p for s in seqs for p in range(len(s))]
    nano.context.reset_context()
    if attached:
        sn.detach(r)


def stagebuf_cpu() -> Any:
    from contextlib import nullcontext

    stagebuf.reset_capabilities()
    return nullcontext()


# --- the report ------------------------------------------------------------------------------------

KINDS = ("decode", "prefill")
MS = ("tokens_per_s", "step_ms", "prep_ms", "forward_ms", "sample_ms", "rest_ms")


def _measured(rng: np.random.Generator, rounds: int, same: bool = True) -> dict[str, Any]:
    runs = []
    for w in ("decode", "prefill", "mixed"):
        for s in (*E.SETUPS, E.NOPIN):
            for rnd in range(rounds):
                row: dict[str, Any] = {
                    "setup": s, "workload": w, "round": rnd, "tier": None, "wall_s": float(rng.uniform(1, 2)),
                    "generated": int(rng.integers(100, 900)), "identical": same or s != "stagebuf_pinned",
                }  # fmt: skip
                for k in KINDS:
                    row[k] = {key: float(rng.uniform(0.01, 2e4)) for key in MS}
                    row[k]["prep_share"] = float(rng.uniform(0, 0.3))
                runs.append(row)
    return {
        "workloads": {"decode": {}, "prefill": {}, "mixed": {}}, "runs": runs, "rounds": rounds,
        "attention": "triton stand-in", "no_pin": {"own_error": "RuntimeError: no pinned memory"},
    }  # fmt: skip


def _np_median(m: dict[str, Any], setup: str, w: str, kind: str, key: str) -> float:
    return float(np.median([r[kind][key] for r in m["runs"] if r["setup"] == setup and r["workload"] == w]))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rounds=st.integers(1, 5), same=st.booleans())
def test_summary_medians_and_targets_equal_numpys(seed: int, rounds: int, same: bool) -> None:
    m = _measured(np.random.default_rng(seed), rounds, same)
    s = E.summarize(m)
    for w in ("decode", "prefill", "mixed"):
        for setup in (*E.SETUPS, E.NOPIN):
            row = s["table"][w][setup]
            for kind in KINDS:
                for key in ("tokens_per_s", "prep_share", "forward_ms"):
                    assert row[f"{kind}_{key}"] == pytest.approx(_np_median(m, setup, w, kind, key))
            assert row["identical"] is (same or setup != "stagebuf_pinned")

    def ratio(w: str, kind: str, a: str, b: str) -> float:
        return _np_median(m, a, w, kind, "tokens_per_s") / _np_median(m, b, w, kind, "tokens_per_s")

    want = {
        "e2e_nanovllm_decode_uva_vs_own": ratio("decode", "decode", "stagebuf_uva", "own"),
        "e2e_nanovllm_decode_pageable_vs_own": ratio("decode", "decode", "stagebuf_pageable", "own"),
        "e2e_nanovllm_decode_nopin_vs_own": ratio("decode", "decode", E.NOPIN, "own"),
        "e2e_nanovllm_prefill_uva_vs_own": ratio("prefill", "prefill", "stagebuf_uva", "own"),
        "e2e_nanovllm_prep_share_uva": _np_median(m, "stagebuf_uva", "decode", "decode", "prep_share"),
        "e2e_nanovllm_tokens_identical": 1.0 if same else 1 - 3 * rounds / len(m["runs"]),
    }
    assert set(s["ratios"]) == set(E.GOALS) == set(want)
    for name, v in want.items():
        r = s["ratios"][name]
        assert r["measured"] == pytest.approx(v, abs=1e-4)
        ok = v >= r["target"] if r["op"] == ">=" else v <= r["target"]
        assert r["status"] == ("pass" if ok else "fail")
        assert ("why" in r) is (not ok)
    assert len(misses(s)) == sum(r["status"] == "fail" for r in s["ratios"].values())


def test_a_run_without_the_nopin_engine_leaves_its_target_unjudged() -> None:
    m = _measured(np.random.default_rng(0), 2)
    m["runs"] = [r for r in m["runs"] if r["setup"] != E.NOPIN]
    s = E.summarize(m)
    assert s["ratios"]["e2e_nanovllm_decode_nopin_vs_own"]["status"] == "skipped"
    assert E.NOPIN not in s["table"]["decode"]


def test_markdown_names_machine_command_and_commit_once_and_the_chart_is_drawn(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    m = _measured(np.random.default_rng(1), 3)
    report = {
        "command": "python -m benchmarks.e2e --rounds 3", "commit": "0123456789abcdef",
        "device_name": "NVIDIA H200", "shape": "qwen3-0.6b", "measured": m, "summary": E.summarize(m),
    }  # fmt: skip
    text = R.e2e_markdown(report)
    assert text.count("NVIDIA H200") == 1 and text.count("0123456789") == 1
    assert text.count("python -m benchmarks.e2e --rounds 3") == 1
    rows = [ln for ln in text.splitlines() if ln.startswith("| decode |")]
    assert len(rows) == 5
    assert "no pinned memory" in text
    (tmp_path / "r.json").write_text(json.dumps(report))
    R.e2e_plot(json.loads((tmp_path / "r.json").read_text()), tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


# --- the workloads on nano-vllm's own scheduler (no model) -------------------------------------------


class _Runner:
    """A model runner that samples token 1 for every sequence and counts the prefix-cache hits."""

    def __init__(self) -> None:
        self.hit_tokens = 0
        self.prefill_steps = 0

    def call(self, name: str, seqs: list[Any], is_prefill: bool) -> list[int]:
        assert name == "run"
        if is_prefill:
            self.prefill_steps += 1
            self.hit_tokens += sum(s.num_cached_tokens for s in seqs)
        return [1] * len(seqs)


@pytest.mark.parametrize("name", list(E.WORKLOADS))
def test_each_workload_runs_on_nanovllms_scheduler_without_preemption_and_mixed_hits_the_prefix_cache(
    nano: P.Nano, tmp_path: Path, name: str
) -> None:
    """nano-vllm's own LLMEngine.step, Scheduler and BlockManager, with the engine settings and the
    KV-cache blocks of the committed H200 run: every request finishes with its token count, no sequence
    is preempted (nano-vllm 20260210's preemption can break its scheduler), and the mixed workload hits
    the prefix cache."""
    committed = json.loads((Path(__file__).parents[2] / "benchmarks/results/h200-e2e.json").read_text())
    e = E.EngineConfig()
    cfg = P.config(
        tmp_path / "m", max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens,
        max_model_len=e.max_model_len, num_kvcache_blocks=committed["measured"]["kv_cache_blocks"]["own"],
    )  # fmt: skip
    engine = nano.llm_engine.LLMEngine.__new__(nano.llm_engine.LLMEngine)
    engine.scheduler = nano.scheduler.Scheduler(cfg)
    engine.model_runner = runner = _Runner()
    preempted: list[Any] = []
    real = engine.scheduler.preempt
    engine.scheduler.preempt = lambda s: (preempted.append(s), real(s))  # type: ignore[method-assign]
    w = E.WORKLOADS[name]
    toks, _ = E.generate(engine, w, seed=0, vocab=151936, rec=None)
    _, lens = E.prompts(w, 151936, seed=0)
    assert [len(t) for t in toks] == lens
    assert preempted == []
    if name == "mixed":
        assert runner.hit_tokens >= 256 * 20, runner.hit_tokens  # at least 20 shared blocks reused
    else:
        assert runner.hit_tokens == 0
