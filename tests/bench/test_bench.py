"""``python -m benchmarks``: the quick run CI does, and the pieces it is made of.

No expected timings here: only that every strategy that can run did, with
positive numbers, that the answers are checked and a wrong one fails the run,
and that the ratios are computed as documented.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from benchmarks import baselines as BL
from benchmarks import bench as B
from benchmarks import harness as H
from benchmarks import report as R
from benchmarks import targets as T
from benchmarks import vllm_mrv2, writes

from helpers import invoke
from stagebuf import Tier

HAS_CUDA = torch.cuda.is_available()
ROOT = Path(__file__).resolve().parents[2]


QUICK_MICRO = ["--quick", "--no-progress", "--workload", "micro", "--sizes", "64"]  # micro alone, at N=64


def main(args: list[str]) -> int:
    """``python -m benchmarks ARGS``, in this process (click's standalone mode exits with the status)."""
    B.bench.main(args=args, prog_name="python -m benchmarks")
    return 0


CPU_STRATEGIES = {
    "micro": {
        "list_tensor",
        "mrv2_fallback_per_array",
        "pool_host",
        "stager_host",
        "pool_pageable",
        "stager_pageable",
        "floor",
    },
    "writes": {
        "row_copy_per_edit",
        "staged_write_host",
        "staged_write_pageable",
        "staged_writes_host",
        "staged_writes_pageable",
    },
}
CUDA_ONLY = {
    "micro": {
        "pinned_tensor_per_array",
        "pinned_buffer_per_array",
        "uva_pool_per_array",
        "mrv2_uva_pool",
    },
    "writes": {"mrv2_staged_write"},
}
RATIOS = {
    "uva_stager_vs_pinned_per_array",
    "pinned_stager_vs_pinned_per_array",
    "pageable_stager_vs_mrv2_fallback",
    "staged_write_256_speedup",
    "no_tier_slower_than_uva_pool",
    "staged_write_uva_vs_mrv2_e_le_16",
    "staged_writes_uva_vs_mrv2_e_ge_256",
    "staged_write_pinned_vs_mrv2",
    "staged_write_pageable_vs_mrv2",
    "stage_write_8_ints_us",
    "pool_vs_mrv2_pool",
    "host_one_edit_vs_row_copy",
}
GPU_RATIOS = {
    name
    for name in RATIOS
    if name
    not in (
        "pageable_stager_vs_mrv2_fallback",
        "staged_write_256_speedup",
        "stage_write_8_ints_us",
        "host_one_edit_vs_row_copy",
    )
}
HOST_RATIOS = {"host_one_edit_vs_row_copy"}


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One ``python -m benchmarks --quick --json --plot`` run, shared by the tests below."""
    out = tmp_path_factory.mktemp("bench")
    js, png = out / "bench.json", out / "bench.png"
    old = os.environ.pop("STAGEBUF_TIER", None)
    try:
        res = invoke(main, ["--quick", "--no-progress", "--json", str(js), "--plot", str(png)])
    finally:
        if old is not None:
            os.environ["STAGEBUF_TIER"] = old
    assert res.exit_code == 0, res.output + repr(res.exception)
    return {"report": json.loads(js.read_text()), "png": png, "json": js, "output": res.output}


NEEDS_VLLM = {"mrv2_fallback_per_array"}
"""CPU strategies that are vLLM's own classes: without vLLM's files they are skipped, and say so."""


def test_quick_has_every_cpu_strategy_with_positive_numbers(quick: dict[str, Any]) -> None:
    res = quick["report"]["results"]
    why = vllm_mrv2.available()
    for wl, names in CPU_STRATEGIES.items():
        if why:  # no network: vLLM's classes cannot be had; the report must say so, not pass silently
            skipped = {(s["workload"], s["strategy"]) for s in quick["report"]["skipped"]}
            assert all((wl, n) in skipped for n in names & NEEDS_VLLM), quick["report"]["skipped"]
            names = names - NEEDS_VLLM
        assert names <= set(res[wl]), f"{wl}: missing {names - set(res[wl])}"
        for name in names:
            sizes = res[wl][name]["sizes"]
            assert sizes, (wl, name)
            for size, row in sizes.items():
                assert row["host_us"] > 0 and row["e2e_us"] > 0, (wl, name, size, row)
                assert row["iters"] >= 2 and len(row["e2e_samples_us"]) == row["repeats"]
    cfg = quick["report"]["config"]
    assert sorted(int(s) for s in res["micro"]["floor"]["sizes"]) == sorted(cfg["sizes"])
    cells = {f"{e}x{ln}" for e in cfg["edits"] for ln in cfg["lengths"]}
    for name in CPU_STRATEGIES["writes"]:
        assert set(res["writes"][name]["sizes"]) == cells, name


def test_quick_records_each_strategy_tier(quick: dict[str, Any]) -> None:
    for wl, data in quick["report"]["results"].items():
        for name, e in data.items():
            if e["kind"] == "stagebuf":
                assert e["tier"] == name.rsplit("_", 1)[1].upper(), (wl, name)
            else:
                assert e["tier"] is None, (wl, name)


def test_markdown_and_plot_from_an_earlier_json(quick: dict[str, Any], tmp_path: Path) -> None:
    md, png = tmp_path / "b.md", tmp_path / "b.png"
    res = invoke(main, ["--from-json", str(quick["json"]), "--markdown", str(md), "--plot", str(png)])
    assert res.exit_code == 0, res.output
    text = md.read_text()
    for part in (
        "#### micro",
        "#### staged writes",
        "#### targets",
        "`stager_pageable`",
        "staged_write_256_speedup",
        quick["report"]["command"],
    ):
        assert part in text, part
    files = sorted(tmp_path.glob("b-*.png"))
    assert [f.name for f in files] == ["b-micro.png", "b-writes.png"]
    assert all(f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for f in files) and not png.exists()


def test_quick_staging_is_strategy_minus_floor(quick: dict[str, Any]) -> None:
    micro = quick["report"]["results"]["micro"]
    for name, e in micro.items():
        for size, row in e["sizes"].items():
            want = row["e2e_us"] - micro["floor"]["sizes"][size]["e2e_us"]
            assert row["staging_e2e_us"] == pytest.approx(want, abs=1e-2), (name, size)


def test_quick_lists_what_it_skipped_with_reasons(quick: dict[str, Any]) -> None:
    rep = quick["report"]
    skipped = {(s["workload"], s["strategy"]): s["reason"] for s in rep["skipped"]}
    assert all(reason for reason in skipped.values())
    if HAS_CUDA:
        return
    for wl, names in CUDA_ONLY.items():
        for name in names:
            assert (wl, name) in skipped, (wl, name)
            assert name not in rep["results"][wl]
    tiers = " ".join(s for (w, s) in skipped if w == "*")
    assert "stager_uva" in tiers and "stager_pinned" in tiers
    assert rep["tiers"]["measured"] == ["HOST", "PAGEABLE"]
    assert "Skipped:" in quick["output"]


def test_quick_ratios_section(quick: dict[str, Any]) -> None:
    ratios = quick["report"]["ratios"]
    assert set(ratios) == RATIOS
    for name, r in ratios.items():
        assert {"description", "target", "op", "measured", "passed", "applies", "status"} <= set(r), name
        if not r["applies"]:
            assert r["measured"] is None and r["passed"] is None and r["status"] == "n/a" and r["na"], name
            assert "skipped" not in r, name
        elif r["measured"] is None:
            assert r["passed"] is None and r["skipped"] and r["status"] == "skipped", name
        elif r["status"] == "info":  # a quick run on a CPU: measured, not judged
            assert r["passed"] is None and r["info"] == T.INFO_WHY, name
        else:
            assert isinstance(r["passed"], bool), name
            assert r["status"] == ("pass" if r["passed"] else "fail"), name
    # these can be computed on any machine
    anywhere = ["staged_write_256_speedup", "stage_write_8_ints_us"]
    if not vllm_mrv2.available():
        anywhere.append("pageable_stager_vs_mrv2_fallback")  # against vLLM's own NonUvaBuffer pool
    for name in anywhere:
        assert ratios[name]["measured"] is not None, ratios[name]
    sw = ratios["staged_write_256_speedup"]
    assert sw["measured"] == pytest.approx(sw["numerator_us"] / sw["denominator_us"], rel=1e-3)
    assert sw["size"] == "256x1"


def test_quick_metadata_guard_cost_and_plot(quick: dict[str, Any]) -> None:
    rep = quick["report"]
    keys = ("command", "commit", "versions", "device", "device_name", "config", "elapsed_s", "guard_cost")
    for key in keys:
        assert key in rep, key
    js, png = quick["json"], quick["png"]
    assert rep["command"] == f"python -m benchmarks --quick --json {js} --plot {png} --no-progress"
    assert rep["versions"]["torch"] == torch.__version__
    assert rep["guard_cost"], "guard cost was not measured"
    for by_size in rep["guard_cost"].values():
        for g in by_size.values():
            assert g["delta_e2e_us"] == pytest.approx(g["wait_e2e_us"] - g["off_e2e_us"], abs=0.011)
    png: Path = quick["png"]  # one figure per workload, named from --plot's path
    files = R.plot_paths(str(png), rep)
    assert [f.name for f in files] == [f"bench-{w}.png" for w in ("micro", "writes")]
    for f in files:
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    said = quick["output"].replace("\n", "")
    assert all(f.name in said for f in files)


# --- pieces ---------------------------------------------------------------------------------------


def test_a_repeat_is_prepared_timed_and_summarised() -> None:
    calls = [0]

    def step() -> None:
        calls[0] += 1

    iters = H.prepare(step, lambda: None, max_iters=40, target_s=0.001)
    assert 2 <= iters <= 40 and calls[0] >= 3 + 2  # the warm-up, then at least two calibration steps
    calls[0] = 0
    times = [H.time_repeat(step, lambda: None, iters) for _ in range(3)]
    assert calls[0] == 3 * iters and all(0 < h <= e for h, e in times)
    row = H.summarise([h for h, _ in times], [e for _, e in times], iters)
    assert row["iters"] == iters and row["repeats"] == 3 and len(row["e2e_samples_us"]) == 3
    assert row["host_us"] == pytest.approx(sorted(h for h, _ in times)[1], abs=1e-3)


def test_tier_env_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAGEBUF_TIER", "host")
    with H.stagebuf_tier("pageable"):
        assert os.environ["STAGEBUF_TIER"] == "pageable"
    assert os.environ["STAGEBUF_TIER"] == "host"
    with H.stagebuf_tier(None):
        assert "STAGEBUF_TIER" not in os.environ
    assert os.environ["STAGEBUF_TIER"] == "host"


def test_cli_fails_on_a_wrong_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    real = BL.RowCopyTable.write

    def drops_every_third_edit(self: Any, row: int, start: int, values: list[int]) -> None:
        self.n = getattr(self, "n", 0) + 1
        if self.n % 3:
            real(self, row, start, values)

    monkeypatch.setattr(BL.RowCopyTable, "write", drops_every_third_edit)
    res = invoke(
        main, ["--quick", "--no-progress", "--workload", "writes", "--edits", "16", "--lengths", "1"]
    )
    assert res.exit_code == 1
    assert "WRONG ANSWER: staged writes [row_copy_per_edit]" in res.output and "host model" in res.output


def test_seed_pool_and_row_copy_baselines_are_correct(vllm_interpreted: None) -> None:
    dev = torch.device("cpu")
    pool = BL.mrv2_fallback_pool(4, torch.int32, dev)
    for n in (3, 4, 9, 2):  # grows on 9
        x = np.arange(n, dtype=np.int32) + n
        assert pool.copy_to_uva(x).tolist() == x.tolist()
    t = BL.RowCopyTable((4, 8), dev, pinned=False)
    t.write(2, 3, [7, 8])
    assert t.dev[2].tolist() == [0, 0, 0, 7, 8, 0, 0, 0]


def test_writes_cases_verify_on_cpu(vllm_interpreted: None) -> None:
    env = H.Env(torch.device("cpu"), False, False, False)
    builds = [writes.row_copy, writes.staged, writes.staged_batched, writes.mrv2]
    for cell in (writes.WriteCell(1, 1), writes.WriteCell(16, 8), writes.WriteCell(40, 64)):
        for build in builds:
            case = build(env, cell)
            for _ in range(3):
                case.step()
            got = case.finish()
            assert got["verified"] and (got["edits"], got["length"]) == (cell.edits, cell.length)


def test_writes_cases_catch_a_wrong_table() -> None:
    env = H.Env(torch.device("cpu"), False, False, False)

    class SkipLastEdit(BL.RowCopyTable):
        skip = -1

        def write(self, row: int, start: int, values: list[int]) -> None:
            if row != self.skip:
                super().write(row, start, values)

    cell = writes.WriteCell(16, 8)
    ws = writes.write_sets(env, cell)
    t = SkipLastEdit(writes.write_shape(cell), env.device, pinned=False)
    t.skip = int(ws.rows[-1])
    case = writes.case("broken", cell, ws, writes.per_edit(t.write, ws), lambda: None, lambda: t.dev)
    case.step()
    with pytest.raises(H.BenchCheckError, match=r"broken\] E=16 L=8: 8 table cells"):
        case.finish()


def test_tier_restriction_and_unavailable_tier(tmp_path: Path) -> None:
    js = tmp_path / "r.json"
    args = [*QUICK_MICRO, "--tier", "pageable", "--json", str(js)]
    if not HAS_CUDA:
        args += ["--tier", "uva"]
    res = invoke(main, args)
    assert res.exit_code == 0, res.output
    rep = json.loads(js.read_text())
    assert rep["tiers"]["measured"] == ["PAGEABLE"]
    names = set(rep["results"]["micro"])
    assert {"stager_pageable", "pool_pageable", "floor", "list_tensor"} <= names
    assert not any(n.endswith("_host") for n in names)
    assert set(rep["results"]) == {"micro"}
    if not HAS_CUDA:
        assert any("stager_uva" in s["strategy"] for s in rep["skipped"])


def test_bad_sizes_is_a_usage_error() -> None:
    res = invoke(main, ["--sizes", "64,abc"])
    assert res.exit_code == 2 and "comma-separated" in res.output


MICRO = {  # synthetic micro medians at N=64, µs (the floor 20)
    "floor": 20.0, "stager_uva": 25.0, "pinned_buffer_per_array": 70.0, "stager_pinned": 40.0,
    "stager_pageable": 30.0, "mrv2_fallback_per_array": 100.0, "uva_pool_per_array": 30.0,
}  # fmt: skip


def _synthetic(values: dict[tuple[str, str, int | str], float]) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for (wl, name, size), v in values.items():
        entry = res.setdefault(wl, {}).setdefault(name, {"sizes": {}})
        entry["sizes"][str(size)] = {"host_us": v, "e2e_us": v}
    B.add_staging(res)
    return res


def test_ratios_from_synthetic_results() -> None:
    writes = {"row_copy_per_edit": 2000.0, "staged_write_uva": 50.0}
    res = _synthetic(
        {("micro", n, 64): v for n, v in MICRO.items()}
        | {("writes", n, "256x1"): v for n, v in writes.items()}
    )
    cfg = B.BenchConfig()
    r = B.compute_ratios(res, {}, [Tier.UVA, Tier.PINNED, Tier.PAGEABLE], cfg, "cuda:0")
    assert r["uva_stager_vs_pinned_per_array"]["measured"] == pytest.approx(5 / 50, rel=1e-3)
    assert r["uva_stager_vs_pinned_per_array"]["passed"] is True
    assert r["pinned_stager_vs_pinned_per_array"]["measured"] == pytest.approx(20 / 50, rel=1e-3)
    assert r["pinned_stager_vs_pinned_per_array"]["passed"] is False
    assert r["pageable_stager_vs_mrv2_fallback"]["measured"] == pytest.approx(10 / 80, rel=1e-3)
    assert r["staged_write_256_speedup"]["measured"] == pytest.approx(40.0)
    assert r["staged_write_256_speedup"]["passed"] is True
    worst = r["no_tier_slower_than_uva_pool"]
    assert worst["measured"] == pytest.approx(40 / 30, rel=1e-3) and worst["passed"] is False
    assert worst["worst"] == "micro stager_pinned"
    # nothing measured: skipped (or n/a), never a pass or a fail
    for device in ("cpu", "cuda:0"):
        empty = B.compute_ratios({}, {}, [], cfg, device)
        for v in empty.values():
            assert v["measured"] is None and v["passed"] is None, v
            assert v["skipped"] if v["applies"] else v["na"], v


def test_named_commit_wins_over_what_git_finds(monkeypatch: pytest.MonkeyPatch) -> None:
    # On the device machine the copied tree's .git can name an older HEAD than the files it holds.
    cfg = B.BenchConfig(device="cpu")
    m = B.detect(cfg)
    monkeypatch.delenv("STAGEBUF_BENCH_COMMIT", raising=False)
    found = B.metadata(m, cfg)["commit"]
    monkeypatch.setenv("STAGEBUF_BENCH_COMMIT", "0123abc")
    meta = B.metadata(m, cfg)
    assert meta["commit"] == "0123abc" and meta["dirty"] is None
    assert found != "0123abc"


# --- the MRV2 baselines: vLLM's own classes (vllm_mrv2.NEWEST's) ------------------------------------

CPU = torch.device("cpu")


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only behaviour")
def test_mrv2_uva_pool_refuses_a_machine_without_uva() -> None:
    with pytest.raises(Exception, match="UVA|accelerator|CUDA"):
        BL.mrv2_uva_pool(8, torch.int32, CPU)


def test_mrv2_baselines_are_vllms_own_classes(vllm_interpreted: None) -> None:
    pool = BL.mrv2_fallback_pool(8, torch.int32, CPU)
    sw = BL.mrv2_staged_write((4, 8), torch.int32, CPU)
    buf = BL.cpu_gpu_buffer(8, torch.int32, CPU)
    for obj, name in ((pool, "UvaBufferPool"), (sw, "StagedWriteTensor")):
        assert type(obj).__name__ == name
        assert type(obj).__init__.__code__.co_filename.endswith("vllm/v1/worker/gpu/buffer_utils.py")
    assert type(pool._uva_bufs[0]).__name__ == "NonUvaBuffer"  # no pinned memory: vLLM's fallback
    assert type(buf).__name__ == "CpuGpuBuffer"
    assert type(buf).__init__.__code__.co_filename.endswith("vllm/v1/utils.py")


def test_mrv2_pool_is_a_ring_without_a_guard(vllm_interpreted: None) -> None:
    # vLLM's own pool without pinned memory: a device tensor per slot, round robin, no guard
    pool = BL.mrv2_fallback_pool(8, torch.int32, CPU)
    outs = [pool.copy_to_uva(np.full(4, i, np.int32)) for i in range(3)]
    assert outs[0].data_ptr() != outs[1].data_ptr() and outs[2].data_ptr() == outs[0].data_ptr()
    # no guard: the third write rewrote the first slot, which the first result still views
    assert outs[0].tolist() == [2] * 4 and outs[1].tolist() == [1] * 4
    assert pool.copy_to_uva([5, 6]).tolist() == [5, 6]  # lists go through the numpy view


def test_mrv2_staged_write_matches_a_model(vllm_interpreted: None) -> None:
    """vLLM's StagedWriteTensor, loaded by the harness, on the CPU (Triton's interpreter)."""
    rows, cols = 24, 1600
    sw = BL.mrv2_staged_write((rows, cols), torch.int32, CPU)
    model = np.zeros((rows, cols), np.int32)
    rng = np.random.default_rng(5)
    for step in range(3):
        n = [1, 7, 12][step]
        for r in rng.permutation(rows)[:n]:
            ln = int(rng.integers(1, 40))
            st = int(rng.integers(0, cols - ln + 1))
            vals = rng.integers(-(1 << 30), 1 << 30, ln).tolist()
            sw.stage_write(int(r), st, vals)
            model[r, st : st + ln] = vals
        sw.stage_write(0, 3, [])  # an empty edit stages nothing
        sw.apply_write()
        assert np.array_equal(sw.gpu.numpy(), model), step
    long = list(range(1, 1024 + 300))  # longer than the kernel's 1024-element block
    sw.stage_write(5, 10, long)
    model[5, 10 : 10 + len(long)] = long
    sw.apply_write()
    assert np.array_equal(sw.gpu.numpy(), model)


@pytest.mark.gpu
def test_mrv2_staged_write_on_the_gpu_matches_a_model() -> None:
    dev = torch.device("cuda")
    if BL.triton_error():
        pytest.skip(BL.triton_error() or "")
    env = H.Env(dev, True, True, True)
    for cell in (writes.WriteCell(1, 1), writes.WriteCell(256, 8), writes.WriteCell(64, 64)):
        case = writes.mrv2(env, cell)
        for _ in range(5):
            case.step()
        assert case.finish()["verified"]


# --- the writes sweep -------------------------------------------------------------------------------


def test_write_sets_are_distinct_rows_inside_the_table() -> None:
    env = H.Env(CPU, False, False, False)
    for cell in (writes.WriteCell(1, 1), writes.WriteCell(256, 8), writes.WriteCell(4096, 64)):
        ws = writes.write_sets(env, cell)
        rows, cols = writes.write_shape(cell)
        assert cols >= 2 * cell.length and rows >= cell.edits
        assert len(set(ws.rows.tolist())) == cell.edits
        assert ws.starts.min() >= 0 and ws.starts.max() <= cols - cell.length
        assert ws.values[0].shape == (cell.edits, cell.length)
        assert [len(v) for _, _, v in ws.lists[1]] == [cell.length] * cell.edits
        model = np.zeros((rows, cols), np.int32)
        for r, st, v in ws.lists[1]:
            model[r, st : st + len(v)] = v
        assert np.array_equal(model, ws.want)
        assert not np.array_equal(ws.values[0], ws.values[1])


def test_write_cell_keys() -> None:
    c = writes.WriteCell(256, 8)
    assert str(c) == "256x8" and writes.WriteCell.parse("256x8") == c
    assert writes.WriteCell.parse("256") == writes.WriteCell(256, 1)  # reports from before the sweep
    assert sorted([writes.WriteCell(16, 1), writes.WriteCell(1, 64), writes.WriteCell(1, 8)]) == [
        writes.WriteCell(1, 8),
        writes.WriteCell(1, 64),
        writes.WriteCell(16, 1),
    ]


def test_plan_sweeps_every_edit_count_and_length() -> None:
    for quick in (True, False):
        cfg = B.BenchConfig.make(quick, device="cpu")
        m = B.detect(cfg)
        tasks, _, _ = B.plan(cfg, m)
        cells = {str(t.size) for t in tasks if t.workload == "writes" and t.section == "results"}
        assert cells == {f"{e}x{ln}" for e in cfg.edits for ln in cfg.lengths}
        only = {(t.strategy.name, str(t.size)) for t in tasks if t.section == "stage_only"}
        assert ("staged_write_host.stage_only", "256x8") in only
    assert B.BenchConfig.make(False).edits == (1, 16, 256, 4096)
    assert B.BenchConfig.make(False).lengths == (1, 8, 64)


def test_quick_writes_keys_and_stage_only(quick: dict[str, Any]) -> None:
    rep = quick["report"]
    cfg = rep["config"]
    cells = {f"{e}x{ln}" for e in cfg["edits"] for ln in cfg["lengths"]}
    for name, e in rep["results"]["writes"].items():
        assert set(e["sizes"]) == cells, name
        for key, row in e["sizes"].items():
            assert f"{row['edits']}x{row['length']}" == key and row["verified"]
    so = rep["staged_write_stage_only"]["staged_write_host.stage_only"]["256x8"]
    r = rep["ratios"]["stage_write_8_ints_us"]
    host = next(p for p in r["parts"] if p["numerator"] == "staged_write_host.stage_only")
    assert host["measured"] == pytest.approx(so["host_us"] / 256, rel=1e-3)
    assert r["measured"] == max(p["measured"] for p in r["parts"])
    said = quick["output"]
    assert "stage_write_8_ints_us" in said and "staged writes: E edits of L=1 elements" in said


def test_quick_targets_that_need_a_gpu_are_na_on_cpu(quick: dict[str, Any]) -> None:
    ratios = quick["report"]["ratios"]
    for name, r in ratios.items():
        gpu_only = name in GPU_RATIOS
        assert r["needs"] == ("cuda" if gpu_only else "cpu" if name in HOST_RATIOS else None), name
        if HAS_CUDA:
            assert r["applies"] is (name not in HOST_RATIOS), name
        else:
            assert r["applies"] is (not gpu_only), name
            if gpu_only:
                assert r["na"] == "needs a CUDA device; this run's device is cpu"
    if not HAS_CUDA:
        line = next(ln for ln in quick["output"].splitlines() if "staged_write_uva_vs_mrv2_e_le_16" in ln)
        assert "n/a" in line and "needs a CUDA device" in line and "FAIL" not in line
        for name in HOST_RATIOS:  # the HOST targets are measured on a CPU run
            assert ratios[name]["measured"] is not None, ratios[name]


# --- which runs judge their targets: a quick run on a CPU is informational -------------------------


def _result_cell(output: str, name: str) -> str:
    """The 'result' cell of target ``name`` in the printed targets table."""
    line = next(ln for ln in output.splitlines() if ln.startswith("│ " + name + " "))
    return line.split("│")[-2].strip()


def test_quick_on_a_cpu_prints_its_targets_without_judging_them(quick: dict[str, Any]) -> None:
    """issue 18 point 7: the quick CPU run's verdicts flipped with noise; there they are 'info'."""
    rep = quick["report"]
    if HAS_CUDA:  # a GPU run judges every target that applies
        assert rep["judged"] is True
        assert all(r.get("status") != "info" for r in rep["ratios"].values())
        return
    assert rep["judged"] is False
    measured = {n: r for n, r in rep["ratios"].items() if r.get("measured") is not None}
    assert {"staged_write_256_speedup", "stage_write_8_ints_us", *HOST_RATIOS} <= set(measured)
    for name, r in rep["ratios"].items():
        assert r["status"] in ("info", "skipped", "n/a") and r["passed"] is None, (name, r)
        assert all(p.get("passed") is None for p in r.get("parts", [])), name
        cell = _result_cell(quick["output"], name)
        if name in measured:
            assert r["status"] == "info" and r["info"] == T.INFO_WHY, name
            assert cell.startswith("info") and "pass" not in cell and "FAIL" not in cell, cell
            assert f"{r['measured']:.3f}" in next(ln for ln in quick["output"].splitlines() if name in ln)
    flat = " ".join(quick["output"].split())
    assert "info: not judged pass/fail. Why: a --quick run on a CPU is a smoke test" in flat


