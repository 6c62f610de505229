"""Without a reachable package registry the suite passes or skips, and says why.

Some tests fetch released files with pip: the wheel of each vLLM release in ``vllm_mrv2.RELEASES``
(``benchmarks.vllm_mrv2.fetch``: its MRV2 Python files, run against stagebuf, kept in
``~/.cache/stagebuf/vllm-<release>``) and nano-vllm-fork's (``benchmarks.nanovllm_pkg.fetch``, into
``.cache/``) (README, "From a checkout"). Here those tests run in a child pytest with empty caches and pip
pointed at an address that refuses connections: none may fail, and each skip (each release's too) must
print its reason.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FETCHING = [
    "tests/bench/test_engine.py",
    "tests/unit/test_vllm_plugin.py",
    "tests/unit/test_vllm_step.py",
    "tests/unit/test_nanovllm.py",
]
"""Test files whose tests need files fetched from the registry (the quick bench's are in test_bench.py)."""


def test_the_network_tests_skip_with_their_reason_when_the_registry_is_unreachable(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(
        STAGEBUF_CACHE_DIR=str(tmp_path / "cache"),  # empty: nothing fetched before
        STAGEBUF_VLLM_DIR=str(tmp_path / "vllm"),
        STAGEBUF_NANOVLLM_DIR=str(tmp_path / "nanovllm"),
        PIP_CONFIG_FILE=os.devnull,  # no configured index, mirror or wheel folder
        PIP_INDEX_URL="http://127.0.0.1:9/simple",  # refuses connections
        PIP_RETRIES="0",
        PIP_TIMEOUT="5",
    )
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *FETCHING]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    summary = out.strip().splitlines()[-1]
    assert "passed" in summary and not re.search(r"\d+ (failed|errors?)\b", summary), out[-3000:]
    skips = [ln for ln in out.splitlines() if ln.startswith("SKIPPED")]
    fetched = [ln for ln in skips if "pip download" in ln or "could not be fetched" in ln]
    assert fetched, out[-3000:]  # at least the vLLM and nano-vllm tests said why
    assert all("pip download" in ln for ln in fetched), fetched
    from benchmarks import vllm_mrv2

    for r in vllm_mrv2.RELEASES:  # each release's tests say which release could not be had
        assert any(f"vllm=={r} failed" in ln for ln in fetched), (r, fetched)


def test_the_readme_says_which_tests_use_the_network_and_why() -> None:
    text = (ROOT / "README.md").read_text()
    tests = " ".join(text[text.index("## From a checkout") : text.index("## The contract")].split())
    assert "use the network" in tests and "pip download --no-deps" in tests and "`.cache/`" in tests
    assert (
        "`RELEASES`" in tests
        and "`~/.cache/stagebuf/vllm-<release>/`" in tests
        and "STAGEBUF_CACHE_DIR" in tests
    )
    assert "nano-vllm" in tests and "skip" in tests and "reason" in tests
