"""The engine workload's identical-inputs check on the CPU: vLLM's own MRV2 modules on stagebuf, on every
release of ``benchmarks.vllm_mrv2.RELEASES`` (the ``vllm_release`` fixture: ids ``v0.32.0`` ...).

vLLM's released files are fetched (``benchmarks.vllm_mrv2.fetch``: its wheel from the package
index); where that fails a release's tests skip and say why. vLLM's Triton
kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``), as vLLM's CPU worker runs them.
"""

from __future__ import annotations

import array
from typing import Any

import pytest
import torch
from benchmarks import engine as E
from benchmarks import vllm_mrv2

CPU = torch.device("cpu")
SMALL = {"max_num_reqs": 24, "max_model_len": 256, "max_num_batched_tokens": 192, "running": 16,
         "prompt": (16, 120), "output": (1, 6), "steps": 12}  # fmt: skip


pytestmark = pytest.mark.usefixtures("triton_interpreted")


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("api", ["dropin", "own"])
@pytest.mark.parametrize("tier", ["host", "pageable"])
def test_identical_inputs(vllm_release: str, tier: str, api: str, groups: int) -> None:
    """Step by step, every device-visible input equals vLLM's own layer's (vLLM's CPU worker)."""
    cfg = E.TraceConfig(block_sizes=E.BLOCK_SIZES[:groups], **SMALL)
    trace = E.make_trace(cfg)
    assert any(p.new for p in trace[1:]) and any(p.cached for p in trace) and any(p.finished for p in trace)
    r = E.check(E.Setup("stagebuf", tier, api), cfg, CPU, trace=trace, release=vllm_release)
    assert r["steps"] == cfg.steps and r["mismatches"] == [] and r["release"] == vllm_release


def test_the_check_finds_a_wrong_input(vllm_release: str) -> None:
    """One wrong block id on stagebuf's side after step 3 is reported, by step and input."""
    cfg = E.TraceConfig(**SMALL)

    def tamper(eng: E.Engine, i: int) -> None:
        if i == 3:
            eng.block_tables.block_tables[0].gpu[0, 0] += 1

    r = E.check(E.Setup("stagebuf", "host", "dropin"), cfg, CPU, tamper=tamper, release=vllm_release)
    assert "step 3: block_table_state_0" in r["mismatches"]
    assert all(int(m.split(":")[0].split()[1]) >= 3 for m in r["mismatches"])


def test_the_peer_is_vllms_own_code(vllm_release: str) -> None:
    """The vLLM layer really is the release's buffer_utils (its classes, defined in its file)."""
    m = vllm_mrv2.load("vllm", device=CPU, release=vllm_release)
    where = f"vllm-{vllm_release}/vllm/v1/worker/gpu/buffer_utils.py"
    for name in ("UvaBufferPool", "UvaBackedTensor", "StagedWriteTensor", "FusedStagedWriter"):
        cls = getattr(m.buffer_utils, name)
        assert cls.__init__.__code__.co_filename.endswith(where)
    # on the CPU, vLLM's CPU worker swaps in its own UvaBuffer, and so does the loader
    assert m.buffer_utils.UvaBuffer.__init__.__code__.co_filename.endswith(
        f"vllm-{vllm_release}/vllm/v1/worker/cpu/buffer_utils.py"
    )
    assert m.release == vllm_release and (m.TokenBuffer is not None) == m.spec.token_buffer
    s = vllm_mrv2.load("stagebuf", device=CPU, release=vllm_release)
    import stagebuf

    assert s.block_table.StagedWriteTensor is stagebuf.StagedWriteTensor
    assert s.states.UvaBackedTensor is stagebuf.UvaBackedTensor
    assert s.block_table._load_ptr is not None  # vLLM's Triton helper stays vLLM's