def test_which_runs_judge_from_synthetic_results() -> None:
    """One set of results: judged on a GPU (quick or not) and on a full CPU run; info on a quick CPU run."""
    writes = {("row_copy_per_edit", "256x1"): 2000.0, ("staged_write_uva", "256x1"): 200.0,
              ("staged_write_host", "256x1"): 50.0, ("row_copy_per_edit", "1x1"): 10.0,
              ("staged_write_host", "1x1"): 30.0}  # fmt: skip
    res = _synthetic(
        {("micro", n, 64): v for n, v in MICRO.items()} | {("writes", *k): v for k, v in writes.items()}
    )
    so = {"staged_write_host.stage_only": {"256x8": {"host_us": 512.0, "e2e_us": 512.0}}}
    gpu_tiers, cpu_tiers = [Tier.UVA, Tier.PINNED, Tier.PAGEABLE], [Tier.HOST, Tier.PAGEABLE]
    for quick in (False, True):
        cfg = B.BenchConfig(quick=quick)
        r = B.compute_ratios(res, so, gpu_tiers, cfg, "cuda:0")
        assert r["uva_stager_vs_pinned_per_array"]["status"] == "pass"  # 5 / 50 <= 0.2
        assert r["pinned_stager_vs_pinned_per_array"]["status"] == "fail"  # 20 / 50 > 0.3
        assert r["staged_write_256_speedup"]["status"] == "fail"  # 2000 / 200 < 20
        assert not any(e["status"] == "info" for e in r.values())
    full = B.compute_ratios(res, so, cpu_tiers, B.BenchConfig(), "cpu")
    assert full["staged_write_256_speedup"]["status"] == "pass"  # 2000 / 50 >= 20
    assert full["host_one_edit_vs_row_copy"]["status"] == "fail"  # 30 / 10 > 2
    assert full["stage_write_8_ints_us"]["status"] == "fail"  # 512 / 256 = 2 µs > 1
    quick = B.compute_ratios(res, so, cpu_tiers, B.BenchConfig(quick=True), "cpu")
    for name, e in quick.items():
        assert e["passed"] is None and e["status"] != "pass" and e["status"] != "fail", name
        assert e["status"] == ("info" if full[name]["status"] in ("pass", "fail") else full[name]["status"])
        assert e["measured"] == full[name]["measured"], name  # the number is still printed
    sw = quick["stage_write_8_ints_us"]
    assert sw["info"] == T.INFO_WHY and [p["passed"] for p in sw["parts"]] == [None, None]
    assert T.not_judged(True, "cuda:1") is None and T.not_judged(False, "cpu") is None
    engine_like = {"description": "an engine target", "measured": 1.5, "passed": False}  # no status field
    T.inform(engine_like, T.not_judged(True, "cpu"))
    assert engine_like["status"] == "info" and engine_like["passed"] is None
    assert T.status(engine_like) == "info"


