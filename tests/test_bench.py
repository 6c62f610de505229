"""``stagebuf bench``: the quick run CI does, and the pieces it is made of.

No expected timings here: only that every strategy that can run did, with
positive numbers, that the decode loop's checks ran and catch a wrong answer,
and that the ratios are computed as documented.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from stagebuf import bench as B
from stagebuf import bench_workloads as W
from stagebuf.cli import main

HAS_CUDA = torch.cuda.is_available()

CPU_STRATEGIES = {
    "micro": {"list_tensor", "seed_pageable_per_array", "pool_host", "stager_host", "pool_pageable",
              "stager_pageable", "floor"},
    "decode": {"list_tensor", "seed_pageable_per_array", "stager_host", "stager_pageable", "floor"},
    "writes": {"row_copy_per_edit", "staged_write_host", "staged_write_pageable"},
}
CUDA_ONLY = {
    "micro": {"pinned_tensor_per_array", "pinned_buffer_per_array", "seed_uva_pool_per_array"},
    "decode": {"pinned_tensor_per_array", "pinned_buffer_per_array", "seed_uva_pool_per_array"},
}
RATIOS = {"uva_stager_vs_pinned_per_array", "pinned_stager_vs_pinned_per_array",
          "pageable_stager_vs_seed_nonuva", "staged_write_256_speedup", "decode_pageable_vs_uva",
          "no_tier_slower_than_seed_uva"}


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One ``stagebuf bench --quick --json --plot`` run, shared by the tests below."""
    out = tmp_path_factory.mktemp("bench")
    js, png = out / "bench.json", out / "bench.png"
    old = os.environ.pop("STAGEBUF_TIER", None)
    try:
        res = CliRunner().invoke(main, ["bench", "--quick", "--no-progress", "--json", str(js),
                                        "--plot", str(png)])
    finally:
        if old is not None:
            os.environ["STAGEBUF_TIER"] = old
    assert res.exit_code == 0, res.output + repr(res.exception)
    return {"report": json.loads(js.read_text()), "png": png, "json": js, "output": res.output}


def test_quick_has_every_cpu_strategy_with_positive_numbers(quick: dict[str, Any]) -> None:
    res = quick["report"]["results"]
    for wl, names in CPU_STRATEGIES.items():
        assert names <= set(res[wl]), f"{wl}: missing {names - set(res[wl])}"
        for name in names:
            sizes = res[wl][name]["sizes"]
            assert sizes, (wl, name)
            for size, row in sizes.items():
                assert row["host_us"] > 0 and row["e2e_us"] > 0, (wl, name, size, row)
                assert row["iters"] >= 2 and len(row["e2e_samples_us"]) == row["repeats"]
    cfg = quick["report"]["config"]
    assert sorted(int(s) for s in res["micro"]["floor"]["sizes"]) == sorted(cfg["sizes"])
    assert sorted(int(s) for s in res["writes"]["row_copy_per_edit"]["sizes"]) == sorted(cfg["edits"])


def test_quick_records_each_strategy_tier(quick: dict[str, Any]) -> None:
    for wl, data in quick["report"]["results"].items():
        for name, e in data.items():
            if e["kind"] == "stagebuf":
                assert e["tier"] == name.rsplit("_", 1)[1].upper(), (wl, name)
            else:
                assert e["tier"] is None, (wl, name)


def test_markdown_and_plot_from_an_earlier_json(quick: dict[str, Any], tmp_path: Path) -> None:
    md, png = tmp_path / "b.md", tmp_path / "b.png"
    res = CliRunner().invoke(main, ["bench", "--from-json", str(quick["json"]), "--markdown", str(md),
                                    "--plot", str(png)])
    assert res.exit_code == 0, res.output
    text = md.read_text()
    for part in ("#### micro", "#### decode", "#### writes", "#### targets", "`stager_pageable`",
                 "staged_write_256_speedup", quick["report"]["command"]):
        assert part in text, part
    assert png.stat().st_size > 0


def test_quick_staging_is_strategy_minus_floor(quick: dict[str, Any]) -> None:
    micro = quick["report"]["results"]["micro"]
    for name, e in micro.items():
        for size, row in e["sizes"].items():
            want = row["e2e_us"] - micro["floor"]["sizes"][size]["e2e_us"]
            assert row["staging_e2e_us"] == pytest.approx(want, abs=1e-2), (name, size)


def test_quick_decode_loop_checked_its_answers(quick: dict[str, Any]) -> None:
    decode = quick["report"]["results"]["decode"]
    for name, e in decode.items():
        row = next(iter(e["sizes"].values()))
        if name == "floor":
            continue
        assert row["checks"] >= 1, name
        assert row["steps"] > W.DECODE_WARMUP
    assert decode["stager_pageable"]["sizes"]["256"]["tier"] == "PAGEABLE"
    assert decode["stager_host"]["sizes"]["256"]["tier"] == "HOST"


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
    assert "skipped" in quick["output"]


