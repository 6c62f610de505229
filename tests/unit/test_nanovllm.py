"""stagebuf.nanovllm on nano-vllm-fork 20260210's real code, on the CPU tiers (HOST, PAGEABLE).

nano-vllm is fetched from the package registry at test time (``benchmarks.nanovllm_pkg``; no
nano-vllm code is committed) and run as released: its Scheduler and BlockManager drive the
traces, its ModelRunner's own ``prepare_*`` and ``run_model`` are the reference. On a machine
without CUDA nano-vllm's own path cannot run (``pin_memory=True`` raises); the reference then
runs under ``nanovllm_pkg.own_path_on_cpu``: the same code, with ``pin_memory`` dropped and
``.cuda()`` a CPU copy. Every step compares every tensor the runner hands the model and the
sampler, and the attention context (``benchmarks.nanovllm_engine.check``).
"""

from __future__ import annotations

import ast
import dataclasses
import gc
import json
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from benchmarks import nanovllm_engine as NE
from benchmarks import nanovllm_pkg as P
from benchmarks.engine import stagebuf_tier
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stagebuf
import stagebuf.nanovllm as sn
from helpers import nano_or_skip

# HOST needs a CPU device; on a GPU machine PAGEABLE targets the GPU (tests/gpu has the GPU tiers)
TIERS = ["stagebuf_pageable"] if torch.cuda.is_available() else ["stagebuf_host", "stagebuf_pageable"]


@pytest.fixture(scope="module")
def nano() -> P.Nano:
    return nano_or_skip()


@pytest.fixture
def work(tmp_path: Path, nano: P.Nano) -> Path:
    return tmp_path


SMALL = NE.TraceConfig(max_num_seqs=64, running=64, max_num_batched_tokens=4096, steps=80)

TRACES = {
    # about 256 running sequences, arrivals, shared prefixes, finishes by EOS and max_tokens
    "busy": NE.TraceConfig(steps=150),
    "cfg": dataclasses.replace(SMALL, cfg=True, running=32),
    "graphs": SMALL,
    # a KV cache of 20 blocks: the scheduler preempts, and the preempted sequence is prefilled again
    "preempt": dataclasses.replace(SMALL, num_kvcache_blocks=20, arrivals_per_step=4, seed=1, steps=300),
}


@pytest.mark.parametrize("setup", TIERS)
@pytest.mark.parametrize("trace", list(TRACES))
def test_identical_inputs_on_nanovllms_scheduler_trace(setup: str, trace: str, work: Path) -> None:
    r = NE.check(setup, TRACES[trace], work, graphs=trace == "graphs")
    assert r["mismatches"] == [], r
    assert r["steps"] == TRACES[trace].steps
    assert r["prefill_steps"] > 0 and r["steps"] - r["prefill_steps"] > 0
    assert r["prefix_hits"] > 0 and r["finished"] > 0
    assert r["scheduler_error"] is None
    if trace == "preempt":
        assert r["preempted"] > 0 and r["reprefills"] > 0


def test_the_check_finds_a_difference(work: Path) -> None:
    """It can fail: one slot of one step's context changed after preparation is reported."""

    def tamper(runner: Any, i: int) -> None:
        if i == 5:
            c = P.load().context.get_context()
            c.slot_mapping[0] += 1

    r = NE.check(TIERS[0], dataclasses.replace(SMALL, steps=10), work, tamper=tamper)
    assert (
        len(r["mismatches"]) == 1
        and r["mismatches"][0].startswith("step 5 ")
        and "slot_mapping" in r["mismatches"][0]
    ), r


def test_the_two_pass_check_used_with_steps_in_flight(work: Path) -> None:
    """check_in_flight's replay of the trace is the same trace (on the GPU it runs with a busy device)."""
    r = NE.check_in_flight("stagebuf_pageable", dataclasses.replace(SMALL, steps=50), work, 0)
    assert r["mismatches"] == [] and r["steps"] == 50, r


