"""The bench tests' shared fixture: vLLM's released files (``vllm_mrv2.NEWEST``'s, and each release's
where a test takes ``vllm_release``), its Triton kernels interpreted."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from benchmarks import vllm_mrv2
from benchmarks.harness import env_var


@pytest.fixture(scope="module")
def triton_interpreted() -> Iterator[None]:
    """``TRITON_INTERPRET=1`` for the module (Triton read it when vLLM's kernels are decorated: before they
    load); skips where Triton is missing. Tests that take ``vllm_release`` fetch their release there."""
    pytest.importorskip("triton", reason="vLLM's MRV2 kernels are Triton kernels")
    with env_var("TRITON_INTERPRET", "1"):
        yield


@pytest.fixture(scope="module")
def vllm_interpreted() -> Iterator[None]:
    """The newest release's files fetched (``vllm_mrv2.fetch``: from its wheel on the package index; the
    module's tests skip, saying why, where that fails) and ``TRITON_INTERPRET=1``, read when vLLM's kernels
    are decorated: before they load. (A test that takes ``vllm_release`` fetches each release in turn, and
    skips that release alone where it cannot.)"""
    pytest.importorskip("triton", reason="vLLM's MRV2 kernels are Triton kernels")
    try:
        vllm_mrv2.fetch()
    except vllm_mrv2.Unavailable as e:
        pytest.skip(f"vLLM {vllm_mrv2.NEWEST}'s files could not be fetched: {e}")
    with env_var("TRITON_INTERPRET", "1"):
        yield
