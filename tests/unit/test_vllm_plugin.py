"""stagebuf's vLLM plugin, run by vLLM's own plugin loader on vLLM's own MRV2 modules, of every release in
``benchmarks.vllm_mrv2.RELEASES`` (the ``vllm_release`` fixture: ids ``v0.32.0`` ...).

``benchmarks.vllm_mrv2.as_installed`` makes a release's files importable as ``vllm`` (its
``vllm.plugins`` and ``vllm.v1.worker.gpu.*``); ``vllm.plugins.load_general_plugins()`` then finds
stagebuf's entry point through ``importlib.metadata``, as in a vLLM process. Without a release's files
(no network) or Triton, its tests skip and say why.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from benchmarks import vllm_mrv2

import stagebuf
from helpers import force_tier, invoke
from stagebuf._engines import vllm as _vllm
from stagebuf._engines import vllm_check
from stagebuf._rings import guard as _guard
from stagebuf._tools.cli import main

CPU = torch.device("cpu")
NAMES = vllm_check.REPLACED
ENTRY_POINT = "stagebuf = stagebuf._engines.vllm:register"


@contextmanager
def _installed(
    device: torch.device, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, release: str = vllm_mrv2.NEWEST
) -> Iterator[Any]:
    why = vllm_mrv2.available(release)
    if why:
        pytest.skip(f"needs vLLM {release}'s files: {why}")
    if "vllm" in sys.modules:
        pytest.skip("a real vLLM is imported in this process")
    if not any(e.name == "stagebuf" for e in entry_points(group="vllm.general_plugins")):
        # run from the tree (PYTHONPATH=src): register the entry point as an install would
        d = tmp_path / "stagebuf-0.1.0.dist-info"
        d.mkdir()
        (d / "METADATA").write_text("Metadata-Version: 2.1\nName: stagebuf\nVersion: 0.1.0\n")
        (d / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{ENTRY_POINT}\n")
        monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    old_default = _guard._DEFAULT_MAX_CONCURRENCY
    with vllm_mrv2.as_installed(device, release=release) as inst:
        try:
            yield inst
        finally:
            _vllm.unregister()
            _guard._DEFAULT_MAX_CONCURRENCY = old_default


@pytest.fixture
def vllm(vllm_release: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[vllm_mrv2.Installed]:
    """vLLM ``vllm_release`` importable as ``vllm`` (CPU): a test that takes it runs on each release."""
    with _installed(CPU, monkeypatch, tmp_path, vllm_release) as inst:
        yield inst


def _originals() -> dict[str, Any]:
    bu = sys.modules["vllm.v1.worker.gpu.buffer_utils"]
    return {n: getattr(bu, n) for n in NAMES}


def _load_plugins() -> None:
    import vllm.plugins  # the real file, the release's plugin loader

    assert any(e.name == "stagebuf" for e in entry_points(group="vllm.general_plugins"))
    vllm.plugins.load_general_plugins()


def _build(inst: vllm_mrv2.Installed, mods: dict[str, Any], device: torch.device = CPU) -> dict[str, Any]:
    bt = mods["block_table"].BlockTables([16, 32], 8, 64, [16, 8], device)
    rs = mods["states"].RequestState(8, 64, 64, 0, 100, device)
    ss = mods["sample.states"].SamplingStates(8, 100)
    return {
        "block table": bt.block_tables[0],
        "num_blocks": bt.num_blocks,
        "fused writer": bt.fused_writer,
        "all_token_ids": rs.all_token_ids,
        "total_len": rs.total_len,
        "prompt_len": rs.prompt_len,
        "temperature": ss.temperature,
        "seeds": ss.seeds,
    }


KINDS = {
    "block table": "StagedWriteTensor",
    "num_blocks": "UvaBackedTensor",
    "fused writer": "FusedStagedWriter",
    "all_token_ids": "StagedWriteTensor",
    "total_len": "StagedWriteTensor",
    "prompt_len": "UvaBackedTensor",
    "temperature": "UvaBackedTensor",
    "seeds": "UvaBackedTensor",
}


GPU = pytest.mark.gpu
TIERS = ["host", "pageable", pytest.param("uva", marks=GPU), pytest.param("pinned", marks=GPU),
         pytest.param("pageable-cuda", marks=GPU)]  # fmt: skip


@pytest.mark.parametrize("order", ["modules first", "plugins first"])
@pytest.mark.parametrize("tier", TIERS)
def test_the_plugin_makes_mrv2_build_stagebufs_classes(
    vllm_release, tmp_path, monkeypatch, order, tier
) -> None:
    """With STAGEBUF_VLLM=1, BlockTables, RequestState and the sampler's states build stagebuf's
    classes, whether MRV2's modules were imported before the plugins loaded or after."""
    name, _, where = tier.partition("-")
    device = torch.device("cuda") if where == "cuda" or name in ("uva", "pinned") else CPU
    if device.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    want = force_tier(monkeypatch, name)
    monkeypatch.setenv("STAGEBUF_VLLM", "1")
    with _installed(device, monkeypatch, tmp_path, vllm_release) as inst:
        names = ("block_table", "states", "sample.states")
        mods = {n: inst.load(n) for n in names} if order == "modules first" else {}
        _load_plugins()
        mods = mods or {n: inst.load(n) for n in names}
        for what, obj in _build(inst, mods, device).items():
            assert type(obj) is getattr(stagebuf, KINDS[what]), what
            if hasattr(obj, "tier"):
                assert obj.tier is want, what
        # vLLM's batch_queue_size still sets the ring depth
        sys.modules["vllm.v1.worker.gpu.buffer_utils"].set_default_max_concurrency(3)
        assert mods["states"].UvaBackedTensor(4, torch.int32).pool.max_concurrency == 3


