"""The vLLM plugin's step mode (``STAGEBUF_VLLM=step``), loaded by vLLM's own plugin loader, on every
release of ``benchmarks.vllm_mrv2.RELEASES`` (the ``vllm_release`` fixture).

The model runner is the harness's stand-in (``benchmarks.vllm_mrv2``): vLLM's own
``async_tensor_h2d`` bound where the model runner binds it, and ``GPUModelRunner`` with vLLM's
``execute_model``/``prepare_inputs`` signatures, its module's file the release's real
``model_runner.py`` (whose window step mode reads). Identical inputs on vLLM's real MRV2 modules are
tests/bench/test_engine.py's (CPU) and tests/gpu/test_gpu_engine.py's (GPU).
"""

from __future__ import annotations

import ast
import inspect
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from benchmarks import vllm_mrv2
from test_vllm_plugin import CPU, _installed, _load_plugins, _originals

import stagebuf
from stagebuf._engines import vllm as _vllm
from stagebuf._engines import vllm_step as _vllm_step

MR = "vllm.v1.worker.gpu.model_runner"


@pytest.fixture
def vllm(vllm_release: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Any]:
    with _installed(CPU, monkeypatch, tmp_path, vllm_release) as inst:
        yield inst


def _runner() -> tuple[Any, Any, Any]:
    mr = sys.modules[MR]
    return mr, mr.async_tensor_h2d, mr.GPUModelRunner.execute_model


def _real_params(source: str, method: str) -> list[str]:
    """The parameters of ``GPUModelRunner.<method>`` in a model_runner.py's source (self left out)."""
    cls = next(
        n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == "GPUModelRunner"
    )
    fn = next(m for m in cls.body if isinstance(m, ast.FunctionDef) and m.name == method)
    a = fn.args
    return [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)][1:]


def test_the_stand_in_runner_reads_as_the_releases_own(vllm, vllm_release) -> None:
    """What reads the model runner's source through its module reads the release's real model_runner.py,
    and the stand-in takes the calls the real execute_model and prepare_inputs take."""
    mr = sys.modules[MR]
    real = vllm_mrv2.fetch(vllm_release) / "vllm/v1/worker/gpu/model_runner.py"
    assert Path(mr.__file__) == real and mr.GPUModelRunner.__module__ == MR
    assert Path(inspect.getsourcefile(mr.GPUModelRunner) or "") == real
    source = real.read_text()
    assert "class GPUModelRunner" in source and "async_tensor_h2d(query_start_loc_np, out=" in source
    for method in ("execute_model", "prepare_inputs"):
        mine = list(inspect.signature(getattr(mr.GPUModelRunner, method)).parameters)[1:]
        assert mine == _real_params(source, method), method


def test_step_mode_patches_the_layer_and_the_model_runner(vllm, monkeypatch, caplog) -> None:
    monkeypatch.setenv("STAGEBUF_VLLM", "step")
    mr, h2d, execute = _runner()
    with caplog.at_level(logging.WARNING, logger="stagebuf"):
        _load_plugins()
        stagebuf.capabilities()
    bu = sys.modules["vllm.v1.worker.gpu.buffer_utils"]
    assert bu.StagedWriteTensor is _vllm_step.StepStagedWriteTensor
    assert bu.UvaBackedTensor is _vllm_step.StepBackedTensor
    assert bu.FusedStagedWriter is _vllm_step.StepFusedStagedWriter
    assert bu.UvaBufferPool is stagebuf.UvaBufferPool
    assert mr.async_tensor_h2d is not h2d and mr.async_tensor_h2d.__wrapped__ is h2d
    assert mr.GPUModelRunner.execute_model.__wrapped__ is execute
    p = _vllm.plan()
    assert (p.action, p.mode, p.requested) == ("patched", "step", "step")
    assert f"{MR}.async_tensor_h2d" in p.patches and "GPUModelRunner.execute_model" in p.patches
    lines = [r.getMessage() for r in caplog.records if "vLLM plugin on" in r.getMessage()]
    assert len(lines) == 1 and "STAGEBUF_VLLM=step" in lines[0] and "one batch" in lines[0]
    _vllm.unregister()
    assert (mr.async_tensor_h2d, mr.GPUModelRunner.execute_model) == (h2d, execute)
    assert bu.StagedWriteTensor is not _vllm_step.StepStagedWriteTensor