def test_strict_fails_only_on_a_judged_target(quick: dict[str, Any], tmp_path: Path) -> None:
    rep = json.loads(json.dumps(quick["report"]))
    name = "staged_write_256_speedup"
    rep["ratios"][name].update(passed=None, status="info", info=T.INFO_WHY)
    info = tmp_path / "info.json"
    info.write_text(json.dumps(rep))
    others_fail = any(r.get("passed") is False for n, r in rep["ratios"].items() if n != name)
    res = invoke(main, ["--from-json", str(info), "--strict"])
    assert res.exit_code == (3 if others_fail else 0), res.output
    assert "info: not judged (see below)" in _result_cell(res.output, name)
    rep["ratios"][name].update(passed=False, status="fail")
    rep["ratios"][name].pop("info")
    failed = tmp_path / "fail.json"
    failed.write_text(json.dumps(rep))
    res = invoke(main, ["--from-json", str(failed), "--strict"])
    assert res.exit_code == 3 and "FAIL" in _result_cell(res.output, name)
    md = tmp_path / "b.md"
    assert invoke(main, ["--from-json", str(info), "--markdown", str(md)]).exit_code == 0
    line = next(ln for ln in md.read_text().splitlines() if f"`{name}`" in ln)
    assert line.endswith("| info (not judged) |") and f"Why: {T.INFO_WHY}." in md.read_text()