def test_identical_inputs_in_check_mode(work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """STAGEBUF_CHECK=1 poisons every slot as its step begins: nothing reads a slot before publication."""
    monkeypatch.setenv("STAGEBUF_CHECK", "1")
    stagebuf.reset_capabilities()
    r = NE.check("stagebuf_pageable", dataclasses.replace(SMALL, steps=40), work, graphs=True)
    assert r["mismatches"] == [], r


def test_nanovllms_scheduler_raises_index_error_after_a_preemption(work: Path) -> None:
    """A finding about nano-vllm-fork 20260210, not stagebuf: with a small KV cache its decode
    scheduling preempts another sequence (``self.preempt(other_seq)``) without taking it out of
    ``running``; a later step's ``BlockManager.may_append`` reads its emptied block table and
    raises IndexError. Up to that step the inputs are identical."""
    cfg = dataclasses.replace(SMALL, num_kvcache_blocks=30, arrivals_per_step=4, seed=0, steps=300)
    trace = NE.Trace(cfg, work)
    left = []
    while (step := trace.next()) is not None:
        left += [s for s in trace.scheduler.running if s.status.name == "WAITING" and not s.block_table]
        trace.post(step[0])
    assert trace.preempted >= 1 and left, "no preempted sequence was left in running"
    assert trace.scheduler_error is not None and "IndexError" in trace.scheduler_error
    r = NE.check(TIERS[0], cfg, work)
    assert r["mismatches"] == [] and r["preempted"] >= 1 and "IndexError" in (r["scheduler_error"] or "")


# --- without pinned memory -----------------------------------------------------------------------


def test_own_path_fails_without_pinned_memory_and_stagebuf_gives_its_inputs(work: Path) -> None:
    """On a machine without a pinned-memory allocator (here: this CPU-only torch, whose
    ``pin_memory=True`` raises RuntimeError as it does there), nano-vllm cannot even build its
    runner's buffers, nor prepare a step. With the ModelRunner class attached it builds, and every
    step gets the inputs nano-vllm's own code computes (``own_path_on_cpu``)."""
    if torch.cuda.is_available():
        pytest.skip("this machine has pinned memory: tests/gpu/test_gpu_nanovllm.py simulates its absence")
    nano = P.load()
    mr = nano.model_runner.ModelRunner
    trace = NE.Trace(dataclasses.replace(SMALL, steps=60), work)
    bare = P.runner(trace.config)
    with pytest.raises(RuntimeError, match="pin"):
        bare._allocate_sample_buffers()
    seqs, pre = trace.next() or ([], True)
    with pytest.raises(RuntimeError, match="pin"):
        bare.prepare_prefill(seqs)

    ref = P.runner(trace.config)
    P.own_buffers(ref)
    sn.attach(mr)
    try:
        r = P.runner(trace.config)
        r._allocate_sample_buffers()  # what __init__ calls: pinning fails, logged once, not raised
        assert sn.is_attached(r) and not hasattr(r, "_cpu_input_ids")
        nano.context.reset_context()
        steps = 0
        while steps < 60:
            with P.own_path_on_cpu():
                a = NE.snapshot(nano, NE.prepare(ref, seqs, pre))
            b = NE.snapshot(nano, NE.prepare(r, seqs, pre))
            assert NE.differences(a, b) == [], f"step {steps}"
            trace.post(seqs)
            steps += 1
            nxt = trace.next()
            if nxt is None:
                break
            seqs, pre = nxt
        assert steps == 60 and trace.prefill_steps > 0
    finally:
        sn.detach(mr)
    assert not sn.is_attached(mr)


# --- attach and detach ---------------------------------------------------------------------------


class _Engine:
    def __init__(self, runner: Any):
        self.model_runner = runner


def test_attach_and_detach_are_idempotent(work: Path) -> None:
    nano = P.load()
    mr = nano.model_runner.ModelRunner
    trace = NE.Trace(SMALL, work)
    r = P.runner(trace.config)
    own = r.prepare_decode.__func__
    assert own is mr.prepare_decode and not sn.is_attached(r)
    runner_before, class_before = dict(vars(r)), dict(vars(mr))
    sn.attach(r)
    sn.attach(r)
    assert sn.is_attached(r) and r.prepare_decode.__func__ is not own
    # the runner holds the five replacing methods, bound to it, and nothing else of stagebuf's
    assert set(vars(r)) - set(runner_before) == set(sn.METHODS)
    assert all(getattr(r, m).__self__ is r for m in sn.METHODS)
    first = sn._PREPS[r]
    sn.attach(_Engine(r))  # an LLM reaches its model_runner
    assert sn._PREPS[r] is first
    assert sn.stats(r)["tier"] in ("HOST", "PAGEABLE")
    sn.detach(_Engine(r))
    sn.detach(r)
    assert not sn.is_attached(r) and r.prepare_decode.__func__ is own
    assert r not in sn._PREPS and sn.stats(r) == {"attached": False, "prepared": False}
    assert _same_entries(vars(r), runner_before)
    sn.attach(mr)
    sn.attach(mr)
    assert sn.is_attached(r) and mr.prepare_decode is not own
    sn.detach(mr)
    sn.detach(mr)
    assert mr.prepare_decode is own and not sn.is_attached(mr)
    assert _same_entries(vars(mr), class_before)


def _same_entries(now: Any, before: dict[str, Any]) -> bool:
    """The same names, each the very object it was."""
    return set(now) == set(before) and all(now[k] is before[k] for k in before)


def test_a_runner_attached_through_its_class_keeps_stagebufs_state_outside_it(work: Path) -> None:
    """With the class attached a runner prepares on stagebuf without one attribute of stagebuf's own; its
    state is kept by stagebuf, and goes when the runner goes."""
    mr = P.load().model_runner.ModelRunner
    trace = NE.Trace(SMALL, work)
    r = P.runner(trace.config)
    before = dict(vars(r))
    sn.attach(mr)
    try:
        seqs, pre = trace.next() or ([], True)
        with stagebuf_tier(TIERS[0].split("_", 1)[1]):
            NE.prepare(r, seqs, pre)
        assert sn.stats(r)["prepared"] and sn.stats(r)["stager"]["steps"] == 1
        assert _same_entries(vars(r), before)
        sn.detach(r)  # the class stays attached: so does the runner, with its state
        assert sn.is_attached(r) and sn.stats(r)["prepared"]
        gone, prep = weakref.ref(r), weakref.ref(sn._PREPS[r])
        del r
        gc.collect()
        assert gone() is None and prep() is None
    finally:
        sn.detach(mr)


def test_nanovllm_py_writes_no_dunder_dict() -> None:
    """Issue 43 item 5: stagebuf.nanovllm changes nano-vllm's objects through setattr and delattr only;
    no ``__dict__`` is read or written by name, and no ``vars(...)`` mapping is changed."""
    src = Path(sn.__file__).read_text()
    tree = ast.parse(src)
    mutators = {"pop", "popitem", "setdefault", "update", "clear", "__setitem__", "__delitem__"}

    def namespace(node: ast.AST) -> bool:
        """``x.__dict__`` or ``vars(x)``."""
        return (isinstance(node, ast.Attribute) and node.attr == "__dict__") or (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars"
        )

    def bad(node: ast.AST) -> bool:
        if isinstance(node, ast.Attribute) and node.attr == "__dict__":
            return True
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
            return namespace(node.value)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            return node.func.attr in mutators and namespace(node.func.value)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            return bool(node.args) and namespace(node.args[0])
        return False

    found = [f"line {n.lineno}: {ast.get_source_segment(src, n)}" for n in ast.walk(tree) if bad(n)]
    assert found == []
    # the check finds each way of writing one
    for line in ("r.__dict__['x'] = 1", "vars(r)['x'] = 1", "del vars(r)['x']", "vars(r).pop('x')",
                 "r.__dict__.update(x=1)", "vars(r).setdefault('x', 1)", "y = r.__dict__"):  # fmt: skip
        assert any(bad(n) for n in ast.walk(ast.parse(line))), line
    assert not any(bad(n) for n in ast.walk(ast.parse("y = vars(r).get('x'); setattr(r, 'x', 1)")))


def test_attach_refuses_what_is_not_nanovllm() -> None:
    for bad in (object(), 3, _Engine(object()), int):
        with pytest.raises(stagebuf.ArgumentTypeError, match="target=") as e:
            sn.attach(bad)
        assert isinstance(e.value, TypeError) and "ModelRunner" in str(e.value)


def test_an_untested_version_is_refused_and_nothing_is_attached(
    work: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nano = P.load()
    r = P.runner(NE.Trace(SMALL, work).config)
    assert sn._distribution(type(r)) == (P.DIST, P.VERSION)
    before = dict(vars(r))
    monkeypatch.setattr(sn, "_distribution", lambda cls: ("nano-vllm-fork", "20990101"))
    for target in (r, nano.model_runner.ModelRunner):
        with pytest.raises(sn.NanoVllmVersionError) as e:
            sn.attach(target)
        assert isinstance(e.value, stagebuf.StagebufError)
        assert "20990101" in str(e.value) and "nano-vllm-fork 20260210" in str(e.value)
        assert e.value.allowed == ("nano-vllm-fork 20260210",)
        assert not sn.is_attached(target)
    assert r not in sn._PREPS and _same_entries(vars(r), before)


def test_a_changed_model_runner_is_refused(work: Path) -> None:
    mr = P.load().model_runner.ModelRunner

    class Changed(mr):  # type: ignore[misc, valid-type]
        def prepare_sample(self, seqs: Any, is_cfg_batch: bool = False, extra: int = 0) -> Any:
            return None

    Changed.__module__ = mr.__module__
    with pytest.raises(sn.NanoVllmVersionError, match="prepare_sample"):
        sn.attach(Changed)
    assert not sn.is_attached(Changed)


def test_status_reports_installation_and_tested_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    s = sn.status()
    assert s["tested_versions"] == ["nano-vllm-fork 20260210"]
    from importlib import metadata

    def version(name: str) -> str:
        if name == "nano-vllm-fork":
            return versions[0]
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(sn.metadata, "version", version)
    versions = ["20260210"]
    assert sn.status()["installed"] and sn.status()["tested"]
    versions = ["20250101"]
    s = sn.status()
    assert s["installed"] and not s["tested"] and "not tested" in s["note"]


# --- prepare_sample's flags and random batches ---------------------------------------------------


def _seqs(nano: P.Nano, prompts: list[list[int]], params: list[Any], cached_bm: Any) -> list[Any]:
    seqs = [nano.sequence.Sequence(p, sp) for p, sp in zip(prompts, params)]
    for s in seqs:
        cached_bm.allocate(s)
    return seqs


def _pair(work: Path, setup: str) -> tuple[Any, Any, Any]:
    trace = NE.Trace(SMALL, work)
    return trace, NE.make_runner(trace, "own"), NE.make_runner(trace, setup)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.lists(
        st.tuples(
            st.integers(1, 700),  # prompt length
            st.booleans(),  # starts with the shared 256-token prefix
            st.sampled_from([None, 1, 40]),
            st.sampled_from([None, 0.5, 1.0]),
            st.sampled_from([1.0, 1.2, 0.9]),
            st.sampled_from([1.0, 2.5]),
            st.integers(0, 3),  # decode tokens appended
        ),
        min_size=1,
        max_size=24,
    ),
    setup=st.sampled_from(TIERS),
)
def test_random_batches_match_nanovllms_own(work: Path, data: list[tuple[Any, ...]], setup: str) -> None:
    """Random prompts (some sharing a prefix: cache hits), sampling parameters (the flags) and decode
    lengths, through nano-vllm's own BlockManager: prefill, decode, block tables and sampling match."""
    nano = P.load()
    trace, own, mine = _pair(work, setup)
    bm = trace.scheduler.block_manager
    rng = np.random.default_rng(len(data))
    prefix = rng.integers(3, 1000, 256).tolist()
    prompts = [(prefix if shared else []) + rng.integers(3, 1000, n).tolist() for n, shared, *_ in data]
    sp = nano.sampling_params.SamplingParams
    params = [sp(top_k=k, top_p=p, repetition_penalty=r, cfg_scale=c) for _, _, k, p, r, c, _ in data]
    seqs = _seqs(nano, prompts, params, bm)
    cfg_batch = len(seqs) >= 2 and data[0][5] > 1.0

    def both(call: Any) -> None:
        with stagebuf_tier(setup.split("_", 1)[1]):
            with P.own_path_on_cpu():
                a = NE.snapshot(nano, call(own))
            b = NE.snapshot(nano, call(mine))
        assert NE.differences(a, b) == []

    both(lambda r: (*r.prepare_prefill(seqs), r.prepare_sample(seqs, cfg_batch)))
    for i, s in enumerate(seqs):
        for t in range(data[i][6]):
            s.append_token(7 + t)
            bm.may_append(s)
    both(lambda r: (*r.prepare_decode(seqs), r.prepare_sample(seqs, cfg_batch)))
    both(lambda r: (r.prepare_block_tables(seqs), None, (None,) * 5))


def _same(nano: P.Nano, setup: str, own: Any, mine: Any, call: Any) -> None:
    """``call`` on nano-vllm's own runner and on stagebuf's: every tensor and the context equal."""
    with stagebuf_tier(setup.split("_", 1)[1]):
        with P.own_path_on_cpu():
            a = NE.snapshot(nano, call(own))
        nano.context.reset_context()
        b = NE.snapshot(nano, call(mine))
        nano.context.reset_context()
    assert NE.differences(a, b) == []


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.lists(
        st.tuples(
            st.integers(1, 900),  # prompt length
            st.integers(0, 900),  # num_cached_tokens (capped at the length)
            st.booleans(),  # has blocks (warmup's sequences have none)
        ),
        min_size=1,
        max_size=6,
    ),
    setup=st.sampled_from(TIERS),
)
def test_prefill_with_any_cached_count_and_warmup_sequences(
    work: Path, data: list[tuple[int, int, bool]], setup: str
) -> None:
    """A cached count anywhere in the prompt, on a block boundary or not (nano-vllm's BlockManager caches
    whole blocks, its prepare_prefill takes any count: the slots start at the first uncached block), one
    sequence or several (a block short in the middle of the slots), and warmup's sequences without
    blocks: the prefill, its block tables and the sampling arrays match nano-vllm's."""
    nano = P.load()
    trace, own, mine = _pair(work, setup)
    bm = trace.scheduler.block_manager
    rng = np.random.default_rng(len(data))
    seqs = []
    for length, cached, blocks in data:
        s = nano.sequence.Sequence(
            rng.integers(3, 1000, length).tolist(), nano.sampling_params.SamplingParams()
        )
        if blocks:
            bm.allocate(s)
        s.num_cached_tokens = min(cached, length)
        seqs.append(s)
    _same(nano, setup, own, mine, lambda r: (*r.prepare_prefill(seqs), r.prepare_sample(seqs, False)))