def test_a_changed_model_runner_falls_back_to_class_replacement(vllm, monkeypatch, caplog) -> None:
    """A model runner whose prepare_inputs differs: vLLM's runner stays untouched, the layer is =1's,
    and the one log line names the difference."""
    monkeypatch.setenv("STAGEBUF_VLLM", "step")
    mr, h2d, execute = _runner()

    def prepare_inputs(self, scheduler_output, batch_req_state, batch_desc):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    monkeypatch.setattr(mr.GPUModelRunner, "prepare_inputs", prepare_inputs)
    with caplog.at_level(logging.WARNING, logger="stagebuf"):
        _load_plugins()
        stagebuf.capabilities()
    assert (mr.async_tensor_h2d, mr.GPUModelRunner.execute_model) == (h2d, execute)
    bu = sys.modules["vllm.v1.worker.gpu.buffer_utils"]
    assert (
        bu.StagedWriteTensor is stagebuf.StagedWriteTensor and bu.UvaBackedTensor is stagebuf.UvaBackedTensor
    )
    p = _vllm.plan()
    assert (p.action, p.mode, p.requested) == ("patched", "1", "step")
    lines = [r.getMessage() for r in caplog.records if "vLLM plugin" in r.getMessage()]
    assert len(lines) == 1
    want = "GPUModelRunner.prepare_inputs(scheduler_output, batch_req_state, batch_desc) instead of"
    assert want in lines[0] and "class replacement only" in lines[0]


def test_an_untested_vllm_version_is_judged_by_what_it_runs(vllm, vllm_release, monkeypatch) -> None:
    """A version outside TESTED (0.35.0) whose buffer layer and model-runner window are a tested release's:
    step mode as on that release, the version only reported."""
    assert "0.35.0" not in _vllm.TESTED
    monkeypatch.setenv("STAGEBUF_VLLM", "step")
    p = _vllm.plan(version="0.35.0")
    assert (p.action, p.mode) == ("patch", "step"), p.why
    assert "vLLM 0.35.0's" in p.why and f"tested with (vLLM {', '.join(_vllm.TESTED)})" in p.why
    assert {"async_tensor_h2d", "execute_model"} <= {attr for _m, attr, _o, _n in p.replacements}


@pytest.mark.parametrize("value", ["2", "steps", "on", "true"])
def test_other_values_are_refused_naming_the_allowed_ones(vllm, monkeypatch, value) -> None:
    monkeypatch.setenv("STAGEBUF_VLLM", value)
    before = _originals()
    with pytest.raises(stagebuf.SetupError, match=r"allowed: 0, 1, step"):
        _load_plugins()
    assert _originals() == before


@pytest.mark.parametrize(
    ("env", "why"),
    [
        ({"VLLM_PLUGINS": "other"}, "VLLM_PLUGINS='other' does not name stagebuf"),
        ({"VLLM_USE_V2_MODEL_RUNNER": "0"}, "V1 model runner"),
    ],
)
def test_the_plan_says_off_where_vllm_would_not_run_the_plugin(monkeypatch, env, why) -> None:
    """As vLLM decides: VLLM_PLUGINS without stagebuf, or the V1 model runner (no vLLM needed)."""
    monkeypatch.setenv("STAGEBUF_VLLM", "1")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    p = _vllm.plan()
    assert p.action == "off" and why in p.why


def test_the_window_defers_until_the_out_copy(monkeypatch) -> None:
    """Inside execute_model's window a staged write waits for the step's out= copy; outside, it writes
    at once. HOST tier, stagebuf's own objects (no vLLM needed)."""
    monkeypatch.setenv("STAGEBUF_TIER", "host")
    stagebuf.reset_capabilities()
    try:
        t = _vllm_step.StepStagedWriteTensor((2, 4), torch.int32, device="cpu")
        backed = _vllm_step.StepBackedTensor(3, torch.int64, device="cpu")
        out = torch.zeros(3, dtype=torch.int32)
        gpu_before = backed.gpu
        h2d = _vllm_step.wrap_h2d(lambda *a, **k: pytest.fail("vLLM's own copy was not expected"))
        with _vllm_step.window():
            t.stage_write(1, 1, [7, 8])
            t.apply_write()
            backed.np[:] = [5, 6, 2**40]
            backed.copy_to_uva()
            idx = h2d(np.array([2, 0], np.int32), device="cpu", dtype=torch.int64)
            assert t.gpu.sum().item() == 0 and backed.gpu.sum().item() == 0  # deferred
            h2d(np.array([1, 2, 3], np.int32), out=out)  # the step's inputs are complete
            assert t.gpu[1].tolist() == [0, 7, 8, 0] and backed.gpu.tolist() == [5, 6, 2**40]
            assert out.tolist() == [1, 2, 3] and idx.tolist() == [2, 0] and idx.dtype == torch.int64
            t.stage_write(0, 0, [1])
            t.apply_write()  # after the window closed: at once
            assert t.gpu[0, 0].item() == 1
        assert backed.gpu.data_ptr() == gpu_before.data_ptr()  # one fixed address
    finally:
        _vllm_step.reset()
        monkeypatch.delenv("STAGEBUF_TIER")
        stagebuf.reset_capabilities()


