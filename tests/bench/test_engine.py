"""The engine workload's identical-inputs check on the CPU: vLLM 0.33.0's own MRV2 modules on stagebuf.

vLLM's released files are fetched (``benchmarks.vllm_mrv2.fetch``: the installed vLLM 0.33.0, or its
wheel from the package index); where that fails the tests skip and say why. vLLM's Triton kernels
run in Triton's CPU interpreter (``TRITON_INTERPRET=1``), as vLLM's CPU worker runs them.
"""

from __future__ import annotations

import pytest
import torch
from benchmarks import engine as E
from benchmarks import vllm_mrv2

CPU = torch.device("cpu")
SMALL = {"max_num_reqs": 24, "max_model_len": 256, "max_num_batched_tokens": 192, "running": 16,
         "prompt": (16, 120), "output": (1, 6), "steps": 12}  # fmt: skip


pytestmark = pytest.mark.usefixtures("vllm_interpreted")


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("api", ["dropin", "own"])
@pytest.mark.parametrize("tier", ["host", "pageable"])
def test_identical_inputs(tier: str, api: str, groups: int) -> None:
    """Step by step, every device-visible input equals vLLM's own layer's (vLLM's CPU worker)."""
    cfg = E.TraceConfig(block_sizes=E.BLOCK_SIZES[:groups], **SMALL)
    trace = E.make_trace(cfg)
    assert any(p.new for p in trace[1:]) and any(p.cached for p in trace) and any(p.finished for p in trace)
    r = E.check(E.Setup("stagebuf", tier, api), cfg, CPU, trace=trace)
    assert r["steps"] == cfg.steps and r["mismatches"] == []


def test_the_check_finds_a_wrong_input() -> None:
    """One wrong block id on stagebuf's side after step 3 is reported, by step and input."""
    cfg = E.TraceConfig(**SMALL)

    def tamper(eng: E.Engine, i: int) -> None:
        if i == 3:
            eng.block_tables.block_tables[0].gpu[0, 0] += 1

    r = E.check(E.Setup("stagebuf", "host", "dropin"), cfg, CPU, tamper=tamper)
    assert "step 3: block_table_state_0" in r["mismatches"]
    assert all(int(m.split(":")[0].split()[1]) >= 3 for m in r["mismatches"])


def test_the_peer_is_vllms_own_code() -> None:
    """The vLLM layer really is vLLM's buffer_utils (its classes, defined in its file)."""
    m = vllm_mrv2.load("vllm", device=CPU)
    for name in ("UvaBufferPool", "UvaBackedTensor", "StagedWriteTensor", "FusedStagedWriter"):
        cls = getattr(m.buffer_utils, name)
        assert cls.__init__.__code__.co_filename.endswith("vllm/v1/worker/gpu/buffer_utils.py")
    # on the CPU, vLLM's CPU worker swaps in its own UvaBuffer, and so does the loader
    assert m.buffer_utils.UvaBuffer.__init__.__code__.co_filename.endswith(
        "vllm/v1/worker/cpu/buffer_utils.py"
    )
    s = vllm_mrv2.load("stagebuf", device=CPU)
    import stagebuf

    assert s.block_table.StagedWriteTensor is stagebuf.StagedWriteTensor
    assert s.states.UvaBackedTensor is stagebuf.UvaBackedTensor
    assert s.block_table._load_ptr is not None  # vLLM's Triton helper stays vLLM's


@pytest.mark.parametrize("tier", ["host", "pageable"])
def test_identical_inputs_through_the_vllm_plugin(tier: str) -> None:
    """stagebuf as the plugin installs it (vLLM's names, vLLM's loader) gives vLLM's inputs too."""
    cfg = E.TraceConfig(block_sizes=E.BLOCK_SIZES[:2], **SMALL)
    try:
        r = E.check(E.Setup("plugin", tier), cfg, CPU)
    finally:
        E.close_plugin_modules()
    assert r["steps"] == cfg.steps and r["mismatches"] == []


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize(("tier", "kernel"), [("host", "auto"), ("pageable", "auto"), ("pageable", "triton")])
def test_identical_inputs_in_step_mode(
    tier: str, kernel: str, groups: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """STAGEBUF_VLLM=step through vLLM's own plugin loader: every device-visible input equals vLLM's
    own layer's, step by step, and each step is one publish of the step's batch (one transfer on
    PAGEABLE). Its writes: numpy on HOST; on PAGEABLE a gather and an ``index_copy_`` per target, or
    with ``STAGEBUF_WRITE_KERNEL=triton`` one Triton launch (the CPU interpreter) a step."""
    from stagebuf._engines import vllm_step as _vllm_step

    monkeypatch.setenv("STAGEBUF_WRITE_KERNEL", kernel)
    cfg = E.TraceConfig(block_sizes=E.BLOCK_SIZES[:groups], **SMALL)
    try:
        r = E.check(E.Setup("step", tier), cfg, CPU)
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


def test_step_modes_deferral_is_what_the_check_sees() -> None:
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
        r = E.check(E.Setup("step", "pageable"), cfg, CPU)
    finally:
        _vllm_step.StepBatch.flush = flush  # type: ignore[method-assign]
        E.close_plugin_modules()
    assert r["mismatches"] and r["mismatches"][0].startswith("step 0:")
