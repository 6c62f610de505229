"""The bench tests' shared fixture: vLLM 0.33.0's released files, its Triton kernels interpreted."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from benchmarks import vllm_mrv2
from benchmarks.engine import env_var


@pytest.fixture(scope="module")
def vllm_interpreted() -> Iterator[None]:
    """vLLM's files fetched (``vllm_mrv2.fetch``: the installed vLLM 0.33.0, or its wheel from the package
    index; the module's tests skip, saying why, where that fails) and ``TRITON_INTERPRET=1``, read when
    vLLM's kernels are decorated: before they load."""
    pytest.importorskip("triton", reason="vLLM's MRV2 kernels are Triton kernels")
    try:
        vllm_mrv2.fetch()
    except vllm_mrv2.Unavailable as e:
        pytest.skip(f"vLLM {vllm_mrv2.VERSION}'s files could not be fetched: {e}")
    with env_var("TRITON_INTERPRET", "1"):
        yield