def test_a_real_run_records_its_command(tmp_path: Path) -> None:
    """``python -m benchmarks`` in its own process: the report names that command, as given."""
    import subprocess

    js = tmp_path / "r.json"
    args = ["--quick", "--no-progress", "--workload", "micro", "--sizes", "64", "--tier", "host"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    env.pop("STAGEBUF_TIER", None)
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", *args, "--json", str(js)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rep = json.loads(js.read_text())
    assert rep["command"] == " ".join(["python -m benchmarks", *args, "--json", str(js)])


def _cells(values: dict[str, dict[str, float]]) -> dict[str, Any]:
    """writes results from {strategy: {cell: µs}}."""
    return _synthetic({("writes", name, cell): v for name, by in values.items() for cell, v in by.items()})


def test_per_cell_targets_from_synthetic_results() -> None:
    cfg = B.BenchConfig(edits=(1, 16, 256), lengths=(1, 8))
    mrv2 = {"1x1": 100.0, "1x8": 100.0, "16x1": 200.0, "16x8": 200.0, "256x1": 1000.0, "256x8": 2000.0}
    res = _cells(
        {
            "mrv2_staged_write": mrv2,
            "staged_write_uva": {
                "1x1": 40.0,
                "1x8": 45.0,
                "16x1": 120.0,
                "16x8": 80.0,
                "256x1": 600.0,
                "256x8": 1000.0,
            },
            "staged_writes_uva": {"256x1": 150.0, "256x8": 300.0},
            "staged_write_pinned": {c: 0.5 * v for c, v in mrv2.items()},
            "row_copy_per_edit": {"1x1": 10.0},
            "staged_write_host": {"1x1": 30.0},
        }
    )
    r = B.compute_ratios(res, {}, [Tier.UVA, Tier.PINNED, Tier.PAGEABLE], cfg, "cuda:0")
    small = r["staged_write_uva_vs_mrv2_e_le_16"]
    assert [p["size"] for p in small["parts"]] == ["1x1", "1x8", "16x1", "16x8"]
    assert small["measured"] == pytest.approx(0.6) and small["worst_size"] == "16x1"
    assert small["passed"] is False and small["status"] == "fail"
    assert [p["passed"] for p in small["parts"]] == [True, True, False, True]
    assert "staged_write_uva_vs_mrv2_e_ge_256" not in r  # retired
    batched = r["staged_writes_uva_vs_mrv2_e_ge_256"]
    assert batched["measured"] == pytest.approx(0.15) and batched["worst_size"] == "256x1"
    assert batched["passed"] is True
    assert r["staged_write_pinned_vs_mrv2"]["measured"] == pytest.approx(0.5)
    assert r["staged_write_pinned_vs_mrv2"]["passed"] is True
    pageable = r["staged_write_pageable_vs_mrv2"]  # not measured: skipped, with each missing cell
    assert pageable["measured"] is None and pageable["status"] == "skipped"
    assert "writes staged_write_pageable at ExL=16x8" in pageable["skipped"]
    # HOST targets do not apply to a GPU run
    assert r["host_one_edit_vs_row_copy"]["status"] == "n/a"
    assert "device is cuda:0" in r["host_one_edit_vs_row_copy"]["na"]
    on_cpu = B.compute_ratios(res, {}, [Tier.HOST], cfg, "cpu")
    assert on_cpu["host_one_edit_vs_row_copy"]["measured"] == pytest.approx(3.0)
    assert on_cpu["host_one_edit_vs_row_copy"]["passed"] is False
    assert on_cpu["staged_write_uva_vs_mrv2_e_le_16"]["status"] == "n/a"
    assert "parts" not in on_cpu["staged_write_uva_vs_mrv2_e_le_16"]
    # a sweep with no E >= 256: skipped with why, not a pass
    r = B.compute_ratios(res, {}, [Tier.UVA], B.BenchConfig(edits=(1, 16), lengths=(1,)), "cuda:0")
    assert r["staged_writes_uva_vs_mrv2_e_ge_256"]["skipped"] == (
        "no cell of this run's writes sweep has E >= 256"
    )


def test_stage_write_and_pool_targets_from_synthetic_results() -> None:
    cfg = B.BenchConfig()
    res = _synthetic(
        {("micro", n, 64): v for n, v in (("floor", 20.0), ("pool_uva", 30.0), ("mrv2_uva_pool", 28.0))}
    )
    stage_only = {
        "staged_write_uva.stage_only": {"256x8": {"host_us": 192.0, "e2e_us": 200.0}},
        "staged_write_pinned.stage_only": {"256x8": {"host_us": 320.0, "e2e_us": 330.0}},
    }
    r = B.compute_ratios(res, stage_only, [Tier.UVA, Tier.PINNED, Tier.PAGEABLE], cfg, "cuda:0")
    sw = r["stage_write_8_ints_us"]
    assert sw["measured"] == pytest.approx(1.25) and sw["passed"] is False
    assert sw["worst_note"] == "PINNED" and sw["applies"] is True
    assert [p["measured"] for p in sw["parts"][:2]] == [pytest.approx(0.75), pytest.approx(1.25)]
    assert sw["parts"][2]["skipped"]  # PAGEABLE: not measured
    pool = r["pool_vs_mrv2_pool"]
    assert pool["measured"] == pytest.approx(10 / 8) and pool["passed"] is False


def test_plot_without_matplotlib_writes_the_rest_then_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for mod in ("matplotlib", "matplotlib.figure", "matplotlib.backends", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, mod, None)  # makes ``import matplotlib...`` raise ImportError
    js, md, png = tmp_path / "r.json", tmp_path / "r.md", tmp_path / "r.png"
    res = invoke(
        main, [*QUICK_MICRO, "--tier", "host", "--json", str(js), "--markdown", str(md), "--plot", str(png)]
    )
    assert res.exit_code == 1, res.output
    assert "bash scripts/setup.sh bench" in res.output and "requirements/bench.txt" in res.output
    assert "Traceback" not in res.output and isinstance(res.exception, SystemExit)
    assert json.loads(js.read_text())["results"]["micro"]["stager_host"]
    assert "#### targets" in md.read_text()
    assert not png.exists() and not list(tmp_path.glob("r-*.png"))


def test_the_bench_without_its_extra_names_the_set_up_command() -> None:
    """python -m benchmarks without click: one line naming the set-up command, exit 2, no traceback."""
    import subprocess

    code = (
        "import sys, runpy; sys.modules['click'] = None; runpy.run_module('benchmarks', run_name='__main__')"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "bash scripts/setup.sh bench" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
