"""Constants shared by more than one module: alignment, environment variables, check-mode poison."""

from __future__ import annotations

import os

ALIGN = 16
"""Byte alignment of every array packed into a staging arena."""

ENV_TIER = "STAGEBUF_TIER"
"""Forces a tier (``uva``, ``pinned``, ``pageable``, ``host``); one that cannot work here raises."""
ENV_WSL_PIN = "STAGEBUF_WSL_PIN_MEMORY"
"""``1`` lets the probe try pinned memory on WSL2 (off by default: pinning there is capped)."""
ENV_CHECK = "STAGEBUF_CHECK"
"""``1`` turns on check mode: poison for what a step has not published or has released, and
the step clock's per-ring verifier."""
ENV_VLLM = "STAGEBUF_VLLM"
"""``1`` makes stagebuf vLLM's MRV2 buffer layer through the vLLM plugin; unset or ``0``: vLLM's own."""
ENV_KERNEL = "STAGEBUF_WRITE_KERNEL"
"""Forces the staged-write apply kernel (``scatter`` or ``triton``); ``auto`` (default) picks per batch."""

POISON = 0xFF
"""Check mode fills memory that must not be read with this byte (int -1, float NaN)."""

DEFAULT_MAX_CONCURRENCY = 2
"""Slots per ring unless ``max_concurrency`` or ``set_default_max_concurrency`` says otherwise."""


def check_mode() -> bool:
    """Whether ``STAGEBUF_CHECK=1``: poison what a step has not published and what it released."""
    return os.environ.get(ENV_CHECK, "").strip() not in ("", "0")