def test_quick_ratios_section(quick: dict[str, Any]) -> None:
    ratios = quick["report"]["ratios"]
    assert set(ratios) == RATIOS
    for name, r in ratios.items():
        assert {"description", "target", "op", "measured", "passed"} <= set(r), name
        if r["measured"] is None:
            assert r["passed"] is None and r["skipped"], name
        else:
            assert isinstance(r["passed"], bool), name
    # these two can be computed on any machine
    for name in ("pageable_stager_vs_seed_nonuva", "staged_write_256_speedup"):
        assert ratios[name]["measured"] is not None, ratios[name]
    sw = ratios["staged_write_256_speedup"]
    assert sw["measured"] == pytest.approx(sw["numerator_us"] / sw["denominator_us"], rel=1e-3)
    assert "breakdown" in sw
    if not HAS_CUDA:
        assert ratios["uva_stager_vs_pinned_per_array"]["skipped"]


def test_quick_metadata_guard_cost_and_plot(quick: dict[str, Any]) -> None:
    rep = quick["report"]
    keys = ("command", "commit", "versions", "device", "device_name", "config", "elapsed_s", "guard_cost")
    for key in keys:
        assert key in rep, key
    assert "bench" in rep["command"] and rep["versions"]["torch"] == torch.__version__
    assert rep["guard_cost"], "guard cost was not measured"
    for by_size in rep["guard_cost"].values():
        for g in by_size.values():
            assert g["delta_e2e_us"] == pytest.approx(g["wait_e2e_us"] - g["off_e2e_us"], abs=0.011)
    png: Path = quick["png"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- pieces ---------------------------------------------------------------------------------------


def test_measure_counts_warmup_and_fixed_iters() -> None:
    calls = [0]

    def step() -> None:
        calls[0] += 1

    m = B.measure(step, lambda: None, repeats=3, max_iters=50, target_s=0.001, min_warmup=7, fixed_iters=11)
    assert calls[0] == 7 + 3 * 11
    assert m.iters == 11 and m.repeats == 3 and len(m.host_samples_us) == 3
    assert m.host_us > 0 and m.e2e_us >= m.host_us * 0.5
    calls[0] = 0
    m = B.measure(step, lambda: None, repeats=2, max_iters=40, target_s=0.001)
    assert 2 <= m.iters <= 40


def test_tier_env_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAGEBUF_TIER", "host")
    with B.tier_env(W.Tier.PAGEABLE):
        assert os.environ["STAGEBUF_TIER"] == "pageable"
    assert os.environ["STAGEBUF_TIER"] == "host"
    with B.tier_env(None):
        assert "STAGEBUF_TIER" not in os.environ
    assert os.environ["STAGEBUF_TIER"] == "host"


def test_decode_sim_model_is_consistent() -> None:
    sim = W.DecodeSim(32, block_size=16, max_prompt=8, max_len=128, seed=3)
    replay = np.zeros_like(sim.table)
    arrivals = 0
    for _ in range(400):
        st = sim.advance()
        for row, start, values in st.edits:
            replay[row, start:start + len(values)] = values
        arrivals += int(np.count_nonzero(st.qsl[1:] - st.qsl[:-1] > 1))
        assert st.qsl[0] == 0 and st.qsl[-1] == st.pos.shape[0]
        assert np.all(np.diff(st.qsl) >= 1)
        assert len(set(st.idx.tolist())) == sim.batch  # one row per running request
        assert np.all(sim.nblk == -(-st.seq // 16))
        assert np.all(st.pos < np.repeat(st.seq, np.diff(st.qsl)))
        live = np.arange(sim.max_blocks)[None, :] < sim.nblk[:, None]
        assert np.array_equal(replay[st.idx][live], sim.table[st.idx][live])
        assert np.all(sim.table[st.idx][live] > 0)
    assert arrivals > 0, "no request finished and was replaced"


def test_slot_mapping_matches_host_model() -> None:
    sim = W.DecodeSim(16, seed=1)
    table = torch.zeros(sim.table.shape, dtype=torch.int32)
    tok = torch.arange(sim.max_tokens, dtype=torch.int32)
    for _ in range(100):
        st = sim.advance()
        table.copy_(torch.from_numpy(sim.table))
        d = [torch.from_numpy(a) for a in (st.idx, st.pos, st.seq, st.qsl)]
        slots = W.slot_mapping(*d, table, tok, 16)
        assert np.array_equal(slots.numpy(), sim.reference_slots(st))
        sim.check("t", st, slots, table)


def test_decode_check_fails_loudly_on_a_wrong_table() -> None:
    env = W.Env(torch.device("cpu"), False, False, False, check_every=5, decode_steps=10)

    class DropEveryThirdEdit(W.RowCopyTable):
        n = 0

        def write(self, row: int, start: int, values: list[int]) -> None:
            self.n += 1
            if self.n % 3:
                super().write(row, start, values)

    case = W._decode_case(env, 32, "broken", W._per_array(torch.from_numpy),
                          lambda sim: DropEveryThirdEdit(W._table_shape(sim), env.device, False).ops())
    with pytest.raises(W.BenchCheckError, match="broken"):
        for _ in range(20):
            case.step()


def test_cli_fails_on_a_wrong_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    real = W.slot_mapping

    def off_by_one(*args: Any) -> torch.Tensor:
        return real(*args) + 1

    monkeypatch.setattr(W, "slot_mapping", off_by_one)
    res = CliRunner().invoke(main, ["bench", "--quick", "--no-progress", "--workload", "decode",
                                    "--decode-steps", "5", "--check-every", "5"])
    assert res.exit_code == 1
    assert "WRONG ANSWER: decode loop [" in res.output and "host model" in res.output


def test_seed_pool_and_row_copy_baselines_are_correct() -> None:
    dev = torch.device("cpu")
    pool = W.seed_nonuva_pool(4, torch.int32, dev)
    for n in (3, 4, 9, 2):  # grows on 9
        x = np.arange(n, dtype=np.int32) + n
        assert pool.copy_to_uva(x).tolist() == x.tolist()
    t = W.RowCopyTable((4, 8), dev, pinned=False)
    t.write(2, 3, [7, 8])
    assert t.dev[2].tolist() == [0, 0, 0, 7, 8, 0, 0, 0]


def test_writes_cases_verify_on_cpu() -> None:
    env = W.Env(torch.device("cpu"), False, False, False)
    for build in (W.writes_row_copy, W.writes_staged):
        case = build(env, 16)
        for _ in range(3):
            case.step()
        assert case.finish()["verified"]


def test_tier_restriction_and_unavailable_tier(tmp_path: Path) -> None:
    js = tmp_path / "r.json"
    args = ["bench", "--quick", "--no-progress", "--workload", "micro", "--sizes", "64", "--tier", "pageable",
            "--json", str(js)]
    if not HAS_CUDA:
        args += ["--tier", "uva"]
    res = CliRunner().invoke(main, args)
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
    res = CliRunner().invoke(main, ["bench", "--sizes", "64,abc"])
    assert res.exit_code == 2 and "comma-separated" in res.output


def _synthetic(values: dict[tuple[str, str, int], float]) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for (wl, name, size), v in values.items():
        entry = res.setdefault(wl, {}).setdefault(name, {"sizes": {}})
        entry["sizes"][str(size)] = {"host_us": v, "e2e_us": v}
    B._add_staging(res)
    return res


def test_ratios_from_synthetic_results() -> None:
    T = W.Tier
    res = _synthetic({
        ("micro", "floor", 64): 20.0, ("micro", "stager_uva", 64): 25.0,
        ("micro", "pinned_buffer_per_array", 64): 70.0, ("micro", "stager_pinned", 64): 40.0,
        ("micro", "stager_pageable", 64): 30.0, ("micro", "seed_pageable_per_array", 64): 100.0,
        ("micro", "seed_uva_pool_per_array", 64): 30.0,
        ("decode", "stager_uva", 256): 100.0, ("decode", "stager_pinned", 256): 105.0,
        ("decode", "stager_pageable", 256): 120.0, ("decode", "seed_uva_pool_per_array", 256): 100.0,
        ("writes", "row_copy_per_edit", 256): 2000.0, ("writes", "staged_write_uva", 256): 50.0,
    })
    cfg = B.BenchConfig()
    r = B.compute_ratios(res, {}, [T.UVA, T.PINNED, T.PAGEABLE], cfg, "cuda:0")
    assert r["uva_stager_vs_pinned_per_array"]["measured"] == pytest.approx(5 / 50, rel=1e-3)
    assert r["uva_stager_vs_pinned_per_array"]["passed"] is True
    assert r["pinned_stager_vs_pinned_per_array"]["measured"] == pytest.approx(20 / 50, rel=1e-3)
    assert r["pinned_stager_vs_pinned_per_array"]["passed"] is False
    assert r["pageable_stager_vs_seed_nonuva"]["measured"] == pytest.approx(10 / 80, rel=1e-3)
    assert r["staged_write_256_speedup"]["measured"] == pytest.approx(40.0)
    assert r["staged_write_256_speedup"]["passed"] is True
    assert r["decode_pageable_vs_uva"]["measured"] == pytest.approx(1.2)
    worst = r["no_tier_slower_than_seed_uva"]
    assert worst["measured"] == pytest.approx(40 / 30, rel=1e-3) and worst["passed"] is False
    assert worst["worst"] == "micro stager_pinned"
    # nothing measured: skipped, never a pass or a fail
    empty = B.compute_ratios({}, {}, [], cfg, "cpu")
    assert all(v["measured"] is None and v["passed"] is None and v["skipped"] for v in empty.values())


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