@pytest.mark.parametrize("bad", [True, 5, -1, 2.0, "2"])
def test_a_step_backed_publish_refuses_a_bad_row_count(monkeypatch, bad) -> None:
    """As UvaBackedTensor.copy_to_uva: n must be an int in [0, rows] (a bool is not one); nothing staged."""
    monkeypatch.setenv("STAGEBUF_TIER", "host")
    stagebuf.reset_capabilities()
    try:
        t = _vllm_step.StepBackedTensor(4, torch.int32, device="cpu")
        t.np[:] = [1, 2, 3, 4]
        with pytest.raises(stagebuf.InvalidArgumentError, match=r"n=.* must be an int in \[0, 4\]"):
            t.copy_to_uva(bad)
        assert t.gpu.tolist() == [0, 0, 0, 0] and not t._step_batch.pending
        assert t.copy_to_uva(np.int64(2)).tolist() == [1, 2]
    finally:
        _vllm_step.reset()
        monkeypatch.delenv("STAGEBUF_TIER")
        stagebuf.reset_capabilities()


def test_the_step_classes_use_the_core_seams_only(monkeypatch) -> None:
    """The step writers name their launch step (``launcher_class``) and override nothing private;
    ``StepBackedTensor`` is a class of its own with UvaBackedTensor's public surface, and for a dtype
    whose rows are not whole 32-bit words it makes a plain, fully constructed UvaBackedTensor."""
    from stagebuf._engines.vllm_check import public_names

    for cls in (_vllm_step.StepStagedWriteTensor, _vllm_step.StepFusedStagedWriter):
        assert set(vars(cls)) - {"__module__", "__doc__", "__qualname__"} == {"launcher_class"}
    assert not issubclass(_vllm_step.StepBackedTensor, stagebuf.UvaBackedTensor)
    assert public_names(stagebuf.UvaBackedTensor) <= public_names(_vllm_step.StepBackedTensor)
    monkeypatch.setenv("STAGEBUF_TIER", "host")
    stagebuf.reset_capabilities()
    try:
        for dtype in (torch.int16, torch.uint8, torch.bool):
            plain = _vllm_step.StepBackedTensor(5, dtype, device="cpu")
            assert type(plain) is stagebuf.UvaBackedTensor and plain.pool is not None
            plain.np[:] = 1
            assert plain.copy_to_uva(3).tolist() == [1, 1, 1]  # through its pool, at once
        fixed = _vllm_step.StepBackedTensor((2, 3), torch.float32, device="cpu")
        assert type(fixed) is _vllm_step.StepBackedTensor and fixed.pool is None
        fixed.np = [[1.5, 2, 3], [4, 5, 6]]  # copied in, as on UvaBackedTensor
        with pytest.raises(stagebuf.ReadOnlyAttributeError, match="copy_to_uva"):
            fixed.gpu = torch.zeros(2, 3)  # type: ignore[misc]
        assert fixed.copy_to_uva(1).tolist() == [[1.5, 2, 3]] and fixed.gpu.shape == (1, 3)
        assert fixed.stats() == {"transfers": 0, "bytes": 0, "growths": 0, "guard_waits": 0}
    finally:
        _vllm_step.reset()
        monkeypatch.delenv("STAGEBUF_TIER")
        stagebuf.reset_capabilities()


@pytest.mark.parametrize("tier", ["host", "pageable"])
def test_step_writes_equal_the_plain_classes(monkeypatch, tier) -> None:
    """Staged writes through the step batch (one window, overlapping edits, a fused writer, edits of
    mixed lengths) leave the targets a numpy model of the edits holds, as the plain classes do."""
    monkeypatch.setenv("STAGEBUF_TIER", tier)
    stagebuf.reset_capabilities()
    rng = np.random.default_rng(5)
    edits = [(int(r), int(s), rng.integers(-50, 50, n).tolist()) for r, s, n in zip(
        rng.integers(0, 6, 40), rng.integers(0, 4, 40), rng.integers(1, 5, 40))]  # fmt: skip
    model = np.zeros((6, 8), np.int64)
    for r, s, v in edits:
        model[r, s : s + len(v)] = v
    try:
        step = [_vllm_step.StepStagedWriteTensor((6, 8), torch.int64, device="cpu") for _ in range(2)]
        plain = [stagebuf.StagedWriteTensor((6, 8), torch.int64, device="cpu") for _ in range(2)]
        h2d = _vllm_step.wrap_h2d(lambda *a, **k: pytest.fail("vLLM's own copy was not expected"))
        with _vllm_step.window():
            for t in (step[0], plain[0]):
                for r, s, v in edits:
                    t.stage_write(r, s, v)
                t.apply_write()
            for t in (step[1], plain[1]):
                t.stage_writes([e[0] for e in edits], [e[1] for e in edits],
                               [x for e in edits for x in e[2]], [len(e[2]) for e in edits])  # fmt: skip
            _vllm_step.StepFusedStagedWriter("cpu").apply([step[1]])
            stagebuf.FusedStagedWriter("cpu").apply([plain[1]])
            assert not step[0].gpu.any() and not step[1].gpu.any()  # deferred until the out= copy
            h2d(np.array([1], np.int32), out=torch.zeros(1, dtype=torch.int32))
        for t in (*step, *plain):
            np.testing.assert_array_equal(t.gpu.numpy(), model)
        assert step[0].kernel == ("host" if tier == "host" else "scatter")
    finally:
        _vllm_step.reset()
        monkeypatch.delenv("STAGEBUF_TIER")
        stagebuf.reset_capabilities()
