"""stagebuf: host-to-device staging for inference engines, on every machine.

Tiers, best first: UVA (zero copies) -> PINNED (one async copy) -> PAGEABLE
(one copy from plain memory) -> HOST (no accelerator). ``capabilities()``
decides the tier once per device; everything else asks it.

Importing stagebuf does not initialise CUDA: probing happens on first use.
"""

from __future__ import annotations

from typing import Any

from .async_copy import async_copy_to_gpu
from .buffers import HostBuffer, NonUvaBuffer, PinnedBuffer, StagingBuffer, UvaBuffer, make_buffer
from .guard import SlotInFlightError, StepRuleError, begin_step
from .memory import DeviceAllocationError, PinnedAllocationError
from .param_table import DeviceParamTable, ParamField
from .pool import UvaBackedTensor, UvaBufferPool, set_default_max_concurrency
from .probe import (
    Capabilities,
    SetupError,
    TierUnavailableError,
    capabilities,
    is_pin_memory_available,
    is_uva_available,
    reset_capabilities,
)
from .staged_write import FusedStagedWriter, StagedWriteError, StagedWriteTensor
from .stager import Step, StepStager
from .tier import Tier
from .uva import UvaError

__version__ = "0.1.0"

__all__ = [
    "Capabilities",
    "SetupError",
    "DeviceAllocationError",
    "DeviceParamTable",
    "FusedStagedWriter",
    "ParamField",
    "StagedWriteTensor",
    "HostBuffer",
    "NonUvaBuffer",
    "PinnedAllocationError",
    "PinnedBuffer",
    "SlotInFlightError",
    "StagedWriteError",
    "StepRuleError",
    "StagingBuffer",
    "Step",
    "StepStager",
    "Tier",
    "TierUnavailableError",
    "UvaBackedTensor",
    "UvaBuffer",
    "UvaBufferPool",
    "UvaError",
    "async_copy_to_gpu",
    "begin_step",
    "capabilities",
    "is_pin_memory_available",
    "is_uva_available",
    "make_buffer",
    "reset_capabilities",
    "set_default_max_concurrency",
]


def __getattr__(name: str) -> Any:
    # PIN_MEMORY is computed on first access so that import does not touch CUDA.
    if name == "PIN_MEMORY":
        return is_pin_memory_available()
    raise AttributeError(f"module 'stagebuf' has no attribute {name!r}")