@pytest.mark.parametrize("value", [None, "0", ""])
def test_without_the_setting_nothing_changes(vllm, monkeypatch, value) -> None:
    if value is None:
        monkeypatch.delenv("STAGEBUF_VLLM", raising=False)
    else:
        monkeypatch.setenv("STAGEBUF_VLLM", value)
    before = _originals()
    _load_plugins()
    assert _originals() == before
    mods = {n: vllm.load(n) for n in ("block_table", "states", "sample.states")}
    for what, obj in _build(vllm, mods).items():
        assert type(obj) is before[KINDS[what]], what  # vLLM's own classes


def test_a_bad_setting_is_refused_and_changes_nothing(vllm, monkeypatch) -> None:
    monkeypatch.setenv("STAGEBUF_VLLM", "yes")
    before = _originals()
    with pytest.raises(
        stagebuf.SetupError, match=r"STAGEBUF_VLLM='yes' is not a valid setting; allowed: 0, 1"
    ):
        _load_plugins()
    assert _originals() == before


def test_a_different_api_leaves_vllms_layer_whole(vllm, monkeypatch, caplog) -> None:
    monkeypatch.setenv("STAGEBUF_VLLM", "1")
    bu = sys.modules["vllm.v1.worker.gpu.buffer_utils"]

    class FusedStagedWriter(bu.FusedStagedWriter):  # a later vLLM, say: apply takes other arguments
        def apply(self, tensors, *, stream=None):  # type: ignore[no-untyped-def, override]
            return super().apply(tensors, None, None)

    monkeypatch.setattr(bu, "FusedStagedWriter", FusedStagedWriter)
    before = _originals()
    with caplog.at_level(logging.WARNING, logger="stagebuf"):
        _load_plugins()
    assert _originals() == before  # not one name replaced
    assert _vllm.plan().action == "leave"  # and doctor would say so
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert "FusedStagedWriter.apply(tensors, stream) instead of (tensors, output_ptrs, output_strides)" in msg
    assert "vLLM's own layer stays in place" in msg


def test_loaded_again_it_does_nothing_more(vllm, monkeypatch, caplog) -> None:
    """vLLM loads general plugins several times in one process: one patch, one log line."""
    monkeypatch.setenv("STAGEBUF_VLLM", "1")
    with caplog.at_level(logging.WARNING, logger="stagebuf"):
        for _ in range(3):
            _vllm.register()
        stagebuf.capabilities()
        stagebuf.reset_capabilities()
        stagebuf.capabilities()  # a second decision in the process: no second line
    lines = [r.getMessage() for r in caplog.records if "vLLM plugin on" in r.getMessage()]
    assert len(lines) == 1 and "tier HOST on cpu" in lines[0]
    assert _vllm.plan().action == "patched"
    assert sys.modules["vllm.v1.worker.gpu.buffer_utils"].StagedWriteTensor is stagebuf.StagedWriteTensor
    _vllm.unregister()
    assert sys.modules["vllm.v1.worker.gpu.buffer_utils"].StagedWriteTensor is not stagebuf.StagedWriteTensor


def test_the_entry_point_is_declared() -> None:
    """pyproject.toml declares the entry point vLLM's loader looks for (the tests above register the
    same one where stagebuf runs from the tree, not installed)."""
    text = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert '[project.entry-points."vllm.general_plugins"]\n' + ENTRY_POINT.replace("= ", '= "') + '"' in text


def test_each_release_is_tested_and_its_api_is_stagebufs(vllm, vllm_release) -> None:
    """Each release the harness runs is one the plugin is tested with, and its own buffer_utils (as vLLM
    imports it) differs from stagebuf's classes in nothing the plugin checks."""
    bu = sys.modules["vllm.v1.worker.gpu.buffer_utils"]
    assert vllm_release in _vllm.TESTED and sys.modules["vllm"].__version__ == vllm_release
    assert vllm_check.api_differences(bu, {n: getattr(stagebuf, n) for n in NAMES}) == []


