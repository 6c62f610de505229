"""What the vLLM plugin checks of a release, on each release's real files (``benchmarks.vllm_mrv2``):
the buffer API both ways, and step mode's window read from the release's own ``model_runner.py``."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from benchmarks import vllm_mrv2

import stagebuf
from stagebuf._engines import vllm as _vllm
from stagebuf._engines import vllm_check

CPU = torch.device("cpu")
RELEASES = list(vllm_mrv2.RELEASES)


@pytest.fixture(params=RELEASES, ids=[f"v{r}" for r in RELEASES])
def release(request: pytest.FixtureRequest) -> str:
    r: str = request.param
    why = vllm_mrv2.available(r)
    if why:
        pytest.skip(f"needs vLLM {r}'s files: {why}")
    return r


def test_the_plugin_and_the_harness_test_the_same_releases() -> None:
    assert tuple(vllm_mrv2.RELEASES) == vllm_check.TESTED


def _mine() -> dict[str, Any]:
    return {n: getattr(stagebuf, n) for n in vllm_check.REPLACED}


def test_each_release_matches_stagebuf_both_ways(release: str) -> None:
    bu = vllm_mrv2.load("vllm", device=CPU, release=release).buffer_utils
    assert vllm_check.api_differences(bu, _mine()) == []


def _with(bu: Any, **classes: Any) -> types.SimpleNamespace:
    ns = types.SimpleNamespace(**{k: v for k, v in vars(bu).items() if not k.startswith("__")})
    for k, v in classes.items():
        setattr(ns, k, v)
    return ns


def test_a_method_vllm_adds_is_a_difference_and_leaves_vllm_whole(
    release: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    bu = vllm_mrv2.load("vllm", device=CPU, release=release).buffer_utils

    class UvaBufferPool(bu.UvaBufferPool):  # type: ignore[misc, name-defined]
        def copy_many(self, xs: Any) -> None:
            raise NotImplementedError

    class StagedWriteTensor(bu.StagedWriteTensor):  # type: ignore[misc, name-defined]
        def __init__(  # vLLM's parameters
            self, size: Any, dtype: Any, device: Any, max_concurrency: Any = 2, uva_instead_of_gpu: Any = 0
        ) -> None:
            super().__init__(size, dtype, device, max_concurrency, uva_instead_of_gpu)
            self.pinned_contents = None

    newer = _with(bu, UvaBufferPool=UvaBufferPool, StagedWriteTensor=StagedWriteTensor)
    assert vllm_check.api_differences(newer, _mine()) == [
        "stagebuf's UvaBufferPool lacks vLLM's copy_many",
        "stagebuf's StagedWriteTensor lacks vLLM's pinned_contents",
    ]
    wider = _with(bu, TORCH_DTYPE_TO_ARRAY_TYPECODE={torch.int32: "i", torch.int16: "h"})
    assert vllm_check.api_differences(wider, _mine()) == [
        "stagebuf's StagedWriteTensor lacks vLLM's dtype torch.int16"
    ]
    monkeypatch.setenv("STAGEBUF_VLLM", "1")
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    p = _vllm.plan(module=newer, version="0.35.0")
    assert p.action == "leave" and p.replacements == []
    assert "lacks vLLM's copy_many" in p.why and "vLLM's own layer stays" in p.why


def _source(release: str) -> str:
    return (vllm_mrv2.fetch(release) / "vllm/v1/worker/gpu/model_runner.py").read_text()


def test_each_release_window_closes_at_query_start_loc_after_reviewed_calls_only(release: str) -> None:
    calls, closed = vllm_check.window_calls(_source(release))
    assert closed and calls[-1] == "async_tensor_h2d(out=...)"
    assert "self.block_tables.apply_staged_writes" in calls and "self.prepare_inputs" in calls
    assert calls.index("self.block_tables.apply_staged_writes") < calls.index("self.prepare_inputs")
    assert [c for c in calls[:-1] if c not in vllm_check.REVIEWED_WINDOW] == []


@pytest.fixture
def fake_runner(tmp_path: Path) -> Iterator[Any]:
    """A model-runner module with the tested signatures whose file is the source a test writes."""

    def make(source: str) -> types.ModuleType:
        path = tmp_path / "model_runner.py"
        path.write_text(source)
        mod = types.ModuleType("_fake_vllm_model_runner")
        mod.__file__ = str(path)

        class GPUModelRunner:
            def execute_model(  # the tested signature (vllm.STEP_API)
                self, scheduler_output: Any, intermediate_tensors: Any = None, dummy_run: bool = False,
                skip_attn_for_dummy_run: bool = False, is_profile: bool = False, context_len: int = 0,
                valid_dummy_state_slots: bool = False, randomize_inputs: bool = False,
            ) -> Any:  # fmt: skip
                return None

            def prepare_inputs(
                self, scheduler_output: Any, batch_req_state: Any, batch_desc: Any, num_active_loras: int
            ) -> Any:
                return None

        GPUModelRunner.__module__ = mod.__name__

        def async_tensor_h2d(data: Any, device: Any = None, dtype: Any = None, out: Any = None) -> Any:
            return None

        mod.GPUModelRunner = GPUModelRunner  # type: ignore[attr-defined]
        mod.async_tensor_h2d = async_tensor_h2d  # type: ignore[attr-defined]
        sys.modules[mod.__name__] = mod
        return mod

    yield make
    sys.modules.pop("_fake_vllm_model_runner", None)


def test_a_kernel_added_to_the_window_turns_step_mode_off_naming_it(
    release: str, fake_runner: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = _source(release)
    close = "async_tensor_h2d(query_start_loc_np, out=query_start_loc)"
    assert source.count(close) == 1
    indent = source[: source.index(close)].rsplit("\n", 1)[1]
    changed = source.replace(close, f"self.block_tables.gather_block_tables(idx_mapping)\n{indent}{close}")
    assert vllm_check.window_differences(fake_runner(source)) == []
    assert vllm_check.window_differences(fake_runner(changed)) == [
        "execute_model calls self.block_tables.gather_block_tables before its inputs are complete, "
        "a call not reviewed"
    ]
    monkeypatch.setenv("STAGEBUF_VLLM", "step")
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    bu = vllm_mrv2.load("vllm", device=CPU, release=release).buffer_utils
    ok = _vllm.plan(module=bu, runner=fake_runner(source), version=release)
    assert ok.action == "patch" and ok.mode == "step"
    off = _vllm.plan(module=bu, runner=fake_runner(changed), version=release)
    assert off.action == "patch" and off.mode == "1" and off.requested == "step"
    assert "self.block_tables.gather_block_tables" in off.why


def test_an_untested_release_is_judged_by_its_api_and_window_not_its_number(
    fake_runner: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    newest = vllm_mrv2.NEWEST
    why = vllm_mrv2.available(newest)
    if why:
        pytest.skip(f"needs vLLM {newest}'s files: {why}")
    monkeypatch.setenv("STAGEBUF_VLLM", "step")
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    bu = vllm_mrv2.load("vllm", device=CPU, release=newest).buffer_utils
    p = _vllm.plan(module=bu, runner=fake_runner(_source(newest)), version="9.9.0")
    assert p.mode == "step"


def test_release_facts_follow_the_nearest_older_tested_release() -> None:
    assert vllm_check.release("0.33.0").v1_runner
    assert not vllm_check.release("0.34.0").v1_runner
    assert not vllm_check.release("0.35.1").v1_runner  # past the table: the newest's facts
    assert vllm_check.release("0.33.5") is vllm_check.RELEASES["0.33.0"]
    assert vllm_check.release(None) is vllm_check.RELEASES[vllm_check.NEWEST]


@pytest.mark.parametrize(("version", "v1"), [("0.33.0", True), ("0.34.0", False)])
def test_the_v1_runner_reason_follows_the_release(
    version: str, v1: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STAGEBUF_VLLM", "1")
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    p = _vllm.plan(module=types.SimpleNamespace(), version=version)
    assert p.action == "off"
    if v1:
        assert "runs its V1 model runner" in p.why
    else:
        assert f"vLLM {version} has no V1 model runner and refuses this setting" in p.why


def test_a_100000_token_prompt_as_vllm_passes_it_lands_as_in_vllms_own_class(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM 0.34 hands prompts over as its ``TokenBuffer``: staged on stagebuf's StagedWriteTensor and on
    vLLM's own (its Triton kernel interpreted on the CPU), the targets are equal."""
    releases = [r for r in RELEASES if vllm_mrv2.spec(r).token_buffer]
    if not releases or vllm_mrv2.available(releases[-1]):
        pytest.skip("needs a vLLM release with TokenBuffer (0.34 on) and its files")
    release = releases[-1]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    token_buffer = vllm_mrv2.token_buffer(release)
    theirs = vllm_mrv2.load("vllm", device=CPU, release=release).buffer_utils
    ids = torch.randint(0, 152_000, (100_000,), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    got = []
    for cls in (stagebuf.StagedWriteTensor, theirs.StagedWriteTensor):
        t = cls((2, 100_008), torch.int32, CPU)
        t.stage_write(1, 8, token_buffer(ids.numpy()))
        t.stage_write(0, 0, [5, 6])
        t.apply_write()
        got.append(t.gpu.clone())
    assert torch.equal(got[0], got[1])
    assert torch.equal(got[0][1, 8:], ids) and got[0][0, :3].tolist() == [5, 6, 0]
