"""nano-vllm's real engine end to end on the GPU (``benchmarks.e2e``), with a tiny random Qwen3.

One engine generates the small workloads on its own preparation and attached on UVA, PINNED and PAGEABLE;
then, with pinning refused as a machine without pinned memory refuses it, nano-vllm's own engine fails to
start and an engine started attached (``attach(ModelRunner)`` before ``LLM(...)``) generates. Every setup
must generate the own engine's token ids.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from benchmarks import e2e as E

import stagebuf
from helpers import nano_or_skip

pytestmark = pytest.mark.gpu

TINY = E.EngineConfig(
    max_num_seqs=64, max_model_len=1024, max_num_batched_tokens=4096, gpu_memory_utilization=0.1
)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    nano_or_skip(cuda=True)
    for mod in ("safetensors", "tokenizers", "transformers", "xxhash"):
        pytest.importorskip(mod, reason=f"nano-vllm's engine needs {mod}")
    from benchmarks import e2e_model as M

    return M.write_model(tmp_path_factory.mktemp("model") / "tiny", "tiny", seed=0)


def test_every_setup_generates_the_own_engines_tokens_and_starts_without_pinned_memory(model: Path) -> None:
    workloads = {k: E.SMALL[k] for k in ("mixed", "decode")}
    m = E.measure(model, workloads, rounds=1, cfg=TINY, nopin=True, log=lambda s: None)
    runs = m["runs"]
    assert sorted({r["setup"] for r in runs}) == sorted((*E.SETUPS, E.NOPIN))
    assert len(runs) == len(workloads) * (len(E.SETUPS) + 1)
    assert [r for r in runs if not r["identical"]] == []
    tiers = {r["setup"]: r["tier"] for r in runs}
    assert tiers["own"] is None and tiers[E.NOPIN] == "PAGEABLE"
    assert tiers["stagebuf_pinned"] == "PINNED" and tiers["stagebuf_pageable"] == "PAGEABLE"
    if stagebuf.capabilities().uva:
        assert tiers["stagebuf_uva"] == "UVA"
    assert m["no_pin"]["own_error"] and "pinned memory" in m["no_pin"]["own_error"]
    mixed = [r for r in runs if r["workload"] == "mixed"]
    assert all(r["decode"]["tokens"] > 0 and r["prefill"]["tokens"] > 0 for r in mixed)
    s = E.summarize(m)
    assert s["ratios"]["e2e_nanovllm_tokens_identical"]["status"] == "pass"