@pytest.mark.parametrize("setup", TIERS)
def test_the_sampling_arrays_go_in_the_step_of_their_prefill_or_decode(work: Path, setup: str) -> None:
    """prepare_sample called as run() calls it (the list its prepare_prefill or prepare_decode had, run()'s
    CFG rule) returns the arrays staged in that step: one stager step per engine step, the sampler's ring
    unused. Called otherwise (another list, the other flag, a second time, after prepare_block_tables, on a
    rank > 0) it stages its own. Every array matches nano-vllm's (a CFG trace: both batch kinds)."""
    nano = P.load()
    trace = NE.Trace(dataclasses.replace(SMALL, cfg=True, running=32, steps=40), work)
    own, mine = NE.make_runner(trace, "own"), NE.make_runner(trace, setup)
    for _ in range(40):
        step = trace.next()
        assert step is not None
        seqs, pre = step
        _same(nano, setup, own, mine, lambda r, seqs=seqs, pre=pre: NE.prepare(r, seqs, pre))
        trace.post(seqs)
    st = sn.stats(mine)
    assert st["stager"]["steps"] == 40 and st["sampler"]["steps"] == 0
    seqs, pre = trace.next() or ([], True)
    cfg = NE.is_cfg(seqs)
    assert cfg  # a CFG batch: its sampling arrays are half the batch's

    def then(r: Any, *before: str, batch: list[Any] = seqs, flag: bool = cfg) -> tuple[Any, ...]:
        ids, pos = r.prepare_prefill(seqs) if pre else r.prepare_decode(seqs)
        for name in before:
            getattr(r, name)(seqs, **({"is_cfg_batch": cfg} if name == "prepare_sample" else {}))
        return ids, pos, r.prepare_sample(batch, is_cfg_batch=flag)

    others = [
        lambda r: then(r, batch=list(seqs)),  # another list
        lambda r: then(r, flag=not cfg),  # the other flag
        lambda r: then(r, "prepare_sample"),  # a second time
        lambda r: then(r, "prepare_block_tables"),  # a step of the stager in between
    ]
    for i, call in enumerate(others):
        _same(nano, setup, own, mine, call)
        assert sn.stats(mine)["sampler"]["steps"] == i + 1
    one = seqs[:1]  # a CFG batch of one sequence: no sampling arrays (half of one is none)
    _same(nano, setup, own, mine, lambda r: (*r.prepare_prefill(one), r.prepare_sample(one, True)))
    assert sn.stats(mine)["sampler"]["steps"] == len(others)
    rank1 = P.runner(trace.config, NE.StandIn(nano, trace.config.hf_config.hidden_size))
    rank1.rank = 1  # run() calls prepare_sample on rank 0 only
    with stagebuf_tier(setup.split("_", 1)[1]):
        sn.attach(rank1)
    _same(nano, setup, own, rank1, lambda r: NE.prepare(r, seqs, pre))
    assert sn.stats(rank1)["sampler"]["steps"] == 1