def test_prompts_reach_vllm_as_the_release_hands_them(
    vllm_release: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RequestState.add_request gets each new prompt as the release's model runner passes it: a TokenBuffer
    (an int32 array.array, the same object on both sides of a lockstep run) from 0.34 on, else the list."""
    cfg = E.TraceConfig(**SMALL)
    m = vllm_mrv2.load("vllm", device=CPU, release=vllm_release)
    got: list[Any] = []
    add = m.states.RequestState.add_request

    def spy(self: Any, *a: Any, **k: Any) -> None:
        got.append(k["all_token_ids"])
        add(self, *a, **k)

    monkeypatch.setattr(m.states.RequestState, "add_request", spy)
    trace = E.make_trace(cfg)[:3]
    eng = E.Engine(E.Setup("vllm", "uva"), cfg, CPU, vllm_release)
    for plan in trace:
        eng.prepare(plan)
        eng.finish(plan, 0)
    new = [nr for plan in trace for nr in plan.new]
    assert len(got) == len(new) > 0
    tb = m.TokenBuffer
    for prompt, nr in zip(got, new):
        assert list(prompt) == nr.token_ids
        if tb is None:
            assert prompt is nr.token_ids
        else:
            assert type(prompt) is tb and isinstance(prompt, array.array) and prompt.typecode == "i"
            assert prompt is nr.prompt  # made once, before the step's timing


@pytest.mark.parametrize("tier", ["host", "pageable"])
def test_identical_inputs_through_the_vllm_plugin(vllm_release: str, tier: str) -> None:
    """stagebuf as the plugin installs it (vLLM's names, vLLM's loader) gives vLLM's inputs too."""
    cfg = E.TraceConfig(block_sizes=E.BLOCK_SIZES[:2], **SMALL)
    try:
        r = E.check(E.Setup("plugin", tier), cfg, CPU, release=vllm_release)
    finally:
        E.close_plugin_modules()
    assert r["steps"] == cfg.steps and r["mismatches"] == []


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize(("tier", "kernel"), [("host", "auto"), ("pageable", "auto"), ("pageable", "triton")])
def test_identical_inputs_in_step_mode(
    vllm_release: str, tier: str, kernel: str, groups: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """STAGEBUF_VLLM=step through vLLM's own plugin loader: every device-visible input equals vLLM's
    own layer's, step by step, and each step is one publish of the step's batch (one transfer on
    PAGEABLE). Its writes: numpy on HOST; on PAGEABLE a gather and an ``index_copy_`` per target, or
    with ``STAGEBUF_WRITE_KERNEL=triton`` one Triton launch (the CPU interpreter) a step."""
    from stagebuf._engines import vllm_step as _vllm_step

    monkeypatch.setenv("STAGEBUF_WRITE_KERNEL", kernel)
    cfg = E.TraceConfig(block_sizes=E.BLOCK_SIZES[:groups], **SMALL)
    try:
        r = E.check(E.Setup("step", tier), cfg, CPU, release=vllm_release)
        b = next(b for (_, t), b in _vllm_step.BATCHES.items() if t.name == tier.upper())
        stats = b.stager.stats()
    finally:
        E.close_plugin_modules()
    assert r["steps"] == cfg.steps and r["mismatches"] == []
    assert b.triton is (kernel == "triton")
    if tier == "pageable":  # the sampler's two publishes at construction, then one per step
        assert stats["transfers"] == cfg.steps + 2
        if kernel == "triton":
            assert b.launches == b.flushes == cfg.steps + 2
        else:  # two launches (a gather and an index_copy_) per target written
            assert b.launches > 2 * b.flushes and b.launches % 2 == 0


def test_step_modes_deferral_is_what_the_check_sees(vllm_release: str) -> None:
    """The check finds a step-mode batch that loses its last deferred write (so it can fail)."""
    from stagebuf._engines import vllm_step as _vllm_step

    cfg = E.TraceConfig(block_sizes=E.BLOCK_SIZES[:2], **SMALL)
    flush = _vllm_step.StepBatch.flush

    def lossy(self: _vllm_step.StepBatch) -> None:
        if len(self.rows) > 12 and _vllm_step._WINDOW[0] is False:
            del self.rows[-4:]  # the last one-edit row (four ints)
        flush(self)

    try:
        _vllm_step.StepBatch.flush = lossy  # type: ignore[method-assign]
        r = E.check(E.Setup("step", "pageable"), cfg, CPU, release=vllm_release)
    finally:
        _vllm_step.StepBatch.flush = flush  # type: ignore[method-assign]
        E.close_plugin_modules()
    assert r["mismatches"] and r["mismatches"][0].startswith("step 0:")