def test_stagebufs_classes_take_vllms_calls() -> None:
    """Each replacement accepts every parameter of what it replaces, by position and by name."""
    for name, methods in vllm_check.API.items():
        obj = getattr(stagebuf, name)
        for m, params in methods.items():
            fn = obj if not m else getattr(obj, m)
            mine = vllm_check.params_of(fn)
            assert mine[: len(params)] == params or m in ("stage_write", "stage_write_elem"), (name, m, mine)


# --- doctor --------------------------------------------------------------------------------------


def _fake_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, release: str) -> None:
    """vLLM ``release``'s package metadata, as an installed vLLM has it (the files come from as_installed)."""
    d = tmp_path / f"vllm-{release}.dist-info"
    d.mkdir()
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {release}\n")
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize("as_json", [False, True])
def test_doctor_without_vllm(monkeypatch, as_json) -> None:
    if _vllm.vllm_version() is not None:
        pytest.skip("vLLM is installed here")
    args = ["doctor", "--json"] if as_json else ["doctor"]
    for env, want in (({}, "off"), ({"STAGEBUF_VLLM": "1"}, "cannot be imported")):
        monkeypatch.delenv("STAGEBUF_VLLM", raising=False)
        res = invoke(main, args, env)
        assert res.exit_code == 0 and res.exception is None
        if as_json:
            rep = json.loads(res.stdout)["vllm"]
            assert rep["installed"] is False and rep["version"] is None
            assert rep["action"] == want or (rep["action"] == "leave" and want in rep["why"])
        else:
            flat = " ".join(res.stdout.translate(str.maketrans("", "", "│┃")).split())  # rich wraps cells
            assert "vLLM" in flat and "not installed" in flat and want in flat


@pytest.mark.parametrize("as_json", [False, True])
def test_doctor_with_vllm(vllm, vllm_release, tmp_path, monkeypatch, as_json) -> None:
    _fake_dist(tmp_path, monkeypatch, vllm_release)
    args = ["doctor", "--json"] if as_json else ["doctor"]
    res = invoke(main, args, {"STAGEBUF_VLLM": "1"})
    assert res.exit_code == 0 and res.exception is None
    if as_json:
        rep = json.loads(res.stdout)["vllm"]
        assert rep["version"] == vllm_release and rep["enabled"] is True and rep["action"] == "patch"
        assert "matches the API" in rep["why"]
    else:
        tested = f"{vllm_release} (tested: {', '.join(_vllm.TESTED)})"
        assert tested in res.stdout and "would replace MRV2's buffer layer" in res.stdout
    res = invoke(main, args, {"STAGEBUF_VLLM": "maybe"})  # a bad value: explained, exit 2, no traceback
    assert res.exit_code == 2 and res.exception is None
    if as_json:
        rep = json.loads(res.stdout)
        assert (
            rep["setting"] == "STAGEBUF_VLLM" and "STAGEBUF_VLLM='maybe'" in rep["error"] and rep["allowed"]
        )
    else:
        assert "STAGEBUF_VLLM=maybe cannot work" in res.stdout and "allowed" in res.stdout


@pytest.mark.gpu
def test_pinned_slots_register_with_vllms_in_place_upload_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Confidential computing (the probe's coherence result forced to fail: tier PINNED): inside a release
    with ``register_inplace_h2d_target``, the plugin registers each PINNED buffer's device tensor there, as
    vLLM's NonUvaBuffer registers its own; unregister stops it."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (pinned memory)")
    release = next((r for r in reversed(vllm_mrv2.RELEASES) if vllm_mrv2.spec(r).confidential_compute), None)
    if release is None:
        pytest.skip("no release in the matrix has register_inplace_h2d_target")
    from stagebuf._tiers import probe as _probe

    def incoherent(device: torch.device) -> None:
        raise stagebuf.UvaError("coherence probe failed: the device view did not see a host write (forced)")

    monkeypatch.setattr(_probe, "_uva_probe", incoherent)
    monkeypatch.setenv("STAGEBUF_VLLM", "1")
    stagebuf.reset_capabilities()
    cuda = torch.device("cuda")
    try:
        with _installed(cuda, monkeypatch, tmp_path, release):
            _load_plugins()
            assert stagebuf.capabilities(cuda).tier is stagebuf.Tier.PINNED
            seen = len(vllm_mrv2.INPLACE_H2D_TARGETS)
            pool = stagebuf.UvaBufferPool(64, torch.int32, max_concurrency=2, device=cuda)
            got = pool.copy_to_uva(np.arange(64, dtype=np.int32))
            new = [r() for r in list(vllm_mrv2.INPLACE_H2D_TARGETS)[seen:]]
            assert any(t is not None and t.data_ptr() == got.data_ptr() for t in new)
            assert got.cpu().tolist() == list(range(64))
            _vllm.unregister()
            seen = len(vllm_mrv2.INPLACE_H2D_TARGETS)
            stagebuf.UvaBufferPool(64, torch.int32, device=cuda).copy_to_uva(np.zeros(4, np.int32))
            assert len(vllm_mrv2.INPLACE_H2D_TARGETS) == seen
    finally:
        stagebuf.reset_capabilities()