def test_prepare_samples_flags_follow_nanovllm_exactly(work: Path) -> None:
    """top-k is handed on when one is > 0; top-p and the repetition penalty when one *equals* 1.0
    (nano-vllm 20260210, model_runner.py lines 318-322): so top_p=0.9 alone gives None."""
    nano = P.load()
    trace, own, mine = _pair(work, TIERS[0])
    sp = nano.sampling_params.SamplingParams
    cases = [
        ([sp(top_p=0.9, repetition_penalty=1.2)], (False, False, False)),
        ([sp(top_k=5, top_p=1.0, repetition_penalty=1.0)], (True, True, True)),
        ([sp(top_p=0.9), sp(top_p=1.0)], (False, True, True)),
        ([sp()], (False, False, True)),
    ]
    for params, (k, p, r) in cases:
        seqs = [nano.sequence.Sequence([1, 2, 3], x) for x in params]
        with P.own_path_on_cpu():
            a = own.prepare_sample(seqs)
        b = mine.prepare_sample(seqs)
        assert [x is not None for x in a[2:]] == [k, p, r] == [x is not None for x in b[2:]]
        for x, y in zip(a, b):
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y))


def test_doctor_shows_whether_nanovllm_is_installed_and_tested() -> None:
    from stagebuf._tools import doctor as _doctor

    rows = dict(_doctor.vllm_rows())
    assert rows["nano-vllm"] == sn.status()["note"] and "nano-vllm-fork 20260210" in rows["nano-vllm"]
    j = json.loads(_doctor.to_json(stagebuf.capabilities()))
    assert j["nanovllm"] == json.loads(json.dumps(sn.status()))
